"""What the per-step update ratio (Monitor(step_ratio=True), the default)
costs the training thread, against the training step it rides on (the
reference, measured in the same run).

One model, the same seed, batches and AdamW, trained twice per repeat:
with step_ratio=False and with step_ratio=True (the order alternates
between repeats). Per training step, CPU time of this process
(time.process_time: a CPU clock, so a busy machine slows the wall clock,
not the figure), one torch thread:
  train      forward, backward and optimizer step: the reference;
  step()     Monitor.step() on plain steps (not sketch steps), with the
             ratio off and on.
It prints the medians over --repeat runs and the ratios (step() with the
ratio - step() without) / train: what the ratio adds, as a share of a
training step. The transport records reports in memory (no daemon).

    /usr/bin/python3 tests/bench/bench_step_ratio.py [--layers 12] [--d 128] [--steps 120] [--repeat 3]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "client", "python", "experiments"))


def one_run(torch, foreshock, tinygpt, testing, a, step_ratio):
    """(median train CPU s, median plain step() CPU s) over a.steps steps."""
    torch.manual_seed(0)
    model = tinygpt.TinyGPT(a.vocab, d=a.d, n_layer=a.layers, n_head=a.heads, t=a.ctx,
                            moe=(a.experts, 2) if a.experts else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = foreshock.Monitor(model, run="bench", transport=testing.RecordingTransport(),
                            step_ratio=step_ratio, windows=(10,), every=10)
    g = torch.Generator().manual_seed(1)
    train, plain = [], []
    for s in range(1, a.steps + 1):
        x = torch.randint(0, a.vocab, (a.batch, a.ctx), generator=g)
        c0 = time.process_time()
        loss, _ = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        c1 = time.process_time()
        mon.step(s, loss=loss.detach(), lr=1e-3)
        c2 = time.process_time()
        train.append(c1 - c0)
        if s % 10 and s > 10:
            plain.append(c2 - c1)
    mon.close(10)
    return statistics.median(train), statistics.median(plain)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=4, help="0: dense MLP")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    os.environ.setdefault("FORESHOCK_LIB", os.path.join(ROOT, "build", "libforeshock.so"))
    import torch
    import foreshock
    import tinygpt
    from foreshock import testing
    torch.set_num_threads(1)
    got = {False: [], True: []}
    for r in range(a.repeat):
        for ratio in ((False, True) if r % 2 == 0 else (True, False)):
            got[ratio].append(one_run(torch, foreshock, tinygpt, testing, a, ratio))
    train = statistics.median(t for runs in got.values() for t, _ in runs)
    off = statistics.median(s for _, s in got[False])
    on = statistics.median(s for _, s in got[True])
    print(f"model: TinyGPT d {a.d}, {a.layers} layers, {a.heads} heads, "
          f"{'MoE %d experts top-2' % a.experts if a.experts else 'dense'}; batch {a.batch} x "
          f"{a.ctx}; {a.steps} steps x {a.repeat} repeats, CPU time per step (median)")
    print(f"  train (reference)          {train * 1e3:8.3f} ms")
    print(f"  step(), step_ratio=False   {off * 1e3:8.3f} ms   {off / train:6.2%} of train")
    print(f"  step(), step_ratio=True    {on * 1e3:8.3f} ms   {on / train:6.2%} of train")
    print(f"  the ratio adds             {(on - off) * 1e3:8.3f} ms   "
          f"{(on - off) / train:6.2%} of train")


if __name__ == "__main__":
    main()
