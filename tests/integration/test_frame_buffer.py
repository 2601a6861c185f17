"""One daemon-wide bound on the memory of large frames being read
(hardening item 2, second half: frame_buffer_max_bytes).

Eight authenticated streams each send a 3.7 MB report (max_frame_bytes 4M),
first its opening 64 KiB only. With frame_buffer_max_bytes 8M two frames fit:
the daemon gives those two their buffers and the other six wait, not read
(foreshock_frame_buffer_waits_total), while foreshock_frame_buffer_bytes
stays at most 8M. Then every stream sends the rest: the waiting ones get
room as the first ones finish, every report is acked and stored, and the
gauge ends at 0. Before the bound, eight 3.7 MB buffers were allocated at
once (24 x 63 MB took RSS to 1.5 GB).

The same again over TLS on ingest: a waiting stream's frame may sit inside
OpenSSL when it is granted room, with no socket read to come; it must be
pulled from there.
"""
import os
import socket
import ssl
import struct
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import Daemon, RawConn, check, hello, kill_started, metrics, proto_module  # noqa: E402

STREAMS = 8
BOUND = 8 << 20
MAX_FRAME = 4 << 20
SKETCHES = 300  # spectrum sketches of dh 512: 12 KB each
FIRST = 64 << 10
WAIT_S = 120


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def big_report(pb):
    f = pb.Frame()
    r = f.report
    r.seq, r.step = 1, 1
    r.scalars.loss = 2.0
    for i in range(SKETCHES):
        a = r.attention.add()
        a.layer, a.head, a.window = i // 32, i % 32, 1
        s = a.spectrum
        s.d2.extend([1.0 + (j % 7) for j in range(1024)])
        s.d3.extend([1.0 + (j % 5) for j in range(512)])
        s.d1.extend([1.0 + (j % 3) for j in range(1024)])
        s.w.extend([1.0 + (j % 2) for j in range(512)])
    body = f.SerializeToString()
    return struct.pack(">I", len(body)) + body


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    frame = big_report(pb)
    check(BOUND // 3 < len(frame) - 4 <= MAX_FRAME,
          f"frame of {len(frame)} bytes: two must fit the bound, three not")
    plain = os.path.join(workdir, "plain")
    os.makedirs(plain)
    bounded(args, plain, pb, frame, None, ())
    from test_tls import make_pki
    pki_dir = os.path.join(workdir, "pki")
    os.makedirs(pki_dir)
    pki = make_pki(pki_dir)
    ctx = ssl.create_default_context(cafile=pki["ca.pem"])
    tls = os.path.join(workdir, "tls")
    os.makedirs(tls)
    print("-- over TLS", flush=True)
    bounded(args, tls, pb, frame, ctx, ("--set", f"tls_cert={pki['server.pem']}",
                                        "--set", f"tls_key={pki['server.key']}"))


def bounded(args, workdir, pb, frame, ctx, extra):
    d = Daemon(args.build_dir, workdir,
               extra=("--set", f"max_frame_bytes={MAX_FRAME}",
                      "--set", f"frame_buffer_max_bytes={BOUND}") + extra)
    try:
        rss0 = rss_kb(d.pid)
        go = threading.Event()
        results = [None] * STREAMS
        conns = []
        for i in range(STREAMS):
            c = RawConn(pb, d.ingest_port, timeout=WAIT_S, ssl_context=ctx)
            c.send(hello(pb, f"fb-{i}"))
            w = c.recv()
            check(w is not None and w.WhichOneof("body") == "welcome", f"stream {i}: {w}")
            conns.append(c)

        def stream(i):
            c = conns[i]
            try:
                c.send_raw(frame[:FIRST])
                go.wait(WAIT_S)
                c.send_raw(frame[FIRST:])
                f = c.recv()
                results[i] = f
            except Exception as e:  # reported by the main thread
                results[i] = e

        threads = [threading.Thread(target=stream, args=(i,), daemon=True)
                   for i in range(STREAMS)]
        for t in threads:
            t.start()

        # Every stream has announced its frame: two hold room, six wait.
        deadline = time.monotonic() + WAIT_S
        while True:
            m = metrics(d)
            waits = m.get("foreshock_frame_buffer_waits_total")
            held = m.get("foreshock_frame_buffer_bytes")
            if waits is not None and waits >= STREAMS - 2 and held == 2 * (len(frame) - 4):
                break
            check(time.monotonic() < deadline,
                  f"timed out waiting for 2 frames held and {STREAMS - 2} waiting: "
                  f"frame_buffer_bytes {held}, waits {waits}")
            time.sleep(0.05)
        rss1 = rss_kb(d.pid)
        print(f"announced: {held / 2**20:.1f} MiB held (bound {BOUND / 2**20:.0f} MiB), "
              f"{waits:.0f} streams waiting; RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB")
        check(held <= BOUND, f"frame_buffer_bytes {held} above the bound {BOUND}")

        go.set()
        peak = held
        while any(t.is_alive() for t in threads):
            m = metrics(d)
            peak = max(peak, m["foreshock_frame_buffer_bytes"])
            check(time.monotonic() < deadline + WAIT_S, "streams did not finish")
            time.sleep(0.01)
        for t in threads:
            t.join()
        for i, f in enumerate(results):
            check(not isinstance(f, Exception), f"stream {i}: {f!r}")
            check(f is not None and f.WhichOneof("body") == "ack" and f.ack.seq == 1,
                  f"stream {i}: expected Ack 1, got {f}")
        m = metrics(d)
        print(f"all {STREAMS} acked; sampled peak {peak / 2**20:.1f} MiB; "
              f"waits {m['foreshock_frame_buffer_waits_total']:.0f}; "
              f"RSS peak-ish {rss_kb(d.pid) / 1024:.1f} MiB")
        check(peak <= BOUND, f"frame_buffer_bytes reached {peak}, above the bound {BOUND}")
        check(m["foreshock_frame_buffer_bytes"] == 0,
              f"frame buffers still counted after every frame: {m['foreshock_frame_buffer_bytes']}")
        for i in range(STREAMS):
            run = d.get(f"/api/v1/runs/fb-{i}")["run"]
            check(run["reports"] == 1, f"fb-{i}: {run['reports']} reports stored")
        for c in conns:
            c.close()
        check(d.stop() == 0, "daemon did not exit 0")
    finally:
        kill_started(d)


if __name__ == "__main__":
    fstest.run_main(test)
