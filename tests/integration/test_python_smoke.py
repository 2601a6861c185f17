"""CI smoke run of the fault-injection experiment: a tiny GPT trained for a
few hundred steps with the attention-numerics fault (BF16 truncation of O
and dO before D = rowsum(O * dO)), streamed by foreshock.Monitor to the
real daemon. An alert labelled attention-numerics must fire, before the
loss diverges (run_experiment.divergence_step) and before the loss-based
detector (the daemon's loss/grad_norm rules) fires. Training stops once
the alert is visible over HTTP (train.py --stop-after-alert).

Seed 2, fault at step 200: the alert fires at step 450 (qk.d2.srank,
layer 2), the same step in every run (one torch thread: deterministic
training; the daemon's math is deterministic too). It takes 250 steps
because the 5-bit fault's Delta2 collapse builds up over hundreds of steps
while a 5-step window is dominated by minibatch noise (client/python/
README.md, "Windows"); MAX_STEPS leaves 150 steps of margin, and neither
the loss detector nor divergence comes before step 850 in this run.

The full experiment (three seeds, four scenarios, plots) is the documented
command in client/python/README.md, not part of CI.
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

MAX_STEPS = 600
FAULT_STEP = 200
EVERY = 5  # train.py's default sketch cadence


def main(args, workdir):
    exp = os.path.join(args.source_dir, "client", "python", "experiments")
    sys.path.insert(0, exp)
    from fsapi import Api
    from run_experiment import divergence_step, read_jsonl, wait_evaluated
    # The experiment's detector settings (foreshockd-experiment.conf says why).
    daemon = fstest.Daemon(args.build_dir, workdir,
                           config=os.path.join(exp, "foreshockd-experiment.conf"))
    try:
        out = os.path.join(workdir, "smoke.jsonl")
        env = dict(os.environ, FORESHOCK_LIB=os.path.join(os.path.abspath(args.build_dir),
                                                          "libforeshock.so"))
        cmd = [sys.executable, os.path.join(exp, "train.py"), "--endpoint", daemon.endpoint,
               "--run", "smoke", "--scenario", "attention-numerics", "--seed", "2",
               "--steps", str(MAX_STEPS), "--fault-step", str(FAULT_STEP), "--out", out,
               "--stop-after-alert", daemon.http]
        t0 = time.monotonic()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, timeout=1200)
        check(p.returncode == 0, f"train.py exited {p.returncode}:\n{p.stdout[-3000:]}")
        recs, summary = read_jsonl(out)
        api = Api(daemon.http)
        # Acks follow the raw report's commit; the monitors and alerts of the
        # last steps come after it. Under a slow (sanitizer, loaded) daemon
        # the trainer can reach MAX_STEPS before the alert is visible, so wait
        # for the evaluation of the last sketch step, not for a time.
        last = summary["steps"] - summary["steps"] % EVERY
        check(wait_evaluated(api, "smoke", last, time.monotonic() + 600),
              f"the daemon did not evaluate the monitors up to step {last}")
        fired = api.firings("smoke")
        attn = [(f["step"], f["rule"], f["labels"]) for f in fired
                if f["attribution"] == "attention-numerics" and f["family"] != "scalar_loss"]
        loss_det = [f["step"] for f in fired if f["family"] == "scalar_loss"]
        div = divergence_step(recs)
        check(attn, f"no attention-numerics alert in {summary['steps']} steps: "
              f"{[(f['step'], f['rule'], f['attribution']) for f in fired]}")
        first = attn[0][0]
        check(first > FAULT_STEP, f"attention-numerics alert at {first}, before the fault")
        check(div is None or first < div, f"alert at {first}, loss diverged at {div}")
        check(not loss_det or first < loss_det[0],
              f"alert at {first}, loss-based detector at {loss_det[:1]}")
        client = summary.get("client", {})
        check(client.get("dropped", 1) == 0 and client.get("acked") == client.get("reports"),
              f"client counters: {client}")
        print(f"  fault at step {FAULT_STEP}; attention-numerics alert fired at step {first} "
              f"({attn[0][1]} {attn[0][2]}); loss-based detector: "
              f"{loss_det[0] if loss_det else 'none'}; loss diverged: {div or 'no'}; "
              f"stopped at step {summary['steps']} after {time.monotonic() - t0:.0f}s",
              flush=True)
        print("  " + json.dumps({k: client.get(k) for k in ("step_overhead_s",
                                                           "sketch_step_overhead_s")}))
    finally:
        daemon.stop()


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
