"""CI smoke run of live training: a tiny MoE GPT trained for a few dozen
steps with the attention-numerics fault switched on, streamed by
foreshock.Monitor to the real daemon while the same Monitor records its
report stream.

Live training takes a different floating-point trajectory on each CPU
model, so this test asserts only what holds on every machine: every report
is acknowledged and none dropped, the recording holds exactly the reports
that were sent, the daemon stored the Delta2 and router series of every
layer, and replaying the recording into a second run gives exactly the
same stored values (what `foreshock backtest` and bug reports rely on).
Whether detection catches the fault is asserted on recorded runs
(test_replay_detection.py), which give the same answer on any CPU.
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

STEPS = 60
FAULT_STEP = 20
EVERY = 5        # train.py's default sketch cadence
LAYERS = 4       # train.py's default model


def main(args, workdir):
    exp = os.path.join(args.source_dir, "client", "python", "experiments")
    sys.path.insert(0, exp)
    from fsapi import Api
    from run_experiment import read_jsonl
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        out = os.path.join(workdir, "smoke.jsonl")
        rec = os.path.join(workdir, "smoke.fsrec")
        env = dict(os.environ, FORESHOCK_LIB=os.path.join(os.path.abspath(args.build_dir),
                                                          "libforeshock.so"))
        cmd = [sys.executable, os.path.join(exp, "train.py"), "--endpoint", daemon.endpoint,
               "--run", "smoke", "--scenario", "attention-numerics", "--seed", "2",
               "--steps", str(STEPS), "--fault-step", str(FAULT_STEP), "--out", out,
               "--record", rec]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, timeout=1200)
        check(p.returncode == 0, f"train.py exited {p.returncode}:\n{p.stdout[-3000:]}")
        recs, summary = read_jsonl(out)
        client = summary.get("client", {})
        check(summary["steps"] == STEPS, f"training stopped at {summary['steps']}")
        check(client.get("dropped", 1) == 0 and client.get("acked") == client.get("reports")
              == STEPS, f"client counters: {client}")
        check(client.get("recorded") == STEPS and client.get("record_failed") == 0,
              f"recording counters: {client}")

        api = Api(daemon.http)
        last = STEPS - STEPS % EVERY
        deadline = time.monotonic() + 600
        while True:
            live = api.values("smoke")
            d2 = [k for k in live if k[0] == "qk.d2.entropy.min"]
            if d2 and all(max(live[k]) >= last for k in d2):
                break
            check(time.monotonic() < deadline,
                  f"the daemon did not evaluate the monitors up to step {last}")
            time.sleep(0.5)
        # api.values reads one series after the other, so a snapshot taken
        # while steps were still committing can hold older points for the
        # series read first. The last step commits all its series in one
        # transaction: read again now that it is in.
        live = api.values("smoke")
        layers = sorted({k[1] for k in d2})
        check(layers == list(range(LAYERS)), f"Delta2 aggregates for layers {layers}")
        routers = sorted({k[1] for k in live if k[0] == "router.entropy"})
        check(routers == list(range(LAYERS)), f"router entropy for layers {routers}")
        check(len(live[("loss", None, None, None, 0)]) == STEPS, "one loss point per step")

        # The recording, replayed into another run of the same daemon, stores
        # exactly what the live stream stored.
        r = subprocess.run([os.path.join(args.build_dir, "foreshock"), "replay", rec,
                            "--endpoint", daemon.endpoint, "--run", "smoke-replayed"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=600)
        check(r.returncode == 0 and f"{STEPS} reports, {STEPS} acknowledged" in r.stdout,
              f"replay: {r.returncode}\n{r.stdout}")
        while True:
            again = api.values("smoke-replayed")
            if all(max(again.get(k, {0: -1})) >= last for k in d2):
                break
            check(time.monotonic() < deadline, "the replayed run was not evaluated")
            time.sleep(0.5)
        again = api.values("smoke-replayed")  # a complete snapshot, as above
        check(set(again) == set(live), f"series differ: {sorted(set(again) ^ set(live))[:5]}")
        for k in live:
            check(again[k] == live[k], f"series {k} differs after replay")
        print(f"  {STEPS} steps live and replayed: {len(live)} series identical, "
              f"{client['acked']} reports acked, 0 dropped", flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
