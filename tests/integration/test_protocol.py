"""Protocol violations get an Error frame and a close; the daemon keeps
serving other clients, and nothing acknowledged is lost."""
import struct

from fstest import Daemon, RawConn, check, hello, kill_started, proto_module, report, run_main


def gram_report(pb, seq, ga_floats):
    f = pb.Frame()
    r = f.report
    r.seq, r.step = seq, seq
    a = r.attention.add()
    a.layer, a.head, a.window = 0, 0, 1
    a.gram.dh = 2  # n = 4: 10 floats per triangle
    a.gram.ga = struct.pack("<%df" % ga_floats, *([1.0] * ga_floats))
    a.gram.gb = struct.pack("<10f", *([1.0] * 10))
    return f


def cases(pb):
    """(name, frames or raw bytes to send after connecting, expected codes).
    A list item that is bytes is sent raw; a Frame is length-prefixed."""
    E = pb
    ack = pb.Frame()
    ack.ack.seq = 1
    return [
        ("garbage body", [b"\x00\x00\x00\x0a" + b"\xff" * 10], {E.ERROR_MALFORMED}),
        ("zero length", [b"\x00\x00\x00\x00"], {E.ERROR_TOO_LARGE}),
        ("oversized length", [b"\xff\xff\xff\xff"], {E.ERROR_TOO_LARGE}),
        ("wrong protocol version", [hello(pb, "bad-run", version=2)], {E.ERROR_PROTOCOL_VERSION}),
        ("report before hello", [report(pb, 1, 0)], {E.ERROR_SEQUENCE}),
        ("second hello", [hello(pb, "bad-run"), hello(pb, "bad-run")], {E.ERROR_SEQUENCE}),
        ("gram size does not match dh", [hello(pb, "bad-run", rank=1, world=4),
                                         gram_report(pb, 1, 9)], {E.ERROR_MALFORMED}),
        ("rank >= world size", [hello(pb, "bad-run", rank=4, world=4)], {E.ERROR_MALFORMED}),
        ("bad run id", [hello(pb, "no spaces/allowed")], {E.ERROR_MALFORMED}),
        ("daemon frame from a client", [ack], {E.ERROR_SEQUENCE, E.ERROR_MALFORMED}),
        # Seqs increase by one: a gap or a step back above the committed
        # resume point is refused, never acknowledged.
        ("seq gap", [hello(pb, "gap-run"), report(pb, 1, 0), report(pb, 2, 1),
                     report(pb, 5, 4)], {E.ERROR_SEQUENCE}),
        ("seq step back", [hello(pb, "back-run"), report(pb, 1, 0), report(pb, 2, 1),
                           report(pb, 2, 1)], {E.ERROR_SEQUENCE}),
        ("first seq not 1", [hello(pb, "late-run"), report(pb, 3, 0)], {E.ERROR_SEQUENCE}),
        # An unauthenticated peer announcing a 60 MB frame: refused at the
        # length prefix, no 60 MB buffer (hardening item 2).
        ("large frame before hello", [struct.pack(">I", 60 << 20) + b"\x0a" * 100],
         {E.ERROR_TOO_LARGE}),
    ]


def expect_error_then_close(conn, codes, name):
    welcome_seen = False
    acked_beyond = []  # acks seen; no case here stores more than seq 2
    while True:
        f = conn.recv()
        check(f is not None, f"{name}: connection closed without an Error frame")
        kind = f.WhichOneof("body")
        if kind == "welcome" and not welcome_seen:
            welcome_seen = True
            continue
        if kind == "ack":
            acked_beyond.append(f.ack.seq)
            continue
        check(kind == "error", f"{name}: expected Error, got {kind}")
        check(f.error.code in codes, f"{name}: error code {f.error.code}, expected {codes}")
        check(not acked_beyond or max(acked_beyond) <= 2,
              f"{name}: acknowledged seq {max(acked_beyond or [0])} never stored")
        check(f.error.message != "", f"{name}: empty error message")
        break
    check(conn.recv() is None, f"{name}: connection not closed after Error")


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    d = Daemon(args.build_dir, workdir)
    try:
        # A well-behaved client streams throughout.
        good = RawConn(pb, d.ingest_port)
        good.send(hello(pb, "good-run", rank=0, world=1))
        w = good.recv()
        check(w.WhichOneof("body") == "welcome" and w.welcome.last_seq == 0, f"welcome: {w}")
        seq = 0

        def good_round():
            nonlocal seq
            for _ in range(10):
                seq += 1
                good.send(report(pb, seq, seq - 1))
            while True:
                f = good.recv()
                check(f is not None and f.WhichOneof("body") == "ack", f"good conn got {f}")
                if f.ack.seq == seq:
                    return

        good_round()
        for name, sends, codes in cases(pb):
            c = RawConn(pb, d.ingest_port)
            for s in sends:
                if isinstance(s, bytes):
                    c.send_raw(s)
                else:
                    c.send(s)
            expect_error_then_close(c, codes, name)
            c.close()
            good_round()
            print(f"ok: {name}")

        # A client that vanishes mid-frame: a length prefix, part of the
        # body, then a close. No reply is possible; the daemon must go on.
        c = RawConn(pb, d.ingest_port)
        c.send(hello(pb, "vanish-run"))
        check(c.recv().WhichOneof("body") == "welcome", "vanish: no welcome")
        c.send_raw(struct.pack(">I", 1000) + b"\x1a" * 10)
        c.close()
        good_round()
        print("ok: client vanished mid-frame")

        # Resend already-committed reports: acked again, stored once.
        good.close()
        again = RawConn(pb, d.ingest_port)
        again.send(hello(pb, "good-run", rank=0, world=1))
        w = again.recv()
        check(w.welcome.last_seq == seq, f"resume point {w.welcome.last_seq}, expected {seq}")
        for s in range(1, seq + 1):
            again.send(report(pb, s, s - 1))
        f = again.recv()
        while f.ack.seq != seq:
            f = again.recv()
        again.close()
        # A %00 in a path or parameter names nothing: not the run before it
        # (hardening item 9).
        d.get("/api/v1/runs/good-run%00x", expect=404)
        d.get("/api/v1/series?run=good-run%00x", expect=404)
        run = d.get("/api/v1/runs/good-run")["run"]
        check(run["reports"] == seq, f"good-run has {run['reports']} reports, expected {seq}")
        check(d.stop() == 0, "daemon did not exit 0 on SIGTERM")
    finally:
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
