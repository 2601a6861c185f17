"""The fault-injection experiment: a real foreshockd, real (tiny) training
runs with injected faults, the alerts read back over HTTP.

    /usr/bin/python3 client/python/experiments/run_experiment.py \
        --build-dir build --out experiment-out --seeds 1,2,3

For every seed it trains the four scenarios of train.py (healthy,
attention-numerics, lr, combined) from the same initial weights and the
same batch order, streams them to one daemon, then writes to --out:
  results.md / results.csv / results.json   one row per run (below)
  overhead.md                               monitor.step() cost beside the step time
  plots/RUN.png                             loss and the per-layer min over heads of the
                                            Delta2 spectral entropy, alert markers
  runs/RUN.jsonl, runs/RUN.log              per-step records and trainer logs
  foreshockd.log, foreshock.db              the daemon's

Per run: the first alert of each monitor family (the step it fired and its
attribution label), the step the loss-based detector fired (the daemon's
`loss` and `grad_norm` rules), the step the loss diverged, and the lead
times of the first mechanism alert over both.

Divergence: the first step t at which the loss is not finite, or the mean
loss of steps t-24..t exceeds 1.2 times the lowest such 25-step mean seen
at or before t (training has lost a fifth of its progress on a log-loss
scale and does not recover in the runs here). "none" when it never happens.
"""
import argparse
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fsapi import Api  # noqa: E402

SCENARIOS = ("healthy", "attention-numerics", "lr", "combined")
FAMILIES = ("attention_d2", "router_weight", "weight_norm", "router_balance", "scalar_loss")
MECHANISM = FAMILIES[:4]
READY_RE = re.compile(r"foreshockd ready ingest=(\S+):(\d+) http=(\S+):(\d+)")
DIVERGE_WINDOW = 25
DIVERGE_RATIO = 1.2
EXPECTED = {"attention-numerics": ("attention-numerics",),
            "lr": ("optimizer-hyperparameter", "combined"),
            "combined": ("combined", "attention-numerics", "optimizer-hyperparameter")}


def divergence_step(records):
    """First step by the definition in the module docstring, or None."""
    window, best = [], math.inf
    for r in records:
        loss = r["loss"]
        if not math.isfinite(loss):
            return r["step"]
        window.append(loss)
        if len(window) > DIVERGE_WINDOW:
            window.pop(0)
        if len(window) < DIVERGE_WINDOW:
            continue
        mean = sum(window) / DIVERGE_WINDOW
        best = min(best, mean)
        if mean >= DIVERGE_RATIO * best:
            return r["step"]
    return None


def read_jsonl(path):
    recs, summary = [], None
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if "summary" in d:
                summary = d["summary"]
            else:
                recs.append(d)
    return recs, summary


class Daemon:
    def __init__(self, build_dir, out, config=None):
        self.log_path = os.path.join(out, "foreshockd.log")
        args = [os.path.join(build_dir, "foreshockd"), "--listen", "127.0.0.1:0",
                "--http", "127.0.0.1:0", "--db", os.path.join(out, "foreshock.db")]
        if config:
            args += ["--config", config]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"foreshockd exited: see {self.log_path}")
            with open(self.log_path) as f:
                m = READY_RE.search(f.read())
            if m:
                self.endpoint = f"{m.group(1)}:{m.group(2)}"
                self.http = f"{m.group(3)}:{m.group(4)}"
                return
            time.sleep(0.05)
        raise SystemExit("foreshockd did not become ready")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.log.close()


def run_all(a, daemon, runs):
    """Trains every (scenario, seed) with at most a.jobs at once."""
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    pending, active = list(runs), []
    train = os.path.join(HERE, "train.py")
    while pending or active:
        while pending and len(active) < a.jobs:
            sc, seed = pending.pop(0)
            name = f"{sc}-s{seed}"
            cmd = [sys.executable, train, "--endpoint", daemon.endpoint, "--run", name,
                   "--scenario", sc, "--seed", str(seed), "--steps", str(a.steps),
                   "--fault-step", str(a.fault_step),
                   "--out", os.path.join(a.out, "runs", name + ".jsonl")] + a.train_args
            logf = open(os.path.join(a.out, "runs", name + ".log"), "w")
            print(f"start {name}", flush=True)
            active.append((name, subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT),
                           logf, time.monotonic()))
        time.sleep(0.5)
        for item in list(active):
            name, proc, logf, t0 = item
            if proc.poll() is not None:
                logf.close()
                active.remove(item)
                print(f"done  {name}: exit {proc.returncode} in {time.monotonic() - t0:.0f}s",
                      flush=True)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} failed: see runs/{name}.log")


def wait_evaluated(api, run, step, deadline):
    """Polls until the daemon's monitor stage has evaluated `run` up to
    sketch step `step` (acks come after the raw report's commit; monitors,
    detectors and alerts follow asynchronously). True when it has, False
    at the deadline (time.monotonic())."""
    while True:
        s = api.series(run, name="qk.d2.entropy.min", layer=0)
        if s and max(x["last_step"] for x in s) >= step:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def wait_monitors(api, a, runs, timeout=600):
    """Waits until the daemon has evaluated each run's last sketch step."""
    deadline = time.monotonic() + timeout
    for sc, seed in runs:
        recs, _ = read_jsonl(os.path.join(a.out, "runs", f"{sc}-s{seed}.jsonl"))
        last = recs[-1]["step"] if recs else 0
        if not wait_evaluated(api, f"{sc}-s{seed}", last - last % a.every, deadline):
            print(f"warning: {sc}-s{seed} not evaluated up to step {last} in {timeout}s",
                  flush=True)


def analyse(api, a, sc, seed):
    name = f"{sc}-s{seed}"
    recs, summary = read_jsonl(os.path.join(a.out, "runs", name + ".jsonl"))
    alerts = api.firings(name)
    first = {}
    for f in alerts:
        if f["family"] not in first:
            first[f["family"]] = {"step": f["step"], "label": f["attribution"],
                                  "rule": f["rule"], "labels": f["labels"]}
    mech = [v for f, v in first.items() if f in MECHANISM]
    m0 = min(mech, key=lambda v: v["step"]) if mech else None
    loss_det = first.get("scalar_loss")
    div = divergence_step(recs)
    fault = a.fault_step if sc != "healthy" else None
    row = {"run": name, "scenario": sc, "seed": seed, "fault_step": fault,
           "steps": recs[-1]["step"] if recs else 0, "alerts": len(alerts),
           "alerted_rules": sorted({f["rule"] for f in alerts})}
    for f in FAMILIES:
        row[f] = first[f]["step"] if f in first else None
        row[f + "_label"] = first[f]["label"] if f in first else None
    row["first_mechanism_step"] = m0["step"] if m0 else None
    row["first_mechanism_label"] = m0["label"] if m0 else None
    row["first_mechanism_rule"] = m0["rule"] if m0 else None
    row["loss_detector_step"] = loss_det["step"] if loss_det else None
    row["diverge_step"] = div
    row["lead_vs_loss_detector"] = (loss_det["step"] - m0["step"]) if m0 and loss_det else None
    row["lead_vs_divergence"] = (div - m0["step"]) if m0 and div else None
    # The criterion of issue 4 for this scenario.
    if sc == "healthy":
        ok = len(alerts) == 0
    else:
        want = EXPECTED[sc]
        hits = [v for v in mech if v["label"] in want]
        hit = min(hits, key=lambda v: v["step"]) if hits else None
        ok = hit is not None and (div is None or hit["step"] < div)
        if sc == "attention-numerics":
            ok = ok and (loss_det is None or hit["step"] < loss_det["step"])
    row["pass"] = bool(ok)
    row["train_s"] = sum(r["train_s"] for r in recs) / max(1, len(recs))
    row["monitor_s"] = sum(r["monitor_s"] for r in recs) / max(1, len(recs))
    sk = [r["monitor_s"] for r in recs if r["step"] % a.every == 0]
    pl = [r["monitor_s"] for r in recs if r["step"] % a.every != 0]
    row["monitor_sketch_s"] = sum(sk) / max(1, len(sk))
    row["monitor_plain_s"] = sum(pl) / max(1, len(pl))
    client = (summary or {}).get("client", {})
    # The sender thread's CPU (building reports, ctypes hand-off), off the
    # training thread but on the same cores: per training step.
    row["sender_cpu_s"] = (client["sender_cpu_s"] / max(1, len(recs))
                           if "sender_cpu_s" in client else None)
    row["reports"] = client.get("reports")
    row["acked"] = client.get("acked")
    row["dropped"] = (client.get("dropped") or 0) + (client.get("dropped_queue") or 0)
    return row, recs, alerts


def fmt(v):
    return "–" if v is None else str(v)


def overhead_mean(rows):
    """The overhead columns averaged over runs (each run weighted equally),
    the counters summed."""
    out = {"run": "**mean of all runs**"}
    for k in ("train_s", "monitor_s", "monitor_sketch_s", "monitor_plain_s", "sender_cpu_s"):
        v = [r[k] for r in rows if r[k] is not None]
        out[k] = sum(v) / len(v) if v else None
    for k in ("reports", "acked", "dropped"):
        v = [r[k] for r in rows if r[k] is not None]
        out[k] = sum(v) if v else None
    return out


def write_tables(a, rows):
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    head = ["run", "fault", "first alert (step, label, rule)", "Δ2 family", "router",
            "weight norm", "balance", "loss detector", "diverged", "lead vs loss det.",
            "lead vs divergence", "firings", "ok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        first = ("–" if r["first_mechanism_step"] is None else
                 f"{r['first_mechanism_step']} {r['first_mechanism_label']} "
                 f"({r['first_mechanism_rule']})")
        fam = lambda f: ("–" if r[f] is None else f"{r[f]} {r[f + '_label']}")  # noqa: E731
        lines.append("| " + " | ".join([
            r["run"], fmt(r["fault_step"]), first, fam("attention_d2"), fam("router_weight"),
            fam("weight_norm"), fam("router_balance"), fmt(r["loss_detector_step"]),
            fmt(r["diverge_step"]), fmt(r["lead_vs_loss_detector"]),
            fmt(r["lead_vs_divergence"]), str(r["alerts"]), "yes" if r["pass"] else "NO"]) + " |")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    ms = lambda v: "–" if v is None else f"{1000 * v:.2f}"  # noqa: E731
    ov = ["| run | train step (ms) | monitor.step() mean (ms) | on sketch steps (ms) | "
          "other steps (ms) | step() / train step | sender thread CPU per step (ms) | "
          "reports | acked | dropped |", "|" + "---|" * 10]
    for r in rows + [overhead_mean(rows)]:
        ov.append(f"| {r['run']} | {ms(r['train_s'])} | {ms(r['monitor_s'])} | "
                  f"{ms(r['monitor_sketch_s'])} | {ms(r['monitor_plain_s'])} | "
                  f"{100 * r['monitor_s'] / r['train_s']:.1f}% | {ms(r['sender_cpu_s'])} | "
                  f"{fmt(r['reports'])} | {fmt(r['acked'])} | {fmt(r['dropped'])} |")
    with open(os.path.join(a.out, "overhead.md"), "w") as f:
        f.write("\n".join(ov) + "\n")
    return "\n".join(lines)


def mean_line(recs):
    """(steps, DIVERGE_WINDOW-step trailing mean loss)."""
    w, losses = DIVERGE_WINDOW, [r["loss"] for r in recs]
    if len(losses) < w:
        return [], []
    return ([r["step"] for r in recs[w - 1:]],
            [sum(losses[i - w + 1:i + 1]) / w for i in range(w - 1, len(losses))])


def plot(a, api, row, recs, alerts, healthy_recs=None):
    """Loss (with the paired healthy run's, when given) and the per-layer
    min over heads of the Delta2 spectral entropy at window a.plot_window,
    with the fault, the first alert of each family and divergence marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    name = row["run"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = [r["step"] for r in recs]
    losses = [r["loss"] for r in recs]
    ax1.plot(steps, losses, lw=0.5, color="0.6", label="loss")
    ax1.plot(*mean_line(recs), lw=1.2, color="0.1", label=f"{DIVERGE_WINDOW}-step mean")
    if healthy_recs and row["scenario"] != "healthy":
        ax1.plot(*mean_line(healthy_recs), lw=1.0, color="tab:green",
                 label=f"paired healthy run, {DIVERGE_WINDOW}-step mean")
    finite = [v for v in losses if v == v and abs(v) != float("inf")]
    if finite:  # keep the interesting range visible when the loss explodes
        ax1.set_ylim(min(finite) * 0.95, min(max(finite), 3 * min(finite)) * 1.05)
    ax1.set_ylabel("loss (nats)")
    ax1.set_title(f"{name}")
    ent = {}
    for s in api.series(name, name="qk.d2.entropy.min", window=a.plot_window):
        lab = s.get("labels") or {}
        ent[lab.get("layer")] = [(p, v) for p, v in api.points(s["id"]) if v is not None]
    for layer in sorted(k for k in ent if k is not None):
        pts = ent[layer]
        ax2.plot([p for p, _ in pts], [v for _, v in pts], lw=0.9, label=f"layer {layer}")
    ax2.set_ylabel(f"Δ2 entropy (nats), {a.plot_window}-step window,\nmin over heads")
    ax2.set_xlabel("step")
    colors = {"attention_d2": "tab:red", "router_weight": "tab:purple", "weight_norm": "tab:orange",
              "router_balance": "tab:brown", "scalar_loss": "tab:blue"}
    seen = set()
    for f in alerts:  # the first firing of each family
        fam = f["family"]
        if fam in seen:
            continue
        seen.add(fam)
        for ax in (ax1, ax2):
            ax.axvline(f["step"], color=colors.get(fam, "k"), lw=1.0, ls="--",
                       label=(f"first {fam} alert, step {f['step']} ({f['attribution']})"
                              if ax is ax1 else None))
    for ax in (ax1, ax2):
        if row["fault_step"]:
            ax.axvline(row["fault_step"], color="k", lw=1.0, ls=":",
                       label="fault" if ax is ax1 else None)
        if row["diverge_step"]:
            ax.axvline(row["diverge_step"], color="k", lw=1.5,
                       label=f"loss diverged, step {row['diverge_step']}" if ax is ax1 else None)
    ax1.legend(fontsize=7, loc="upper right")
    ax2.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    os.makedirs(os.path.join(a.out, "plots"), exist_ok=True)
    fig.savefig(os.path.join(a.out, "plots", name + ".png"), dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.path.join(HERE, "..", "..", "..", "build"))
    p.add_argument("--out", default="experiment-out")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--fault-step", type=int, default=200)
    p.add_argument("--every", type=int, default=5, help="must match train.py --every")
    p.add_argument("--jobs", type=int, default=2, help="trainers at once")
    p.add_argument("--plot-window", type=int, default=5,
                   help="the Delta2 window (one of train.py --windows) the plots show")
    p.add_argument("--config", default=None,
                   help="foreshockd config file (default: none, the daemon's defaults)")
    p.add_argument("--analyse-only", action="store_true",
                   help="reuse --out's runs and database (restarts the daemon on it)")
    a, rest = p.parse_known_args(argv)
    a.train_args = [x for x in rest if x != "--"]
    os.makedirs(a.out, exist_ok=True)
    runs = [(sc, int(s)) for s in a.seeds.split(",") for sc in a.scenarios.split(",")]
    daemon = Daemon(a.build_dir, a.out, a.config)
    try:
        api = Api(daemon.http)
        if not a.analyse_only:
            run_all(a, daemon, runs)
        wait_monitors(api, a, runs)
        rows, done = [], {}
        for sc, seed in runs:
            row, recs, alerts = analyse(api, a, sc, seed)
            rows.append(row)
            done[(sc, seed)] = (row, recs, alerts)
        for (sc, seed), (row, recs, alerts) in done.items():
            healthy = done.get(("healthy", seed))
            plot(a, api, row, recs, alerts, healthy[1] if healthy else None)
        table = write_tables(a, rows)
    finally:
        daemon.stop()
    print(table)
    with open(os.path.join(a.out, "overhead.md")) as f:
        print(f.read())
    ok = all(r["pass"] for r in rows)
    print("criteria met" if ok else "criteria NOT met", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
