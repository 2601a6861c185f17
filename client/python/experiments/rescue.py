"""The rescue experiment: a real foreshockd advises a real (tiny) training
run, which rolls back and finishes as if the fault had not happened.

    /usr/bin/python3 client/python/experiments/rescue.py --build-dir build \
        --out rescue-out --plots docs

For each fault (the attention-numerics fault and the large learning rate,
as the recorded corpus injects them: corpus.ARCHS, gpt-moe, seed 1) it
trains, on one seed and from the same initial weights and batches:
  healthy    no fault, to --steps (shared by both faults)
  unrescued  the fault from --fault-step on, advice ignored; runs until the
             loss diverged (run_experiment.divergence_step) and --post more
             steps
  rescued    the same fault, with Monitor(on_advice=...): the trainer keeps
             an in-memory checkpoint (model, optimizer, batch position)
             every --every-ckpt steps; when advised to checkpoint it
             restores the latest checkpoint at or before the advice's
             rollback_step, removes the cause (the faulty attention kernel
             replaced, or the learning rate restored) and continues as
             attempt 1 from that step (Monitor(attempt=1, resume_step=S)),
             to --steps
every run streamed with a default Monitor to one foreshockd started here
with its defaults (no configuration) on ephemeral loopback ports.

Writes to --out: runs/RUN.jsonl (one line per step: step, attempt, loss,
grad_norm, lr; "event" lines for advice and the rewind; a last summary
line), results.md, results.json, foreshockd.log, foreshock.db; and to
--plots rescue-FAULT.png (the three loss curves, the advice and the
rollback step marked).

Criteria, per fault (exit 1 when one fails): the healthy run does not
diverge; the unrescued run diverges; the rescued run is advised before that
divergence, and its final 25-step mean loss is at most (1 + --tolerance)
times the healthy run's (within noise, or below); the daemon shows the
rewind (attempt 1 from S, rebuilt) and the advised alert superseded, and
no sketch was late.

Steps saved: both the rescued trainer and a trainer without Foreshock roll
back to the same checkpoint S; the rescued one throws away the steps from S
to the step it took the advice (A), the other the steps from S to the step
its loss diverged (D, the earliest a loss curve says the run is lost). The
compute saved is D - A steps.
"""
import argparse
import copy
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import corpus  # noqa: E402
import train  # noqa: E402
from fsapi import Api  # noqa: E402
from run_experiment import DIVERGE_WINDOW, Daemon, divergence_step, mean_line  # noqa: E402

ARCH = "gpt-moe"
# name -> (corpus scenario, train.py scenario, what removing the cause means)
FAULTS = {
    "attention-numerics": ("attn-strong", "attention-numerics",
                           "the faulty attention backward replaced (BF16 truncation off)"),
    "lr": ("lr", "lr", "the learning rate restored to its schedule"),
}


def trainer_args(fault, seed, steps):
    """train.py's arguments for the corpus cell ARCH x fault (None:
    healthy): the model, optimizer, schedule and fault parameters the
    recorded corpus used, so the divergence steps are the corpus's."""
    c = corpus.ARCHS[ARCH]
    args = c["args"] + corpus.COMMON + ["--seed", str(seed), "--steps", str(steps),
                                        "--schedule", corpus.schedule_of(seed),
                                        "--fault-step", str(c["fault_step"])]
    if fault is None:
        return train.parse_args(args + ["--scenario", "healthy"])
    cell, scenario, _ = FAULTS[fault]
    if cell == "attn-strong":
        args += ["--bits", str(c["attn_strong_bits"]), "--fault-on", "both"]
    else:
        args += ["--lr-mult", str(c["lr_mult"]), "--lr-ramp", str(c["lr_ramp"])]
    return train.parse_args(args + ["--scenario", scenario])


def build(a):
    """Model, optimizer and batches exactly as train.py builds them."""
    import tinygpt
    torch.manual_seed(a.seed)
    data, vocab = tinygpt.load_corpus(a.corpus)
    moe = (a.experts, a.top_k) if a.experts else None
    model = tinygpt.TinyGPT(vocab, d=a.d, n_layer=a.layers, n_head=a.heads, t=a.ctx, moe=moe)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt, tinygpt.Batches(data, a.batch, a.ctx, a.seed)


class Inbox:
    """on_advice handler. It runs on the training thread inside
    Monitor.step(); it only takes note, because the rewind replaces the
    Monitor, which cannot happen inside that Monitor's own step(). The loop
    acts on `due` once step() has returned."""

    def __init__(self, log):
        self.log = log
        self.due = []

    def __call__(self, adv):
        self.log({"event": "advice", **adv.as_dict()})
        if adv.checkpoint:
            self.due.append(adv)


def train_run(a, name, endpoint, mode, out_path, steps, post, every_ckpt):
    """mode: healthy, unrescued or rescued. Returns the run's summary."""
    model, opt, batches = build(a)
    healthy_lr = copy.copy(a)
    healthy_lr.scenario = "healthy"
    out = open(out_path, "w")

    def log(rec):
        out.write(json.dumps(rec) + "\n")

    inbox = Inbox(log)
    attempt, fault_on, rewind, advised = 0, a.scenario != "healthy", None, []
    mon = foreshock.Monitor(model, endpoint=endpoint, run=name, on_advice=inbox)
    ckpts = {}  # step -> checkpoint; the tiny model's whole history fits in memory

    def checkpoint(step):
        ckpts[step] = {"model": copy.deepcopy(model.state_dict()),
                       "opt": copy.deepcopy(opt.state_dict()),
                       "rng": torch.get_rng_state(), "step": step}

    checkpoint(0)
    recs, step, diverged, stop_at = [], 0, None, steps
    t0 = time.monotonic()
    while step < stop_at:
        step += 1
        if fault_on and a.scenario == "attention-numerics" and step >= a.fault_step:
            model.fault.bits, model.fault.on = a.bits, a.fault_on
        lr = train.lr_at(a if fault_on else healthy_lr, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches.get(step)  # batch i is a function of (seed, i): the step is the position
        loss, aux = model(x, y)
        total = loss + a.aux * aux if aux is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        mon.step(step, loss=loss, grad_norm=gn, lr=lr)
        rec = {"step": step, "attempt": attempt, "loss": loss.item(), "grad_norm": gn.item(),
               "lr": lr}
        log(rec)
        recs = [r for r in recs if r["step"] < step] + [rec]  # a rewind re-does steps
        if step % every_ckpt == 0:
            checkpoint(step)
        advised += inbox.due
        if mode == "rescued" and inbox.due and rewind is None:
            adv = min(inbox.due, key=lambda v: v.rollback_step if v.rollback_step is not None
                      else v.first_breach_step - 1)
            target = adv.rollback_step if adv.rollback_step is not None \
                else adv.first_breach_step - 1
            s = max(k for k in ckpts if k <= target)
            ck = ckpts[s]
            mon.close(60)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            torch.set_rng_state(ck["rng"])
            fault_on = False
            model.fault.bits = 0
            attempt = 1
            rewind = {"advice_step": step, "rollback_step": adv.rollback_step,
                      "resume_step": s, "alert_id": adv.alert_id, "rule": adv.rule,
                      "label": adv.label, "severity": adv.severity,
                      "fired_step": adv.fired_step, "first_breach_step": adv.first_breach_step,
                      "window": adv.window, "layer": adv.layer}
            log({"event": "rewind", **rewind})
            print(f"  {name}: advised at step {step} ({adv}); restored the checkpoint of step "
                  f"{s}, fault removed, attempt 1", flush=True)
            for k in [k for k in ckpts if k > s]:
                del ckpts[k]
            mon = foreshock.Monitor(model, endpoint=endpoint, run=name, attempt=1,
                                    resume_step=s, on_advice=inbox)
            step = s
            recs = [r for r in recs if r["step"] <= s]
        inbox.due = []
        if diverged is None and mode == "unrescued":
            diverged = divergence_step(recs)
            if diverged is not None:
                stop_at = min(steps, diverged + post)
        if not math.isfinite(rec["loss"]):
            break
    mon.close(120)
    summary = {"run": name, "mode": mode, "steps": step, "wall_s": time.monotonic() - t0,
               "diverged": divergence_step(recs), "rewind": rewind,
               "advised": [v.as_dict() for v in advised]}
    log({"summary": summary})
    out.close()
    return summary, recs


def final_mean(recs):
    tail = [r["loss"] for r in recs[-DIVERGE_WINDOW:]]
    return sum(tail) / len(tail)


def wait_evaluated(api, run, step, timeout=300):
    """Until the daemon's monitors have evaluated `run` up to sketch step
    `step` (they run after the reports' acks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = api.series(run, name="qk.d2.entropy.min", layer=0)
        if s and max(x["last_step"] for x in s) >= step:
            return True
        time.sleep(0.5)
    return False


def daemon_view(api, run, rewind):
    """What the daemon shows of the rescued run: its attempts, the advised
    alert's state, and the alerts that fired in attempt 1."""
    info = api.run_info(run)["run"]
    attempts = [(x["attempt"], x["resume_step"], x["rebuilt_at"] is not None)
                for x in info["attempts"]]
    deadline = time.monotonic() + 60
    while True:
        state = api.alert(rewind["alert_id"])["alert"]["state"]
        if state == "superseded" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    fired1 = []  # transitions to firing in attempt 1 (pending ones are not alerts yet)
    for x in api.alerts(run, attempt=1):
        for ev in api.alert(x["id"])["alert"].get("history") or []:
            if ev.get("to") == "firing" and ev.get("attempt") == 1:
                fired1.append((x["rule"], ev.get("attribution") or x["attribution"], ev["step"]))
    return {"attempts": attempts, "advised_alert_state": state, "attempt1_firings": fired1}


def metric(api, name):
    import urllib.request
    with urllib.request.urlopen(api.base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def plot(path, fault, healthy, unres, resc, row):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.8))
    # Until the rollback the rescued run is the unrescued one (same fault,
    # same batches): its curve starts at the checkpoint it restored; the
    # healthy run is drawn last, on top of the shared steps before the fault.
    rs, rm = mean_line(resc)
    keep = [i for i, s in enumerate(rs) if s >= row["resume_step"]]
    for (xs, ys), color, label in (
            (mean_line(unres), "tab:red", "faulted, advice ignored"),
            (([rs[i] for i in keep], [rm[i] for i in keep]), "tab:blue",
             "faulted, rescued: attempt 1 from the checkpoint"),
            (mean_line(healthy), "tab:green", "healthy")):
        ax.plot(xs, ys, lw=1.5, color=color, label=f"{label} ({DIVERGE_WINDOW}-step mean)")
    lo = min(mean_line(healthy)[1])
    ax.set_ylim(lo * 0.95, lo * 1.6)
    ax.axvline(row["fault_step"], color="k", ls=":", lw=1, label=f"fault, step {row['fault_step']}")
    ax.axvline(row["advice_step"], color="tab:orange", ls="--", lw=1.2,
               label=f"advice taken, step {row['advice_step']} ({row['rule']}, "
                     f"{row['label']}, fired at {row['fired_step']})")
    ax.axvline(row["resume_step"], color="tab:blue", ls="--", lw=1.2,
               label=f"rolled back to the checkpoint of step {row['resume_step']} "
                     f"(advised rollback step {row['rollback_step']})")
    if row["diverged"]:
        ax.axvline(row["diverged"], color="tab:red", lw=1.2,
                   label=f"unrescued run diverged, step {row['diverged']}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"{fault} fault, {ARCH} seed {row['seed']}: advice -> checkpoint -> "
                 f"rollback, cause removed")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_loss(v):
    return "–" if v is None else f"{v:.4f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.path.join(HERE, "..", "..", "..", "build"))
    p.add_argument("--out", default="rescue-out")
    p.add_argument("--plots", default=None, help="directory of the plots (default: --out)")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=1000,
                   help="healthy and rescued runs' last step (the corpus's run length)")
    p.add_argument("--post", type=int, default=50,
                   help="steps the unrescued run trains after its loss diverged")
    p.add_argument("--every-ckpt", type=int, default=10, help="in-memory checkpoint cadence")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="rescued final 25-step mean loss may exceed the healthy run's by this "
                        "fraction")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args(argv)
    global torch, foreshock
    os.environ.setdefault("FORESHOCK_LIB", os.path.join(os.path.abspath(a.build_dir),
                                                        "libforeshock.so"))
    import torch
    import foreshock
    torch.set_num_threads(a.threads)
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    plots = a.plots or a.out
    os.makedirs(plots, exist_ok=True)
    for f in ("foreshock.db", "foreshock.db-wal", "foreshock.db-shm"):
        if os.path.exists(os.path.join(a.out, f)):
            os.remove(os.path.join(a.out, f))
    faults = a.faults.split(",")
    daemon = Daemon(a.build_dir, a.out)
    rows, failures = [], []
    try:
        api = Api(daemon.http)
        run = lambda fault, mode: train_run(  # noqa: E731
            trainer_args(fault, a.seed, a.steps), f"{mode}-{fault or 'none'}-s{a.seed}"
            if fault else f"healthy-s{a.seed}", daemon.endpoint, mode,
            os.path.join(a.out, "runs", (f"{fault}-{mode}" if fault else "healthy") + ".jsonl"),
            a.steps, a.post, a.every_ckpt)
        print(f"healthy run, {a.steps} steps", flush=True)
        hs, healthy = run(None, "healthy")
        print(f"  done in {hs['wall_s']:.0f}s; advised: {len(hs['advised'])}", flush=True)
        for fault in faults:
            print(f"{fault}: unrescued run", flush=True)
            us, unres = run(fault, "unrescued")
            print(f"  done in {us['wall_s']:.0f}s at step {us['steps']}; diverged at "
                  f"{us['diverged']}", flush=True)
            print(f"{fault}: rescued run", flush=True)
            rs, resc = run(fault, "rescued")
            print(f"  done in {rs['wall_s']:.0f}s", flush=True)
            rw = rs["rewind"] or {}
            row = {"fault": fault, "seed": a.seed, "fault_step": corpus.ARCHS[ARCH]["fault_step"],
                   "remedy": FAULTS[fault][2], "advice_step": rw.get("advice_step"),
                   "fired_step": rw.get("fired_step"), "rule": rw.get("rule"),
                   "label": rw.get("label"), "rollback_step": rw.get("rollback_step"),
                   "resume_step": rw.get("resume_step"), "diverged": us["diverged"],
                   "unrescued_steps": us["steps"],
                   "unrescued_advised_at": next((v["trainer_step"] for v in us["advised"]),
                                                None),
                   "healthy_final": final_mean(healthy), "unrescued_final": final_mean(unres),
                   "rescued_final": final_mean(resc), "healthy_diverged": hs["diverged"],
                   "rescued_diverged": rs["diverged"]}
            row["ratio"] = row["rescued_final"] / row["healthy_final"]
            row["saved"] = (us["diverged"] - rw["advice_step"]) if rw and us["diverged"] else None
            wait_evaluated(api, rs["run"], a.steps - a.steps % 10)
            row["daemon"] = daemon_view(api, rs["run"], rw) if rw else None
            rows.append(row)
            plot(os.path.join(plots, f"rescue-{fault}.png"), fault, healthy, unres, resc, row)
        late = metric(api, "foreshock_sketches_late_total")
    finally:
        daemon.stop()

    lines = ["| fault | fault step | advice (rule, label, fired at) | advice taken at | "
             "advised rollback step | checkpoint restored | unrescued diverged | "
             f"final {DIVERGE_WINDOW}-step mean loss: healthy / unrescued / rescued | "
             "rescued / healthy | steps saved | ok |", "|" + "---|" * 11]
    for r in rows:
        ok = []
        if r["healthy_diverged"]:
            ok.append(f"healthy run diverged at {r['healthy_diverged']}")
        if not r["diverged"]:
            ok.append("unrescued run did not diverge")
        if r["advice_step"] is None:
            ok.append("rescued run was never advised")
        elif r["diverged"] and r["advice_step"] >= r["diverged"]:
            ok.append("advice came after the divergence")
        if r["ratio"] > 1 + a.tolerance:
            ok.append(f"rescued final loss {100 * (r['ratio'] - 1):.2f}% above healthy "
                      f"(> {100 * a.tolerance:g}%)")
        d = r["daemon"]
        if d and (d["advised_alert_state"] != "superseded" or
                  d["attempts"] != [(0, None, False), (1, r["resume_step"], True)]):
            ok.append(f"daemon view {d}")
        r["failures"] = ok
        failures += [f"{r['fault']}: {m}" for m in ok]
        lines.append("| " + " | ".join([
            r["fault"], str(r["fault_step"]),
            f"{r['rule']}, {r['label']}, {r['fired_step']}" if r["rule"] else "–",
            str(r["advice_step"]), str(r["rollback_step"]), str(r["resume_step"]),
            f"{r['diverged']} (stopped at {r['unrescued_steps']})",
            f"{fmt_loss(r['healthy_final'])} / {fmt_loss(r['unrescued_final'])} / "
            f"{fmt_loss(r['rescued_final'])}",
            f"{r['ratio']:.4f}", str(r["saved"]), "yes" if not ok else "NO"]) + " |")
    if late:
        failures.append(f"{late:g} sketches late (foreshock_sketches_late_total)")
    table = "\n".join(lines)
    notes = [
        "",
        f"Seed {a.seed}, {ARCH} ({' '.join(corpus.ARCHS[ARCH]['args'])}), "
        f"healthy and rescued runs to step {a.steps}; checkpoints every {a.every_ckpt} steps.",
        f"Within noise: the rescued run's mean loss over its last {DIVERGE_WINDOW} steps is at "
        f"most {1 + a.tolerance:g}x the healthy run's over the same steps.",
        "Steps saved: D - A, the unrescued run's divergence step minus the step the rescued "
        "trainer took the advice (both roll back to the same checkpoint; the steps after it "
        "are thrown away).",
        "Unrescued final: its last 25 steps (it stops after the divergence).",
    ]
    for r in rows:
        if r["daemon"]:
            notes.append(f"{r['fault']}: daemon: attempts {r['daemon']['attempts']} "
                         f"(attempt, resume_step, rebuilt); advised alert "
                         f"{r['daemon']['advised_alert_state']}; alerts fired in attempt 1: "
                         f"{r['daemon']['attempt1_firings'] or 'none'}; the unrescued run was "
                         f"advised at step {r['unrescued_advised_at']}.")
    notes.append(f"Late sketches (whole daemon): {late:g}.")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(table + "\n" + "\n".join(notes) + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table + "\n" + "\n".join(notes))
    if failures:
        print("criteria NOT met: " + "; ".join(failures), flush=True)
        return 1
    print("criteria met", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
