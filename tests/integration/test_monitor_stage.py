"""The monitor stage against the real daemon, frame by frame: a Gram split
in two shards is summed and evaluated (per-head and per-layer series), a
reduction missing a shard or a rank becomes an incomplete record after
reduce_timeout_s (never computed from part of the data), a NaN loss fires a
critical non-finite alert at once, [detect "RULE"] sections configure the
detectors, and a bad section stops the daemon with exit 2 naming the line."""
import os
import struct
import subprocess
import time

import numpy as np

from fstest import Daemon, RawConn, check, hello, proto_module, run_main

DH = 4
N = 2 * DH
D = 16


def tri(g):
    """Upper triangle, row-major, float32 little-endian bytes."""
    vals = [g[i, j] for i in range(g.shape[0]) for j in range(i, g.shape[0])]
    return struct.pack(f"<{len(vals)}f", *vals)


def gram_shards(rng, shards):
    a = rng.standard_normal((N, D))
    b = rng.standard_normal((N, D))
    cuts = np.linspace(0, D, shards + 1).astype(int)
    return [(tri(a[:, c0:c1] @ a[:, c0:c1].T), tri(b[:, c0:c1] @ b[:, c0:c1].T))
            for c0, c1 in zip(cuts[:-1], cuts[1:])]


def connect(pb, d, run, rank, world):
    c = RawConn(pb, d.ingest_port)
    c.send(hello(pb, run, rank=rank, world=world))
    w = c.recv()
    check(w.WhichOneof("body") == "welcome", f"expected Welcome, got {w}")
    return c


def send_report(pb, c, seq, step, grams=(), tokens=(), loss=None):
    f = pb.Frame()
    r = f.report
    r.seq = seq
    r.step = step
    if loss is not None:
        r.scalars.loss = loss
    for layer, head, shard, shards, ga, gb in grams:
        a = r.attention.add()
        a.layer, a.head, a.window = layer, head, 1
        a.gram.dh = DH
        a.gram.shard_index, a.gram.shard_count = shard, shards
        a.gram.ga, a.gram.gb = ga, gb
    for layer in tokens:
        t = r.router_tokens.add()
        t.layer, t.n_experts, t.n_tok = layer, 4, 100
        t.sum_h, t.sum_h2, t.sum_lse2 = 120.0, 150.0, 30.0
        t.load.extend([50, 50, 50, 50])
        t.sum_p.extend([25.0, 25.0, 25.0, 25.0])
    c.send(f)
    ack = c.recv()
    check(ack.WhichOneof("body") == "ack" and ack.ack.seq == seq, f"expected Ack {seq}: {ack}")


def wait_for(fn, what, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def series(d, run, name):
    return d.get(f"/api/v1/series?run={run}&name={name}")["series"]


def test_reduction(pb, d):
    rng = np.random.default_rng(5)
    shards = gram_shards(rng, 2)
    r0 = connect(pb, d, "red", 0, 2)
    r1 = connect(pb, d, "red", 1, 2)
    # step 1: both shards of (0, 0), both ranks' tokens of layer 0 -> computed
    send_report(pb, r0, 1, 1, grams=[(0, 0, 0, 2, *shards[0])], tokens=[0])
    send_report(pb, r1, 1, 1, grams=[(0, 0, 1, 2, *shards[1])], tokens=[0])
    # step 2: only shard 0, only rank 0's tokens -> incomplete after the timeout
    send_report(pb, r0, 2, 2, grams=[(0, 0, 0, 2, *shards[0])], tokens=[0])
    inc = wait_for(lambda: d.get("/api/v1/runs/red/incomplete")["incomplete"], "incomplete rows")
    got = sorted((i["step"], i["kind"], i["layer"], i["head"], i["window"], i["have"], i["want"])
                 for i in inc)
    check(got == [(2, "attention", 0, 0, 1, 1, 2), (2, "router_tokens", 0, None, None, 1, 2)],
          f"incomplete rows {got}")
    check(d.get("/api/v1/runs/red")["run"]["incomplete"] == 2, "run incomplete count")
    for name in ("qk.d2.erank", "qk.d2.erank.min", "qk.d2.erank.argmin", "router.maxvio"):
        ser = series(d, "red", name)
        check(len(ser) == 1, f"{name}: series {ser}")
        pts = d.get(f"/api/v1/series/{ser[0]['id']}/points")["points"]
        check([p[0] for p in pts] == [1], f"{name}: points {pts} (step 2 must not be computed)")
        check(pts[0][1] is not None, f"{name}: step 1 absent")
    erank = d.get(f"/api/v1/series/{series(d, 'red', 'qk.d2.erank')[0]['id']}/points")["points"]
    check(1.0 <= erank[0][1] <= N, f"erank {erank}")
    argmin = d.get(f"/api/v1/series/{series(d, 'red', 'qk.d2.erank.argmin')[0]['id']}/points")
    check(argmin["points"][0][1] == 0, f"argmin head {argmin}")
    r0.close()
    r1.close()


def test_nonfinite(pb, d):
    c = connect(pb, d, "nan", 0, 1)
    for step in range(1, 6):
        send_report(pb, c, step, step, loss=1.0 / step)
    send_report(pb, c, 6, 6, loss=float("nan"))
    alerts = wait_for(lambda: d.get("/api/v1/alerts?run=nan&rule=loss")["alerts"], "loss alert")
    a = alerts[0]
    check(a["state"] == "firing" and a["severity"] == "critical", f"alert {a}")
    check(a["attribution"] == "non-finite", f"attribution {a['attribution']}")
    check(a["evidence"]["fired_step"] == 6 and a["labels"] == {"rank": 0}, f"evidence {a}")
    hist = d.get(f"/api/v1/alerts/{a['id']}")["alert"]["history"]
    check([h["change"] for h in hist] == ["to_firing"], f"history {hist}")
    check(hist[0]["evidence"]["breach_kind"] == "nonfinite", f"evidence {hist[0]['evidence']}")
    c.close()


def test_pressure(args, workdir):
    """reduce_max_bytes below one step's Grams: ingest keeps reading only the
    streams that can complete the oldest step, so nothing times out."""
    sub = os.path.join(workdir, "pressure")
    os.makedirs(sub)
    d = Daemon(args.build_dir, sub, extra=["--set", "reduce_max_bytes=1M",
                                           "--set", "reduce_timeout_s=60"])
    try:
        p = subprocess.run([os.path.join(args.build_dir, "foreshock"), "simulate",
                            "--endpoint", d.endpoint, "--run", "press", "--ranks", "2",
                            "--steps", "40", "--dh", "64", "--d", "256", "--sketch-every", "2",
                            "--rate", "40"], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, f"simulate: {p.stdout[-2000:]}")
        wait_for(lambda: [s for s in series(d, "press", "qk.d2.erank.min")
                          if s["last_step"] == 38], "step 38 evaluated")
        run = d.get("/api/v1/runs/press")["run"]
        check(run["incomplete"] == 0, f"incomplete reductions under pressure: {run}")
        check("reached reduce_max_bytes" in d.log_text(), "the bound was never reached")
    finally:
        rc = d.stop()
    check(rc == 0, f"daemon exited {rc}: {d.log_text()[-3000:]}")


def test(args, workdir):
    test_pressure(args, workdir)
    pb = proto_module(args.source_dir, workdir)
    conf = os.path.join(workdir, "detect.conf")
    with open(conf, "w") as f:
        f.write("reduce_timeout_s = 0.5\n[detect \"grad_norm\"]\nenabled = false\n"
                "[detect \"qk.d2.erank\"]\npersistence = 2\nz = 4.5\n")
    d = Daemon(args.build_dir, workdir, config=conf)
    try:
        test_reduction(pb, d)
        test_nonfinite(pb, d)
    finally:
        rc = d.stop()
    check(rc == 0, f"daemon exited {rc}: {d.log_text()[-3000:]}")
    bad_cases = [
        ("[detect \"no.such.rule\"]\nz = 3\n", ":1:", "no.such.rule"),
        ("\n[detect \"loss\"]\nbogus = 3\n", ":3:", "bogus"),
        ("[detect \"loss\"]\nz = -1\n", ":2:", "z"),
        ("[detect]\nz = 1\n", ":1:", "detect"),
    ]
    for text, line, word in bad_cases:
        with open(conf, "w") as f:
            f.write(text)
        p = subprocess.run([os.path.join(args.build_dir, "foreshockd"), "--config", conf,
                            "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                            "--db", os.path.join(workdir, "never.db")],
                           capture_output=True, text=True, timeout=30)
        check(p.returncode == 2, f"{text!r}: exit {p.returncode}: {p.stderr}")
        check(line in p.stderr and word in p.stderr, f"{text!r}: message {p.stderr!r}")


if __name__ == "__main__":
    run_main(test)
