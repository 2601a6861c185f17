"""Prints the demo's punchline: the first mechanism alert of a run and its
lead time over the simulated loss divergence and over the loss detector.
Usage: foreshock alerts --run RUN --json | python3 deploy/demo_summary.py SIMULATE_OUTPUT"""
import json
import re
import sys


def main(sim_out):
    alerts = json.load(sys.stdin)["alerts"]
    m = re.search(r"diverge_step=(\S+)", open(sim_out).read())
    diverge = None if (m is None or m.group(1) == "none") else int(m.group(1))
    fired = [a for a in alerts if a["evidence"]["fired_step"] is not None]
    mech = [a for a in fired if a["rule"] not in ("loss", "grad_norm")]
    loss = [a["evidence"]["fired_step"] for a in fired if a["rule"] in ("loss", "grad_norm")]
    if not mech:
        print("demo: no mechanism alert fired")
        return
    first = min(mech, key=lambda a: a["evidence"]["fired_step"])
    step = first["evidence"]["fired_step"]
    print(f"\ndemo: first mechanism alert: {first['rule']} ({first['attribution']}), "
          f"labels {first['labels']}, fired at step {step}")
    if diverge is not None:
        print(f"demo: the simulated loss diverges at step {diverge}: "
              f"lead time {diverge - step} steps")
    if loss:
        print(f"demo: the loss-based detector fired at step {min(loss)}: "
              f"lead time {min(loss) - step} steps")


if __name__ == "__main__":
    main(sys.argv[1])
