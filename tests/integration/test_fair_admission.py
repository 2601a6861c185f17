"""Fair admission: a new trainer's Hello is read, queued and answered while
ingest is saturated. Another connection holds the database's write lock, so
the writer cannot commit: a streaming rank fills the writer queue and ingest
stops reading it (backpressure). A new connection's Hello must still be
read and queued beyond the bound while that holds (before, no connection
was read until the queue drained, and a trainer got no Welcome within 10 s
under saturating ingest); once the lock goes, both get their answers.

No timing decides the verdict: the Hello is read while the writer is held
and can commit nothing, or it is not read at all. The latency itself is
measured by tests/bench/bench_datapath.py (Welcome median / max). The order
in which the writer then commits (queued Hellos first) is checked exactly in
tests/unit/test_store.c (hello_is_accepted_when_full_and_written_first)."""
import sqlite3
import threading

from fstest import (Daemon, Failure, RawConn, check, hello, kill_started, metrics, proto_module,
                    report, run_main, wait_until)

QUEUE = 64
BATCH = 4
REPORTS = 400


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    d = Daemon(args.build_dir, workdir,
               extra=["--set", f"writer_queue_max_items={QUEUE}",
                      "--set", f"writer_batch_max_items={BATCH}"])
    lock = None
    try:
        s = RawConn(pb, d.ingest_port, timeout=120)
        s.send(hello(pb, "saturating"))
        w = s.recv()
        check(w is not None and w.HasField("welcome"), f"no Welcome: {w}")

        lock = sqlite3.connect(d.db, timeout=30, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        sender = threading.Thread(
            target=lambda: [s.send(report(pb, seq, seq)) for seq in range(1, REPORTS + 1)],
            daemon=True)
        sender.start()
        m = wait_until(lambda: (lambda x: x if x["foreshock_writer_queue_items"] >= QUEUE and
                                x["foreshock_backpressure_pauses_total"] >= 1 else None)(
                                    metrics(d)),
                       timeout=120, what="the writer queue to fill and ingest to pause")
        check(m["foreshock_reports_committed_total"] == 0, "committed under the lock?")

        t = RawConn(pb, d.ingest_port, timeout=120)
        t.send(hello(pb, "newcomer"))
        try:
            got = wait_until(
                lambda: (lambda x: x if x["foreshock_frames_received_total"] ==
                         m["foreshock_frames_received_total"] + 1 else None)(metrics(d)),
                timeout=30, what="the Hello to be read")
        except Failure as e:
            raise Failure(f"a new trainer's Hello was not read while ingest was paused "
                          f"({e})") from None
        check(got["foreshock_writer_queue_items"] == m["foreshock_writer_queue_items"] + 1,
              f"the Hello was not queued beyond the bound: {got['foreshock_writer_queue_items']}"
              f" items, {m['foreshock_writer_queue_items']} before it")
        check(got["foreshock_reports_committed_total"] == 0 and
              got["foreshock_backpressure_pauses_total"] >= 1,
              "the writer was not held while the Hello was read")
        print(f"Hello read and queued while paused: {got['foreshock_writer_queue_items']:.0f} "
              f"items queued (bound {QUEUE}), nothing committed")

        lock.execute("ROLLBACK")
        lock.close()
        lock = None
        f = t.recv()
        check(f is not None and f.HasField("welcome") and f.welcome.last_seq == 0,
              f"newcomer: {f}")
        acked = 0
        while acked < REPORTS:
            f = s.recv()
            check(f is not None and f.HasField("ack"), f"saturating: {f}")
            acked = f.ack.seq
        sender.join(timeout=60)
        t.close()
        s.close()
        check(d.stop() == 0, "daemon did not exit 0")
    finally:
        if lock is not None:
            lock.close()
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
