"""Spool bytes are budgeted per run (issue 22, Critical 5): a run that never
completes its steps delays only itself.

The hog sends shard 0 of 2 of every Gram sketch: no step of it ever
completes (reduce_timeout_s is an hour), and every frame stays spooled.
Once it holds spool_run_max_bytes (or, before this budget existed, the
whole spool_max_bytes) the daemon says so in its log. Then the victim, a
healthy run whose steps complete at once, streams REPORTS reports: every
one of them is acked within a generous deadline (before, every stream but
the hog's lagging one waited for the hog's step to time out: an hour).
Verdict by outcome: the victim's acks all arrive."""
import struct
import threading

from fstest import Daemon, RawConn, check, hello, proto_module, run_main, wait_until

DH = 16
TRI = (2 * DH) * (2 * DH + 1) // 2
HOG_REPORTS = 60
HEADS = 16
REPORTS = 40
DEADLINE_S = 120  # generous: the hog's step would hold the victim for an hour


def gram_report(pb, seq, step):
    f = pb.Frame()
    r = f.report
    r.seq, r.step = seq, step
    r.scalars.loss = 1.0
    blob = struct.pack("<%df" % TRI, *([1.0] * TRI))
    for head in range(HEADS):
        a = r.attention.add()
        a.layer, a.head, a.window = 0, head, 1
        a.gram.dh = DH
        a.gram.shard_index, a.gram.shard_count = 0, 2  # shard 1 never comes
        a.gram.ga, a.gram.gb = blob, blob
    return f


def spectrum_report(pb, seq, step):
    f = pb.Frame()
    r = f.report
    r.seq, r.step = seq, step
    r.scalars.loss = 1.0
    for head in range(HEADS):
        a = r.attention.add()
        a.layer, a.head, a.window = 0, head, 1
        a.spectrum.d2.extend([1.0, 0.5, 0.25, 0.125] * (DH // 2))
        a.spectrum.d3.extend([0.5, 0.25] * (DH // 2))
    return f


def hog(pb, port, conns):
    c = RawConn(pb, port, timeout=DEADLINE_S * 2)
    conns.append(c)
    c.send(hello(pb, "hog"))
    w = c.recv()
    if w is None or not w.HasField("welcome"):
        return
    try:
        for i in range(HOG_REPORTS):
            c.send(gram_report(pb, w.welcome.last_seq + 1 + i, i))
    except OSError:
        pass  # closed at the end of the test while blocked


def main(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    d = Daemon(args.build_dir, workdir,
               extra=["--set", "spool_max_bytes=1M", "--set", "spool_run_max_bytes=256K",
                      "--set", "reduce_timeout_s=3600"])
    conns = []
    try:
        t = threading.Thread(target=hog, args=(pb, d.ingest_port, conns), daemon=True)
        t.start()
        wait_until(lambda: "reached spool_run_max_bytes" in d.log_text() or
                   "reached spool_max_bytes" in d.log_text(), timeout=DEADLINE_S,
                   what="the hog holding its spool budget")
        c = RawConn(pb, d.ingest_port, timeout=DEADLINE_S)
        try:
            c.send(hello(pb, "victim"))
            w = c.recv()
            check(w is not None and w.HasField("welcome"), f"victim: no Welcome: {w}")
            last = w.welcome.last_seq + REPORTS
            for i in range(REPORTS):
                c.send(spectrum_report(pb, w.welcome.last_seq + 1 + i, i))
            acked = 0
            while acked < last:
                try:
                    f = c.recv()
                except TimeoutError:
                    f = None
                check(f is not None and not f.HasField("error"),
                      f"victim: {acked} of {last} acked within {DEADLINE_S} s, then {f}")
                if f.HasField("ack"):
                    acked = f.ack.seq
        finally:
            c.close()
        print(f"victim: {REPORTS} reports acked while the hog is held", flush=True)
        check("reached spool_max_bytes" not in d.log_text(),
              "the hog filled the whole spool: it is not held to its own budget")
        for c in conns:
            c.close()
        check(d.stop() == 0, "foreshockd did not exit 0:\n" + d.log_text()[-3000:])
    finally:
        for c in conns:
            c.close()
        d.stop()


if __name__ == "__main__":
    run_main(main)
