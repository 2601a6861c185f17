"""Advice over the raw protocol, across daemon restarts.

A stream whose Hello declares CAPABILITY_ADVICE sends rank-0 losses; a NaN
loss fires the non-finite loss rule at once, which the default [advice]
policy answers with checkpoint_and_stop. The test checks:
1. the Advice frame arrives on the stream with the alert's fields (id,
   rule, label, severity, steps, rollback step), and /api/v1/alerts/{id}
   shows it sent to (attempt 0, rank 0), not acknowledged;
2. a client without the capability on the same run (an old client) never
   sees an Advice frame: its reports are acked as before;
3. the daemon is stopped before the advice is acknowledged and started
   again: the reconnecting stream is sent the same advice again (delivery
   derived from stored state), the API counts two sends;
4. once acknowledged (AdviceAck), the API shows acked_at, and after a
   crash (SIGKILL) and restart the stream is owed nothing;
5. five normal losses resolve the alert: the stream, which had the firing
   advice, gets a `resolved` advice for the same alert; a stream of a new
   attempt that connects afterwards is owed nothing (the firing advice is
   closed, and it never had it).
"""
from fstest import (Daemon, RawConn, check, hello, proto_module, report, run_main,
                    wait_until)

RUN = "advice-restart"
NAN = float("nan")


def connect(pb, d, attempt=0, capable=True):
    c = RawConn(pb, d.ingest_port)
    h = hello(pb, RUN, attempt=attempt)
    if capable:
        h.hello.capabilities = pb.CAPABILITY_ADVICE
    c.send(h)
    w = c.recv()
    check(w is not None and w.HasField("welcome"), f"no Welcome: {w}")
    return c, w.welcome.last_seq


def frames_until_ack(c, seq):
    """Frames received until the Ack of seq (inclusive)."""
    out = []
    while True:
        f = c.recv()
        check(f is not None, "connection closed before the Ack")
        out.append(f)
        if f.HasField("ack") and f.ack.seq >= seq:
            return out


def next_advice(c):
    while True:
        f = c.recv()
        check(f is not None, "connection closed before an Advice")
        if f.HasField("advice"):
            return f.advice


def send(pb, c, seq, step, loss):
    c.send(report(pb, seq, step, loss=loss))


def alert_doc(d, alert_id):
    return d.get(f"/api/v1/alerts/{alert_id}")["alert"]


def deliveries(d, alert_id, advice_id):
    for a in alert_doc(d, alert_id)["advice"]:
        if a["id"] == advice_id:
            return a, a["deliveries"]
    raise AssertionError(f"advice {advice_id} not in alert {alert_id}")


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    d = Daemon(args.build_dir, workdir)
    try:
        c, seq = connect(pb, d)
        step = 0
        for loss in [0.5] * 5 + [NAN]:
            seq += 1
            send(pb, c, seq, step, loss)
            step += 1
        adv = next_advice(c)
        print("advice:", adv)
        alerts = d.get(f"/api/v1/alerts?run={RUN}")["alerts"]
        check(len(alerts) == 1, f"alerts: {alerts}")
        a = alerts[0]
        check(adv.alert_id == a["id"] and adv.rule == "loss" and adv.label == "non-finite" and
              adv.severity == "critical", f"advice fields {adv} vs alert {a}")
        check(adv.action == pb.ADVICE_ACTION_CHECKPOINT_AND_STOP, f"action {adv.action}")
        check(adv.step == 5 and adv.fired_step == 5 and adv.first_breach_step == 5 and
              adv.rollback_step == 4, f"steps of {adv}")
        check(adv.rank == 0 and not adv.HasField("layer") and not adv.HasField("window"),
              f"scope of {adv}")
        first_id = adv.advice_id
        row, dl = wait_until(lambda: (lambda r: r if r[1] else None)(
            deliveries(d, a["id"], first_id)), what="the send recorded")
        check(row["action"] == "checkpoint_and_stop" and row["rollback_step"] == 4, f"{row}")
        check(len(dl) == 1 and dl[0]["attempt"] == 0 and dl[0]["rank"] == 0 and
              dl[0]["sends"] == 1 and dl[0]["acked_at"] is None, f"deliveries {dl}")

        # 2. An old client (no capability) on the same run: Welcome, Acks, no Advice.
        old, oseq = connect(pb, d, attempt=7, capable=False)
        send(pb, old, oseq + 1, 0, 0.5)
        got = frames_until_ack(old, oseq + 1)
        check(not any(f.HasField("advice") for f in got), f"old client got {got}")
        old.close()

        # 3. Restart before the ack: the same advice again.
        c.close()
        d.stop()
        d = Daemon(args.build_dir, workdir, ingest_port=d.ingest_port, http_port=d.http_port)
        c, seq = connect(pb, d)
        again = next_advice(c)
        check(again.advice_id == first_id and again == adv, f"redelivered {again} vs {adv}")
        _, dl = wait_until(lambda: (lambda r: r if r[1][0]["sends"] == 2 else None)(
            deliveries(d, a["id"], first_id)), what="the second send recorded")
        check(dl[0]["first_sent_at"] < dl[0]["last_sent_at"], f"send times {dl}")

        # 4. Acknowledged: recorded, and nothing owed after a crash.
        ack = pb.Frame()
        ack.advice_ack.advice_id.append(first_id)
        c.send(ack)
        wait_until(lambda: deliveries(d, a["id"], first_id)[1][0]["acked_at"] is not None,
                   what="the ack recorded")
        c.close()
        d.kill()
        d = Daemon(args.build_dir, workdir, ingest_port=d.ingest_port, http_port=d.http_port)
        c, seq = connect(pb, d)
        seq += 1
        send(pb, c, seq, step, 0.5)
        step += 1
        got = frames_until_ack(c, seq)
        check(not any(f.HasField("advice") for f in got), f"owed after the ack: {got}")

        # 5. Resolve: the stream that had the firing advice is told.
        for loss in [0.5] * 5:
            seq += 1
            send(pb, c, seq, step, loss)
            step += 1
        res = next_advice(c)
        check(res.action == pb.ADVICE_ACTION_RESOLVED and res.alert_id == a["id"] and
              res.advice_id > first_id, f"resolving advice {res}")
        check(alert_doc(d, a["id"])["state"] == "resolved", "alert not resolved")
        ack = pb.Frame()
        ack.advice_ack.advice_id.append(res.advice_id)
        c.send(ack)
        new, nseq = connect(pb, d, attempt=1)
        send(pb, new, nseq + 1, step, 0.5)
        got = frames_until_ack(new, nseq + 1)
        check(not any(f.HasField("advice") for f in got), f"new attempt was owed {got}")
        new.close()
        wait_until(lambda: deliveries(d, a["id"], res.advice_id)[1] and
                   deliveries(d, a["id"], res.advice_id)[1][0]["acked_at"] is not None,
                   what="the resolve's ack recorded")
        c.close()
    finally:
        d.stop()


if __name__ == "__main__":
    run_main(test)
