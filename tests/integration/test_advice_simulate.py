"""Advice reaches simulated trainers (`foreshock simulate`, libforeshock's
fsc_poll_advice) with the right fields.

The daemon's [advice] policy is set to checkpoint_and_stop for
attention-numerics (the default is checkpoint; the configuration path is
part of what is tested). Four ranks run the attention-numerics scenario with
--stop-on-advice: every rank must print `simulate: advice ...` lines, and
for each line the alert exists and says the same: rule, label (the
attribution of its to_firing event), the firing step, the rollback step
(first breach minus the window for attention series, minus 1 otherwise) and
the action the policy gives its label. Every rank is told to stop; the
alert history shows each rank (attempt 0) that printed an advice as sent
and acknowledged."""
import os
import re
import subprocess

from fstest import Daemon, check, run_all_pages, run_main, wait_until

RANKS = 4
STEPS = 600
FAULT_STEP = 300
RUN = "advice-sim"
ADVICE_RE = re.compile(r"simulate: advice rank=(\d+) step=(-?\d+) action=(\S+) alert=(\d+) "
                       r"rule=(\S+) label=(\S+) rollback=(\S+) at=(\d+)")
CONFIG = """
[advice]
attention-numerics = checkpoint_and_stop
"""
POLICY = {"attention-numerics": "checkpoint_and_stop", "optimizer-hyperparameter": "checkpoint",
          "combined": "checkpoint", "router-balance": "checkpoint",
          "non-finite": "checkpoint_and_stop"}


def test(args, workdir):
    conf = os.path.join(workdir, "foreshockd.conf")
    with open(conf, "w") as f:
        f.write(CONFIG)
    d = Daemon(args.build_dir, workdir, config=conf)
    try:
        cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
               "--run", RUN, "--ranks", str(RANKS), "--steps", str(STEPS), "--layers", "2",
               "--heads", "4", "--dh", "16", "--d", "128", "--sketch-every", "5",
               "--scenario", "attention-numerics", "--fault-step", str(FAULT_STEP),
               "--flush-timeout", "300", "--stop-on-advice", "--advice-wait", "600"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=900)
        print(p.stdout[-4000:])
        check(p.returncode == 0, f"simulate exited {p.returncode}")
        lines = [m.groups() for m in ADVICE_RE.finditer(p.stdout)]
        check(lines, "no advice lines")
        alerts = {a["id"]: a for a in run_all_pages(d, f"/api/v1/alerts?run={RUN}", "alerts")}
        stop_ranks = set()
        for rank, step, action, alert, rule, label, rollback, _at in lines:
            rank, step, alert = int(rank), int(step), int(alert)
            check(0 <= rank < RANKS and alert in alerts, f"line for rank {rank} alert {alert}")
            doc = d.get(f"/api/v1/alerts/{alert}")["alert"]
            check(doc["rule"] == rule, f"alert {alert}: rule {doc['rule']} vs {rule}")
            fired = [e for e in doc["history"] if e["change"] == "to_firing" and e["step"] == step]
            check(fired, f"alert {alert} has no to_firing at step {step}: {doc['history']}")
            ev = fired[0]
            check(ev["attribution"] == label, f"alert {alert}: label {ev['attribution']} vs {label}")
            window = doc["labels"].get("window") or 0
            fb = ev["evidence"]["first_breach_step"]
            want_rb = fb - window if window else fb - 1
            check(rollback == str(want_rb), f"alert {alert}: rollback {rollback}, want {want_rb}")
            check(action == POLICY.get(label, "none"), f"alert {alert}: {label} -> {action}")
            if action == "checkpoint_and_stop":
                stop_ranks.add(rank)
        check(stop_ranks == set(range(RANKS)), f"ranks told to stop: {stop_ranks}")
        check(any(l[5] == "attention-numerics" for l in lines), "no attention-numerics advice")
        # Each line: the alert's history shows that rank (attempt 0) advised and acknowledged.
        for alert in {int(l[3]) for l in lines}:
            ranks = {int(l[0]) for l in lines if int(l[3]) == alert}

            def acked(alert=alert, ranks=ranks):
                adv = d.get(f"/api/v1/alerts/{alert}")["alert"]["advice"]
                dl = [x for a in adv for x in a["deliveries"] if x["attempt"] == 0]
                return ranks <= {x["rank"] for x in dl if x["acked_at"] is not None and
                                 x["sends"] >= 1}
            wait_until(acked, what=f"the acks of alert {alert}'s advice by ranks {ranks}")
    finally:
        d.stop()


if __name__ == "__main__":
    run_main(test)
