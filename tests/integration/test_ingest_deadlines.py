"""Idle and trickling sockets cannot lock trainers out (hardening item 3):
with every connection slot held by peers that never send a Hello or stop in
the middle of a frame, each gets an Error frame and a close once its
deadline (hello_timeout_s, frame_timeout_s) passes, and a real trainer then
gets its Welcome and acks. A streaming trainer that is merely idle between
frames keeps its connection."""
import re
import struct
import urllib.request

from fstest import (Daemon, RawConn, check, hello, kill_started, proto_module, report, run_main,
                    wait_until)

SLOTS = 4


def expect_error_close(pb, conn, name):
    f = conn.recv()
    check(f is not None and f.WhichOneof("body") == "error",
          f"{name}: expected an Error frame, got {f}")
    check(f.error.code == pb.ERROR_LIMIT, f"{name}: error code {f.error.code}")
    check("timeout" in f.error.message, f"{name}: message {f.error.message!r}")
    check(conn.recv() is None, f"{name}: not closed after the Error")


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    d = Daemon(args.build_dir, workdir,
               extra=["--set", f"max_connections={SLOTS}", "--set", "hello_timeout_s=1",
                      "--set", "frame_timeout_s=2"])
    try:
        # A trainer that streams, then idles between steps: it must stay.
        idle_trainer = RawConn(pb, d.ingest_port, timeout=60)
        idle_trainer.send(hello(pb, "idle-run"))
        check(idle_trainer.recv().WhichOneof("body") == "welcome", "idle trainer: no welcome")
        idle_trainer.send(report(pb, 1, 0))
        check(idle_trainer.recv().ack.seq == 1, "idle trainer: no ack")

        # The other slots: two silent sockets and one that stops mid-frame
        # after its Hello.
        silent = [RawConn(pb, d.ingest_port, timeout=60) for _ in range(SLOTS - 2)]
        trickle = RawConn(pb, d.ingest_port, timeout=60)
        trickle.send(hello(pb, "trickle-run"))
        check(trickle.recv().WhichOneof("body") == "welcome", "trickle: no welcome")
        trickle.send_raw(struct.pack(">I", 1000) + b"\x1a" * 10)
        for i, c in enumerate(silent):
            expect_error_close(pb, c, f"silent socket {i}")
            c.close()
        expect_error_close(pb, trickle, "mid-frame socket")
        trickle.close()

        # Their slots free once the daemon has seen them go (a peer that keeps
        # its end open after the Error is dropped at the linger deadline).
        def connections():
            with urllib.request.urlopen(d.url("/metrics"), timeout=30) as r:
                m = re.search(rb"^foreshock_connections (\d+)", r.read(), re.M)
            return int(m.group(1)) if m else -1
        wait_until(lambda: connections() == 1, timeout=60, what="slots freed")

        # A real trainer gets in now.
        t = RawConn(pb, d.ingest_port, timeout=60)
        t.send(hello(pb, "late-trainer"))
        w = t.recv()
        check(w is not None and w.WhichOneof("body") == "welcome", f"trainer locked out: {w}")
        t.send(report(pb, 1, 0))
        check(t.recv().ack.seq == 1, "trainer: no ack")

        # The idle trainer is still served.
        idle_trainer.send(report(pb, 2, 1))
        f = idle_trainer.recv()
        check(f is not None and f.WhichOneof("body") == "ack" and f.ack.seq == 2,
              f"idle trainer lost its connection: {f}")
        check(d.stop() == 0, "daemon did not exit 0 on SIGTERM")
    finally:
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
