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
tests/unit/test_store.c (hello_is_accepted_when_full_and_written_first).

Second part, frames decoded off the loop: reports that need a buffer of
their own (Gram sketches, about 1 MB) are decoded in the thread pool and
spooled in pieces with queued Hellos committed between them. New trainers
connect between the reports; every one is welcomed, the rank's reports are
acked in order and evaluated once each, and a large report that does not
validate is refused by an Error naming its seq (the refusal comes back from
the pool). The writer's pieces themselves are checked in tests/unit/
test_spool.c (a_large_record_yields_between_its_pieces)."""
import os
import sqlite3
import threading

import numpy as np

from fstest import (Daemon, Failure, RawConn, check, db_rows, hello, kill_started, metrics,
                    proto_module, report, run_main, wait_until)

QUEUE = 64
BATCH = 4
REPORTS = 400
LARGE_REPORTS = 8
LAYERS, HEADS, DH = 2, 8, 64  # 16 Gram sketches of 2 x 33 KB: a 1 MB frame


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    hello_read_while_paused(args, workdir, pb)
    large_frames_beside_hellos(args, workdir, pb)


def hello_read_while_paused(args, workdir, pb):
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


def gram_report(pb, seq, grams, dh=DH):
    """A report with LAYERS x HEADS whole-head Gram sketches (one shard)."""
    f = report(pb, seq, seq)
    for layer in range(LAYERS):
        for head in range(HEADS):
            a = f.report.attention.add()
            a.layer, a.head, a.window = layer, head, 1
            a.gram.dh = dh
            a.gram.shard_index, a.gram.shard_count = 0, 1
            a.gram.ga, a.gram.gb = grams[(layer * HEADS + head) % len(grams)]
    return f


def large_frames_beside_hellos(args, workdir, pb):
    rng = np.random.default_rng(5)
    n = 2 * DH
    iu = np.triu_indices(n)
    grams = []
    for _ in range(4):
        xa = rng.standard_normal((n, 3 * n))
        xb = xa + 0.05 * rng.standard_normal((n, 3 * n))
        grams.append(((xa @ xa.T)[iu].astype("<f4").tobytes(),
                      (xb @ xb.T)[iu].astype("<f4").tobytes()))
    os.makedirs(os.path.join(workdir, "large"), exist_ok=True)
    d = Daemon(args.build_dir, os.path.join(workdir, "large"))
    try:
        s = RawConn(pb, d.ingest_port, timeout=120)
        h = hello(pb, "large")
        h.hello.model.n_layers, h.hello.model.n_heads = LAYERS, HEADS
        s.send(h)
        w = s.recv()
        check(w is not None and w.HasField("welcome"), f"no Welcome: {w}")
        size = len(gram_report(pb, 1, grams).SerializeToString())
        check(size > 64 << 10, f"a {size}-byte report has no buffer of its own")
        for seq in range(1, LARGE_REPORTS + 1):
            s.send(gram_report(pb, seq, grams))
            t = RawConn(pb, d.ingest_port, timeout=120)
            t.send(hello(pb, f"newcomer-{seq}"))
            f = t.recv()
            check(f is not None and f.HasField("welcome"), f"newcomer {seq}: {f}")
            t.close()
        # A Gram of the wrong length for its dh: refused after its decode.
        bad = gram_report(pb, LARGE_REPORTS + 1, grams, dh=DH + 1)
        s.send(bad)
        acked, error = 0, None
        while error is None:
            f = s.recv()
            check(f is not None, f"the connection closed at ack {acked} without an Error")
            if f.HasField("ack"):
                check(f.ack.seq >= acked, f"ack {f.ack.seq} after {acked}")
                acked = f.ack.seq
            else:
                check(f.HasField("error"), f"unexpected frame {f}")
                error = f.error
        # Acks follow commits, and the Error follows the bad frame's decode
        # at once: an earlier report still committing is not acked on this
        # connection (the client resends it and the daemon takes it once).
        # What matters: acks in order, the Error naming the bad seq, and
        # every earlier report committed (checked below).
        check(acked <= LARGE_REPORTS, f"acked {acked} of {LARGE_REPORTS} before the Error")
        check(error.seq == LARGE_REPORTS + 1, f"the Error names seq {error.seq}: {error}")
        m = wait_until(lambda: (lambda x: x if x["foreshock_monitor_buckets_total"] >=
                                LARGE_REPORTS else None)(metrics(d)),
                       timeout=300, what="every sketch step to be evaluated")
        check(m["foreshock_monitor_buckets_total"] == LARGE_REPORTS,
              f"{m['foreshock_monitor_buckets_total']:.0f} steps evaluated, not "
              f"{LARGE_REPORTS}: a frame fed twice?")
        check(m["foreshock_decode_errors_total"] == 1 and
              m["foreshock_frames_received_total"] == 2 * LARGE_REPORTS + 2,
              f"decode errors {m['foreshock_decode_errors_total']:.0f}, frames "
              f"{m['foreshock_frames_received_total']:.0f}")
        s.close()
        check(d.stop() == 0, "daemon did not exit 0")
        seqs = [r[0] for r in db_rows(d.db, "SELECT seq FROM reports r JOIN streams s ON "
                                      "s.id = r.stream_id JOIN runs u ON u.id = s.run_id "
                                      "WHERE u.name = 'large' ORDER BY seq")]
        check(seqs == list(range(1, LARGE_REPORTS + 1)),
              f"committed seqs {seqs}, not 1..{LARGE_REPORTS}")
        print(f"{LARGE_REPORTS} reports of {size / 1e6:.1f} MB committed and evaluated "
              f"({acked} acked before the Error, in order), {LARGE_REPORTS} newcomers welcomed "
              "between them, the invalid one refused by seq")
    finally:
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
