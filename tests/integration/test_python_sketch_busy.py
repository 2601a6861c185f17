"""A sender that falls behind never stalls the training thread: with
sketches_in_flight=N, a sketch step while the sender still holds N sketch
jobs skips its Grams (counted in stats() sketches_skipped_busy), sends its
scalars, and leaves the window snapshots intact.

The sender is held deterministically, not by timing: the transport's
submit() waits on a gate the test opens (a gate that stays shut for
GATE_TIMEOUT_S counts as a stall of the training thread: verdict by a flag).
On test_python_routes.py's GQA model (every=2, window 2), route="gram":
  - gate shut, sketches_in_flight=1, steps 0..10: step 2's Grams are
    staged, the sketch steps 4..10 are skipped (4 counted), every step()
    returns while the gate is shut;
  - gate open: every step's loss arrives, Grams only for step 2, equal to
    foreshock.sketch.attention_grams of W(2) against W(0);
  - steps 11..14 drained one by one: steps 12 and 14 carry Grams against
    the snapshots of steps 10 and 12 (step 10's was taken while its
    sketch was skipped), bit for bit, and no further skip is counted;
  - the default on a CPU model has no bound: all sketch steps arrive;
  - sketches_in_flight rejects 0, -1, True and 1.5 with a clear error;
  - nothing raised, no failure counted, no buffer pinned on the CPU.
"""
import os
import sys
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402
import test_python_routes as routes  # noqa: E402  (the GQA model)

EVERY, WINDOW = 2, 2
GATE_TIMEOUT_S = 120   # a submit still waiting then means step() waited on the sender
BUSY_STEPS = 10        # steps 0..BUSY_STEPS run with the gate shut


def gated_transport():
    from foreshock.testing import RecordingTransport

    class Gated(RecordingTransport):
        def __init__(self):
            super().__init__()
            self.gate = threading.Event()
            self.stalled = False

        def submit(self, rep):
            if not self.gate.wait(GATE_TIMEOUT_S):
                self.stalled = True
            return super().submit(rep)

    return Gated()


def weights(torch, step):
    """[(wq, wk) per layer] of one step, float32, seeded by the step."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(routes.H * routes.DH, routes.D, generator=g),
             torch.randn(routes.HKV * routes.DH, routes.D, generator=g))
            for _ in range(routes.LAYERS)]


def load(torch, model, ws):
    with torch.no_grad():
        for blk, (q, k) in zip(model.layers, ws):
            blk.self_attn.q_proj.weight.copy_(q)
            blk.self_attn.k_proj.weight.copy_(k)


def check_grams(torch, foreshock, rep, ws, step):
    """rep's Grams equal attention_grams of W(step) against W(step - WINDOW)."""
    got = {(a.layer, a.head): a for a in rep.attention}
    check(len(got) == routes.LAYERS * routes.H and
          all(a.window == WINDOW for a in rep.attention),
          f"step {step}: {len(rep.attention)} Grams sent, expected {routes.LAYERS * routes.H}")
    group = routes.H // routes.HKV
    for layer in range(routes.LAYERS):
        (wq, wk), (wq0, wk0) = ws[step][layer], ws[step - WINDOW][layer]
        ga, gb = foreshock.sketch.attention_grams(wq, wk, wq0, wk0, routes.H, routes.HKV,
                                                  routes.DH)
        for h in range(routes.H):
            a = got[(layer, h)]
            check(np.array_equal(a.ga, ga[h].numpy()) and
                  np.array_equal(a.gb, gb[h // group].numpy()),
                  f"step {step} layer {layer} head {h}: Grams differ from W({step}) vs "
                  f"W({step - WINDOW}): a skipped sketch step spoiled a snapshot")


def run_busy(torch, foreshock, bound):
    """Steps 0..BUSY_STEPS with the sender held, then released; then steps
    up to 14 drained one by one. (reports by step, stats, transport, weights)."""
    model = routes.build_model(torch, torch.nn)
    tp = gated_transport()
    kw = {} if bound is None else {"sketches_in_flight": bound}
    mon = foreshock.Monitor(model, run="busy", windows=(WINDOW,), every=EVERY, routers=[],
                            transport=tp, route="gram", layer_norms=False, **kw)
    ws = {}
    for t in range(BUSY_STEPS + 1):
        ws[t] = weights(torch, t)
        load(torch, model, ws[t])
        mon.step(t, loss=float(t), step_time=0.5)
    shut = not tp.gate.is_set() and not tp.stalled
    busy = mon.stats()
    tp.gate.set()
    mon.flush(60)   # every report of 0..BUSY_STEPS handed over (checked below)
    for t in range(BUSY_STEPS + 1, 15):
        ws[t] = weights(torch, t)
        load(torch, model, ws[t])
        mon.step(t, loss=float(t), step_time=0.5)
        mon.flush(60)
    st = mon.close(10)
    check(shut, "step() waited on the held sender (the gate timed out, or steps ran late)")
    by_step = {}
    for rep in tp.reports:
        check(rep.step not in by_step, f"step {rep.step} sent twice")
        by_step[rep.step] = rep
    check(sorted(by_step) == list(range(15)),
          f"reports of steps {sorted(by_step)}, expected 0..14")
    for t, rep in by_step.items():
        check(rep.scalars.get("loss") == float(t), f"step {t}: loss {rep.scalars}")
    check(sum(st["failures"].values()) == 0 and not st["disabled_modules"],
          f"failures {st['failures']}, disabled {st['disabled_modules']}")
    check(st["pinned_allocs"] == 0, f"{st['pinned_allocs']} buffers pinned for a CPU model")
    return by_step, busy, st, ws


def check_bounded(torch, foreshock):
    by_step, busy, st, ws = run_busy(torch, foreshock, 1)
    skipped = list(range(2 * EVERY, BUSY_STEPS + 1, EVERY))   # 4, 6, 8, 10
    check(busy["sketches_skipped_busy"] == len(skipped),
          f"{busy['sketches_skipped_busy']} sketch steps skipped while the sender was held, "
          f"expected {len(skipped)} ({skipped})")
    check(st["sketches_skipped_busy"] == len(skipped),
          f"{st['sketches_skipped_busy']} skipped in all, expected only the {len(skipped)} "
          "of the held sender")
    with_grams = sorted(t for t, r in by_step.items() if r.attention)
    check(with_grams == [2, 12, 14], f"Grams sent for steps {with_grams}, expected [2, 12, 14]")
    for t in with_grams:
        check_grams(torch, foreshock, by_step[t], ws, t)


def check_default_cpu(torch, foreshock):
    by_step, busy, st, _ = run_busy(torch, foreshock, None)
    with_grams = sorted(t for t, r in by_step.items() if r.attention)
    expected = list(range(WINDOW, 15, EVERY))
    check(st["sketches_skipped_busy"] == 0 and with_grams == expected,
          f"default on the CPU: {st['sketches_skipped_busy']} skipped, Grams for "
          f"{with_grams}, expected none skipped and {expected}")


def check_bad_values(torch, foreshock):
    for bad in (0, -1, True, 1.5):
        try:
            foreshock.Monitor(routes.build_model(torch, torch.nn), run="bad", routers=[],
                              transport=gated_transport(), sketches_in_flight=bad)
        except ValueError as e:
            check("sketches_in_flight" in str(e), f"sketches_in_flight={bad!r}: {e}")
        else:
            check(False, f"sketches_in_flight={bad!r} accepted")


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    import torch
    import foreshock
    import foreshock.sketch  # noqa: F401
    torch.set_num_threads(1)
    check_bounded(torch, foreshock)
    check_default_cpu(torch, foreshock)
    check_bad_values(torch, foreshock)


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
