"""`foreshock simulate --split-heads` (the Gram route split over ranks by
heads, as tensor parallelism does) stores the monitors of the same job on
one rank.

Two runs of one daemon, the same seed and shape (2 layers x 8 query heads,
2 key heads, dh 16, d 128, window 5, a sketch every 5 steps): `one` on a
single rank that holds every head, `four` on 4 ranks holding 2 heads each
(whole heads: all of d, shard 0 of 1; each key head on the two ranks whose
query heads read it). Every stored qk.* series (per head, and the per-layer
min/mean/max/argmin) must be equal within 1e-6 relative, and each run
evaluated every sketch step with none incomplete and no sketch ignored (the
daemon counts a duplicate shard in foreshock_sketches_duplicate_total and
a sketch for a step already evaluated in foreshock_sketches_late_total). A head sent under another
head's id, held by two ranks or by none changes a per-head series, sends
it twice or leaves it out (incomplete), and fails here.

A third run, `fsdp`, is the default Gram route on 4 ranks (a slice of d of
every head): complete too, but other random weights, so its series differ;
the check that they do keeps the comparison from passing on series that do
not depend on the weights at all."""
import os
import subprocess
import sys
import time

import fstest
from fstest import check, run_main

LAYERS, HEADS, KV_HEADS, DH, D = 2, 8, 2, 16, 128
STEPS, EVERY = 40, 5
REL = 1e-6
LAST_SKETCH = (STEPS - 1) // EVERY * EVERY
SKETCH_STEPS = list(range(EVERY, LAST_SKETCH + 1, EVERY))  # window EVERY: from step EVERY on


def simulate(args, endpoint, run, ranks, extra):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", endpoint,
           "--run", run, "--ranks", str(ranks), "--steps", str(STEPS), "--layers", str(LAYERS),
           "--heads", str(HEADS), "--kv-heads", str(KV_HEADS), "--dh", str(DH), "--d", str(D),
           "--sketch-every", str(EVERY), "--seed", "11", "--flush-timeout", "120"] + list(extra)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    print(p.stdout[-800:], flush=True)
    check(p.returncode == 0, f"{run}: simulate exited {p.returncode}")


def qk_series(api, run):
    """{(name, layer, head, window): {step: value}} of the run's qk.* series."""
    return {k[:4]: v for k, v in api.values(run).items() if k[0].startswith("qk.")}


def wait_evaluated(api, runs):
    """Until every run's qk series all hold the last sketch step (the step's
    series commit together), then reads them."""
    deadline = time.monotonic() + 180
    while True:
        got = {r: qk_series(api, r) for r in runs}
        if all(got[r] and all(LAST_SKETCH in pts for pts in got[r].values()) for r in runs):
            return got
        check(time.monotonic() < deadline, "the daemon did not evaluate every sketch step in "
              "180 s")
        time.sleep(0.3)


def close(a, b):
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= REL * max(abs(b), 1e-300)


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    from fsapi import Api
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        simulate(args, daemon.endpoint, "one", 1, ["--split-heads"])
        simulate(args, daemon.endpoint, "four", 4, ["--split-heads"])
        simulate(args, daemon.endpoint, "fsdp", 4, [])
        api = Api(daemon.http)
        got = wait_evaluated(api, ["one", "four", "fsdp"])
        m = fstest.metrics(daemon)
        check(m.get("foreshock_sketches_late_total") == 0,
              f"sketches for evaluated steps: {m.get('foreshock_sketches_late_total')}")
        check(m.get("foreshock_sketches_duplicate_total") == 0,
              f"sketches for a head another rank sent too: "
              f"{m.get('foreshock_sketches_duplicate_total')}")
        ignored = [ln for ln in daemon.log_text().splitlines() if "sketches ignored" in ln]
        check(not ignored, f"the daemon ignored sketches: {ignored[:3]}")
        for run in ("one", "four", "fsdp"):
            doc = api.get(f"/api/v1/runs/{run}")
            doc = doc.get("run", doc)
            check(doc.get("incomplete") == 0, f"{run}: {doc.get('incomplete')} incomplete")
        one, four = got["one"], got["four"]
        heads = {(k[1], k[2]) for k in one if k[2] is not None}
        check(heads == {(l, h) for l in range(LAYERS) for h in range(HEADS)},
              f"one: per-head series of {sorted(heads)}, expected every head of every layer")
        check(sorted(one) == sorted(four), f"one and four stored different series: "
              f"{sorted(set(one) ^ set(four))[:10]}")
        worst, n = 0.0, 0
        for key, pa in one.items():
            pb = four[key]
            check(sorted(pa) == SKETCH_STEPS and sorted(pb) == SKETCH_STEPS,
                  f"{key}: steps {sorted(pa)} (one) and {sorted(pb)} (four), expected "
                  f"{SKETCH_STEPS}")
            for step in pa:
                x, y = pa[step], pb[step]
                check(close(y, x), f"{key} step {step}: one {x} vs four {y}")
                if x is not None:
                    worst = max(worst, abs(x - y) / max(abs(x), 1e-300))
                    n += 1
        check(n > 0, "no value compared")
        print(f"  one rank == 4 ranks split by heads: {len(one)} qk series, {n} values, max rel "
              f"diff {worst:.1e}", flush=True)
        fsdp = got["fsdp"]
        check(sorted(fsdp) == sorted(one), "fsdp stored other series than one")
        differ = sum(1 for key, pa in one.items() for s, x in pa.items()
                     if x is not None and not close(fsdp[key].get(s), x))
        check(differ > n // 2, f"the fsdp run (other weights) matches one in {n - differ} of {n} "
              "values: the comparison does not see the weights")
    finally:
        daemon.stop()


if __name__ == "__main__":
    run_main(main)
