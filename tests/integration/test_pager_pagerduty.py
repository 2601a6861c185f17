"""PagerDuty Events API v2 against a local receiver playing PagerDuty: it
checks routing_key, event_action, dedup_key and the payload fields, answers
429 to the first request and 202 afterwards. The daemon is restarted
(SIGTERM, same database) between the trigger and the resolve. Per incident
the receiver accepts exactly one trigger and one resolve, with the same
dedup_key; a second incident of the same alert reuses that dedup_key.
Also: a target whose `match` filter names other runs never sees these pages,
and a bad target section stops the daemon at startup with status 2."""
import os
import subprocess

from fstest import (Daemon, Receiver, check, db_rows, kill_started, proto_module, run_main,
                    send_losses, wait_until)

NAN = float("nan")
KEY = "R0UT1NGKEY0123456789abcdef012345"

CONFIG = """
[target "pd"]
type = pagerduty
url = {url}/v2/enqueue
routing_key = {key}
backoff_initial = 0.2
backoff_max = 1

[target "pd-other"]
type = pagerduty
url = {url}/other/v2/enqueue
routing_key = other
min_severity = critical
match = run=~other-.*,alertname=loss
"""


def check_event(doc):
    """Field-by-field check of one Events API v2 document; returns its action."""
    check(doc["routing_key"] == KEY, f"routing_key {doc.get('routing_key')}")
    action = doc["event_action"]
    check(action in ("trigger", "resolve"), f"event_action {action}")
    check(doc["dedup_key"].startswith("fs-") and len(doc["dedup_key"]) == 19,
          f"dedup_key {doc['dedup_key']}")
    if action == "trigger":
        p = doc["payload"]
        check(p["severity"] in ("critical", "warning", "error", "info"), f"severity {p}")
        check(p["source"] == "pd-run" and p["component"] == "loss rank 0"
              and p["group"] == "scalar_loss" and p["class"] == "non-finite", f"payload {p}")
        check("loss firing" in p["summary"] and "pd-run" in p["summary"], f"summary {p['summary']}")
        cd = p["custom_details"]
        check(cd["rule"] == "loss" and cd["fired_step"] is not None and cd["labels"]["rank"] == "0",
              f"custom_details {cd}")
        check(doc["links"][0]["href"].endswith("/api/v1/alerts/%d" % doc_alert_id(doc)),
              f"links {doc['links']}")
    return action


def doc_alert_id(doc):
    return int(doc["links"][0]["href"].rsplit("/", 1)[1])


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    seen = {"n": 0}

    def respond(req):
        if not req["path"].startswith("/v2/enqueue"):
            return 202
        seen["n"] += 1
        return 429 if seen["n"] == 1 else 202

    daemons = []
    with Receiver(respond) as rx:
        # A bad target section is a startup error naming it.
        bad = os.path.join(workdir, "bad.conf")
        with open(bad, "w") as f:
            f.write('[target "x"]\ntype = pagerduty\nurl = http://127.0.0.1:1/\n')
        p = subprocess.run([os.path.join(args.build_dir, "foreshockd"), "--config", bad,
                            "--db", os.path.join(workdir, "bad.db")],
                           capture_output=True, text=True, timeout=60)
        check(p.returncode == 2 and "routing_key" in p.stderr and '"x"' in p.stderr,
              f"bad target: exit {p.returncode}: {p.stderr}")

        conf = os.path.join(workdir, "foreshockd.conf")
        with open(conf, "w") as f:
            f.write(CONFIG.format(url=rx.url, key=KEY))
        try:
            d = Daemon(args.build_dir, workdir, config=conf)
            daemons.append(d)
            step = send_losses(pb, d.ingest_port, "pd-run", [0.5] * 5 + [NAN])
            reqs = rx.wait_for(lambda rs: any(r["status"] == 202 for r in rs),
                               what="an accepted trigger")
            check(reqs[0]["status"] == 429, "first request not answered 429")
            for r in reqs:
                check(r["path"] == "/v2/enqueue", f"request to {r['path']}")
                check(check_event(r["json"]) == "trigger", "resolve before its trigger")
            # SIGTERM between the trigger and the resolve, same database.
            ingest, http, db = d.ingest_port, d.http_port, d.db
            check(d.stop() == 0, "daemon did not stop cleanly")
            d = Daemon(args.build_dir, workdir, ingest_port=ingest, http_port=http, db=db,
                       config=conf)
            daemons.append(d)
            step = send_losses(pb, d.ingest_port, "pd-run", [0.5] * 8, first_step=step)
            rx.wait_for(lambda rs: any(r["json"]["event_action"] == "resolve" and r["status"] == 202
                                       for r in rs), what="an accepted resolve")
            # A second incident of the same alert: same dedup_key.
            step = send_losses(pb, d.ingest_port, "pd-run", [NAN] + [0.5] * 8, first_step=step)
            reqs = rx.wait_for(lambda rs: sum(r["json"]["event_action"] == "resolve"
                                              and r["status"] == 202 for r in rs) == 2,
                               what="the second incident's resolve")
            # Rows the pager has not reached by the stop would wait for the
            # next start: let every outcome commit first.
            wait_until(lambda: db_rows(d.db, "SELECT count(*) FROM outbox WHERE state IN (0, 3)")
                       == [(0,)], what="every outbox row done")
            check(d.stop() == 0, "daemon did not stop cleanly")
            pd = [r for r in reqs if r["path"] == "/v2/enqueue"]
            accepted = [(r["json"]["event_action"], r["json"]["dedup_key"]) for r in pd
                        if r["status"] == 202]
            for r in pd:
                check_event(r["json"])
            keys = {k for _, k in accepted}
            check(len(keys) == 1, f"dedup keys {keys}")
            check([a for a, _ in accepted] == ["trigger", "resolve", "trigger", "resolve"],
                  f"accepted events {accepted}")
            check(not [r for r in reqs if r["path"].startswith("/other")],
                  "a page reached the target whose match excludes it")
            rows = db_rows(db, "SELECT target, kind, state, attempts FROM outbox ORDER BY id")
            check([r for r in rows if r[0] == "pd"] ==
                  [("pd", 1, 1, 1), ("pd", 2, 1, 0), ("pd", 1, 1, 0), ("pd", 2, 1, 0)],
                  f"outbox rows {rows}")
            check([r[2] for r in rows if r[0] == "pd-other"] == [4, 4, 4, 4],
                  f"pd-other rows not skipped: {rows}")
        finally:
            kill_started(*daemons)


if __name__ == "__main__":
    run_main(test)
