"""foreshock.Monitor takes advice on the training thread, inside step().

Two ranks of one run, each a Monitor on a tiny real PyTorch model, stream
to the real daemon. Rank 0 reports a NaN loss at step 10: the non-finite
loss rule fires at once and the default [advice] policy tells every rank
checkpoint_and_stop. Rank 0 uses on_advice=foreshock.Rescue(save): the
handler must run on the training thread while its step() call is in
progress (the step that delivered it is advice.trainer_step), save once,
and set rescue.stop, after which the loop stops. Rank 1 passes no handler:
the same advice collects in monitor.advice. The advice carries the alert's
fields; the alert's history shows both ranks advised and acknowledged.
Then the rollback: rank 0's trainer restarts from its periodic checkpoint of
step 5 (at or before the advice's rollback_step) as attempt 1
(Monitor(attempt=1, resume_step=5)) and trains on with finite losses: the
alert ends superseded, the run lists the attempt with its rebuilt state, the
new attempt is not advised about the superseded alert, and the loss points
after step 5 are the new attempt's.
The loop's length is bounded (it keeps stepping until the advice arrives);
no verdict depends on timing."""
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

RUN = "py-advice"
NAN_STEP = 10
CHECKPOINT_STEP = 5  # the trainer's periodic checkpoint before the damage
MAX_STEPS = 4000  # bound on the loop waiting for the advice (20 ms a step)


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir),
                                               "libforeshock.so")
    import torch
    import foreshock
    torch.set_num_threads(1)
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        training_thread = threading.get_ident()
        state = {"in_step": None}
        saves, calls = [], []

        def save(adv):
            # What a trainer does: touch its own training state here.
            calls.append((threading.get_ident(), state["in_step"], adv.trainer_step))
            saves.append({k: v.clone() for k, v in model.state_dict().items()})

        rescue = foreshock.Rescue(save)
        mon0 = foreshock.Monitor(model, endpoint=daemon.endpoint, run=RUN, rank=0, world_size=2,
                                 attention=[], routers=[], on_advice=rescue)
        mon1 = foreshock.Monitor(model, endpoint=daemon.endpoint, run=RUN, rank=1, world_size=2,
                                 attention=[], routers=[])
        x = torch.randn(16, 8)
        step = 0
        periodic = None
        while not rescue.stop and step < MAX_STEPS:
            loss = ((model(x) - 1.0) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            value = float("nan") if step == NAN_STEP else float(loss)
            state["in_step"] = step
            mon0.step(step, loss=value, lr=1e-2)
            mon1.step(step, loss=value, lr=1e-2)
            state["in_step"] = None
            if step == CHECKPOINT_STEP:
                periodic = {k: v.clone() for k, v in model.state_dict().items()}
            if not rescue.stop:
                time.sleep(0.02)
                step += 1
        check(rescue.stop, f"no checkpoint_and_stop advice within {MAX_STEPS} steps")
        adv = rescue.stop_advice
        print(f"  rank 0 told to stop at step {step}: {adv}", flush=True)
        check(calls and all(t == training_thread for t, _, _ in calls),
              f"on_advice ran on threads {[c[0] for c in calls]}, training thread "
              f"{training_thread}")
        check(all(s is not None and s == ts for _, s, ts in calls),
              f"on_advice outside step() or wrong trainer_step: {calls}")
        check(len(saves) == 1 and rescue.checkpoints == [adv], f"saves: {len(saves)}")
        check(adv.action == "checkpoint_and_stop" and adv.rule == "loss" and
              adv.label == "non-finite" and adv.severity == "critical" and
              adv.step == NAN_STEP and adv.fired_step == NAN_STEP and
              adv.rollback_step == NAN_STEP - 1 and adv.rank == 0 and adv.layer is None,
              f"advice fields: {adv.as_dict()}")
        check(adv.trainer_step >= NAN_STEP, f"delivered at step {adv.trainer_step}")
        check(mon0.advice == [], f"handled advice kept pending: {mon0.advice}")

        # Rank 1 had no handler: the advice waits in monitor.advice.
        for _ in range(MAX_STEPS):
            if mon1.advice:
                break
            step += 1
            mon1.step(step, loss=0.5)
            time.sleep(0.02)
        pend = mon1.advice
        check(pend and pend[0].advice_id == adv.advice_id and pend[0].alert_id == adv.alert_id,
              f"rank 1 pending: {pend}")
        pend.clear()
        st0, st1 = mon0.close(30), mon1.close(30)
        check(st0["advice_taken"] >= 1 and st1["advice_taken"] >= 1 and
              st0["advice_dropped"] == 0, f"advice counters {st0} {st1}")

        def acked():
            doc = daemon.get(f"/api/v1/alerts/{adv.alert_id}")["alert"]
            dl = [d for a in doc["advice"] if a["id"] == adv.advice_id for d in a["deliveries"]]
            return {d["rank"] for d in dl if d["acked_at"] is not None} == {0, 1}
        fstest.wait_until(acked, what="both ranks' acks in the alert history")

        # The rollback: attempt 1 from the checkpoint of step 5 <= rollback_step.
        check(CHECKPOINT_STEP <= adv.rollback_step, f"rollback step {adv.rollback_step}")
        model.load_state_dict(periodic)
        seen = []
        mon = foreshock.Monitor(model, endpoint=daemon.endpoint, run=RUN, rank=0, world_size=2,
                                attention=[], routers=[], attempt=1,
                                resume_step=CHECKPOINT_STEP, on_advice=seen.append)
        redone = {}
        for step in range(CHECKPOINT_STEP + 1, CHECKPOINT_STEP + 21):
            loss = ((model(x) - 1.0) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            redone[step] = float(loss)
            mon.step(step, loss=redone[step], lr=1e-2)
        st = mon.close(30)
        check(st["acked"] == len(redone), f"attempt 1 counters {st}")

        def superseded():
            return daemon.get(f"/api/v1/alerts/{adv.alert_id}")["alert"]["state"] == "superseded"
        fstest.wait_until(superseded, what="the NaN alert superseded")
        doc = daemon.get(f"/api/v1/alerts/{adv.alert_id}")["alert"]
        sup = [e for e in doc["history"] if e["change"] == "to_superseded"]
        check(len(sup) == 1 and sup[0]["attempt"] == 0 and sup[0]["step"] == CHECKPOINT_STEP,
              f"history {doc['history']}")
        att = daemon.get(f"/api/v1/runs/{RUN}")["run"]["attempts"]
        check([(a["attempt"], a["resume_step"]) for a in att] == [(0, None), (1, CHECKPOINT_STEP)]
              and att[1]["rebuilt_at"] is not None, f"attempts {att}")
        check(not [a for a in seen if a.alert_id == adv.alert_id],
              f"attempt 1 was advised about the superseded alert: {seen}")
        loss_series = [s for s in fstest.run_all_pages(daemon, f"/api/v1/series?run={RUN}&name=loss",
                                                       "series") if s["labels"].get("rank") == 0]
        pts = dict(daemon.get(f"/api/v1/series/{loss_series[0]['id']}/points?from="
                              f"{CHECKPOINT_STEP + 1}&to={max(redone)}")["points"])
        check(all(abs(pts[s] - v) <= 1e-12 * max(1.0, abs(v)) for s, v in redone.items()),
              f"re-done loss points are not attempt 1's: {pts} vs {redone}")
        print(f"  attempt 1 from step {CHECKPOINT_STEP}: alert {adv.alert_id} superseded, "
              f"{len(redone)} re-done steps stored as attempt 1's", flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
