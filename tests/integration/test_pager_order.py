"""Pager ordering and shutdown, against receivers run by this test.

1. No Alertmanager re-send after the resolve is queued: the target answers
   503 while the alert fires and resolves, so both rows wait in the outbox;
   then it accepts firing alerts but still refuses resolves. Once the
   trigger is delivered, every later request is the resolve (retried): not
   one re-send says the alert fires again (resend_interval is 0.2 s, so
   the old pager sent several between the resolve's retries).
2. SIGTERM while a request hangs (target timeout 120 s): the daemon stops
   within seconds, and the row stays undone with no failed attempt
   counted, for the next start."""
import datetime
import os
import threading

from fstest import (Daemon, Receiver, check, db_rows, kill_started, proto_module, run_main,
                    send_losses, wait_until)

NAN = float("nan")

AM_CONFIG = """
[target "am"]
type = alertmanager
url = {url}
resend_interval = 0.2
backoff_initial = 0.2
backoff_max = 0.5
"""

HOOK_CONFIG = """
[target "hook"]
type = webhook
url = {url}/hook
timeout = 120
connect_timeout = 5
"""


def firing(req):
    """An Alertmanager POST whose endsAt lies ahead of its arrival."""
    ends = req["json"][0]["endsAt"].replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(ends).timestamp() > req["time"]


def outbox(db, run):
    return db_rows(db, "SELECT o.kind, o.state, o.attempts FROM outbox o JOIN alerts a "
                       "ON a.id = o.alert_id JOIN runs r ON r.id = a.run_id WHERE r.name = ? "
                       "ORDER BY o.id", (run,))


def no_resend_after_resolve(args, workdir, pb):
    mode = {"m": "down"}

    def respond(req):
        if mode["m"] == "down":
            return 503
        if mode["m"] == "triggers":
            return 200 if firing(req) else 503
        return 200

    with Receiver(respond) as rx:
        conf = os.path.join(workdir, "am.conf")
        with open(conf, "w") as f:
            f.write(AM_CONFIG.format(url=rx.url))
        d = Daemon(args.build_dir, workdir, db=os.path.join(workdir, "am.db"), config=conf)
        try:
            step = send_losses(pb, d.ingest_port, "flap", [0.5] * 5 + [NAN])
            rx.wait_for(lambda rs: len(rs) >= 1, what="a refused trigger")
            send_losses(pb, d.ingest_port, "flap", [0.5] * 8, first_step=step)
            wait_until(lambda: [r[0] for r in outbox(d.db, "flap")] == [1, 2],
                       what="trigger and resolve rows")
            mode["m"] = "triggers"
            reqs = rx.wait_for(lambda rs: any(r["status"] == 200 for r in rs),
                               what="the trigger accepted")
            n = next(i for i, r in enumerate(reqs) if r["status"] == 200)
            check(firing(reqs[n]), "the accepted request is not the trigger")
            reqs = rx.wait_for(lambda rs: len(rs) >= n + 4, what="the resolve retried")
            after = reqs[n + 1:]
            check(not any(firing(r) for r in after),
                  f"{sum(firing(r) for r in after)} firing re-sends after the resolve was "
                  f"queued (of {len(after)} requests)")
            mode["m"] = "up"
            wait_until(lambda: [r[1] for r in outbox(d.db, "flap")] == [1, 1],
                       what="both rows delivered")
            check(d.stop() == 0, "daemon did not stop cleanly")
        finally:
            kill_started(d)


def stop_while_in_flight(args, workdir, pb):
    inflight, release = threading.Event(), threading.Event()

    def respond(req):
        inflight.set()
        release.wait(60)
        return 200

    with Receiver(respond) as rx:
        conf = os.path.join(workdir, "hook.conf")
        with open(conf, "w") as f:
            f.write(HOOK_CONFIG.format(url=rx.url))
        d = Daemon(args.build_dir, workdir, db=os.path.join(workdir, "hook.db"), config=conf)
        try:
            send_losses(pb, d.ingest_port, "hang", [0.5] * 5 + [NAN])
            check(inflight.wait(60), "no request reached the receiver")
            check(d.stop(timeout=20) == 0, "daemon did not stop cleanly")
            rows = outbox(d.db, "hang")
            check(rows == [(1, 0, 0)], f"the abandoned page must stay pending, unfailed: {rows}")
        finally:
            release.set()
            kill_started(d)


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    no_resend_after_resolve(args, workdir, pb)
    stop_while_in_flight(args, workdir, pb)


if __name__ == "__main__":
    run_main(test)
