"""The pager's outbox: a page survives a crash while its target is down.

1. A webhook target (HMAC secret) answers 503: the trigger of a fired alert
   is retried with backoff (attempts and last_error in the outbox table),
   the daemon is SIGKILLed while the page is pending, the receiver starts
   accepting, the daemon restarts on the same database: the page is
   delivered (outbox state 1) and its X-Foreshock-Signature verifies with
   Python's hmac over the body; the resolve follows.
2. Silences, created and expired through the HTTP API (POST
   /api/v1/silences, the per-run maintenance silence, DELETE): a matching
   trigger is held (outbox state 3, nothing sent, the alert is stored and
   lists the silence in silenced_by, /metrics counts it); expiring the
   silence while the alert still fires sends it; an alert that resolves
   while silenced sends nothing at all (both rows state 4); the pager
   compiles each silence once, however often it re-reads them.
Alerts come from the non-finite loss rule: a NaN loss fires at once, five
normal samples resolve it."""
import hashlib
import hmac
import json
import os
import re
import time

from fstest import (Daemon, Receiver, check, db_rows, kill_started, proto_module, run_main,
                    send_losses, wait_until)

SECRET = "s3cr3t-key"
TOKEN = "write-token-for-tests"
NAN = float("nan")
NORMAL = [0.5] * 5
RESOLVE = [0.5] * 8

CONFIG = """
http_write_token = {token}

[target "hook"]
type = webhook
url = {url}/hook
secret = {secret}
backoff_initial = 0.2
backoff_max = 0.5
timeout = 5
connect_timeout = 2
"""


def outbox(db, run):
    return db_rows(db, "SELECT o.id, o.kind, o.state, o.attempts, o.last_status, o.last_error "
                       "FROM outbox o JOIN alerts a ON a.id = o.alert_id JOIN runs r "
                       "ON r.id = a.run_id WHERE r.name = ? ORDER BY o.id", (run,))


def of_run(reqs, run, status=None):
    return [r for r in reqs if r["json"] and r["json"]["alert"]["run"] == run
            and (status is None or r["json"]["status"] == status)]


def urllib_get(url):
    import urllib.request
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def verify_signature(req):
    h = {k.lower(): v for k, v in req["headers"].items()}
    sig = h.get("x-foreshock-signature", "")
    want = "sha256=" + hmac.new(SECRET.encode(), req["body"], hashlib.sha256).hexdigest()
    check(hmac.compare_digest(sig, want), f"bad signature {sig!r}, want {want!r}")
    check(h.get("x-foreshock-timestamp", "").isdigit(), f"no timestamp header: {h}")


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    accepting = {"on": False}
    daemons = []
    with Receiver(lambda req: 200 if accepting["on"] else 503) as rx:
        conf = os.path.join(workdir, "foreshockd.conf")
        with open(conf, "w") as f:
            f.write(CONFIG.format(url=rx.url, secret=SECRET, token=TOKEN))
        try:
            d = Daemon(args.build_dir, workdir, config=conf)
            daemons.append(d)
            # --- 1. crash while pending --------------------------------------------
            step = send_losses(pb, d.ingest_port, "crash", NORMAL + [NAN])
            rx.wait_for(lambda rs: len(of_run(rs, "crash")) >= 2, what="two 503 attempts")
            rows = wait_until(lambda: [r for r in outbox(d.db, "crash") if r[3] >= 1],
                              what="a retry recorded in the outbox")
            check(rows[0][1] == 1 and rows[0][2] == 0 and rows[0][4] == 503
                  and "503" in (rows[0][5] or ""), f"pending trigger row: {rows}")
            ingest, http, db = d.ingest_port, d.http_port, d.db
            d.kill()
            accepting["on"] = True
            n_before = len(rx.snapshot())
            d = Daemon(args.build_dir, workdir, ingest_port=ingest, http_port=http, db=db,
                       config=conf)
            daemons.append(d)
            reqs = rx.wait_for(lambda rs: any(r["status"] == 200 for r in of_run(rs, "crash")),
                               what="the trigger delivered after the restart")
            ok = [r for r in of_run(reqs, "crash") if r["status"] == 200]
            check(len(ok) == 1, f"{len(ok)} accepted triggers")
            t = ok[0]
            verify_signature(t)
            doc = t["json"]
            check(doc["version"] == "1" and doc["status"] == "firing", f"webhook doc {doc}")
            al = doc["alert"]
            check(al["rule"] == "loss" and al["attribution"] == "non-finite"
                  and al["state"] == "firing" and al["dedup_key"].startswith("fs-"), f"alert {al}")
            check(doc["labels"]["alertname"] == "loss" and doc["labels"]["run"] == "crash"
                  and doc["labels"]["signature"] == "non-finite", f"labels {doc['labels']}")
            check(doc["url"] == f"http://127.0.0.1:{http}/api/v1/alerts/{al['id']}",
                  f"url {doc['url']}")
            # The page links to the alert the HTTP API serves.
            check(d.get(f"/api/v1/alerts/{al['id']}")["alert"]["dedup_key"] == al["dedup_key"],
                  "url does not name the alert")
            wait_until(lambda: outbox(db, "crash")[0][2] == 1, what="outbox row delivered")
            check(len(rx.snapshot()) > n_before, "nothing sent after the restart")
            # resolve
            send_losses(pb, d.ingest_port, "crash", RESOLVE, first_step=step)
            reqs = rx.wait_for(lambda rs: of_run(rs, "crash", "resolved"), what="the resolve")
            res = of_run(reqs, "crash", "resolved")
            check(len(res) == 1 and res[0]["status"] == 200, f"resolves {len(res)}")
            verify_signature(res[0])
            check(res[0]["json"]["alert"]["dedup_key"] == al["dedup_key"], "dedup_key changed")
            wait_until(lambda: [r[2] for r in outbox(db, "crash")] == [1, 1],
                       what="both rows delivered")

            # --- 2. silences ---------------------------------------------------------
            quiet = d.request("POST", "/api/v1/silences", token=TOKEN, expect=201, body={
                "matchers": [{"name": "run", "value": "quiet"},
                             {"name": "signature", "value": "non-.*", "isRegex": True}],
                "duration": "1h", "createdBy": "test", "comment": "held"})["silence"]
            brief = d.request("POST", "/api/v1/runs/brief/maintenance", token=TOKEN,
                              expect=201, body={"duration": "1h", "createdBy": "test",
                                                "comment": "planned restart"})["silence"]
            check(quiet["status"]["state"] == "active" and brief["status"]["state"] == "active",
                  f"silences not active: {quiet} {brief}")
            # Committed before the alerts fire: the pager reads silences
            # afresh before a trigger, so they hold these.
            step_q = send_losses(pb, d.ingest_port, "quiet", NORMAL + [NAN])
            step_b = send_losses(pb, d.ingest_port, "brief", NORMAL + [NAN])
            wait_until(lambda: [r[2] for r in outbox(db, "quiet")] == [3]
                       and [r[2] for r in outbox(db, "brief")] == [3], what="held triggers")
            check(not of_run(rx.snapshot(), "quiet") and not of_run(rx.snapshot(), "brief"),
                  "a silenced trigger was sent")
            # "brief" resolves while silenced: nothing of it is ever sent.
            send_losses(pb, d.ingest_port, "brief", RESOLVE, first_step=step_b)
            wait_until(lambda: [r[2] for r in outbox(db, "brief")] == [4, 4],
                       what="brief's rows skipped")
            # Stored, not paged: the alert is there and names its silence.
            al = d.get("/api/v1/alerts?run=quiet")["alerts"]
            check(len(al) == 1 and al[0]["state"] == "firing"
                  and al[0]["silenced_by"] == [quiet["id"]], f"quiet's alert: {al}")
            m = re.search(r'^foreshock_pages_silenced_total\{[^}]*target="hook"[^}]*\} (\d+)',
                          urllib_get(d.url("/metrics")), re.M)
            check(m is not None and int(m.group(1)) >= 2, f"pages_silenced_total: {m}")
            # Expire "quiet"'s silence while it still fires: its trigger goes out.
            d.request("DELETE", f"/api/v1/silences/{quiet['id']}", token=TOKEN)
            reqs = rx.wait_for(lambda rs: of_run(rs, "quiet", "firing"),
                               what="the trigger after the silence expired")
            verify_signature(of_run(reqs, "quiet", "firing")[0])
            wait_until(lambda: [r[2] for r in outbox(db, "quiet")] == [1],
                       what="quiet delivered")
            check(not of_run(rx.snapshot(), "brief"), "brief was paged")
            send_losses(pb, d.ingest_port, "quiet", RESOLVE, first_step=step_q)
            rx.wait_for(lambda rs: of_run(rs, "quiet", "resolved"), what="quiet resolved")
            # The pager read the silences before the held triggers and again
            # (its periodic re-read) before sending quiet's: each of the two
            # was compiled once all the same.
            m = re.search(r'^foreshock_silence_compiles_total\{by="pager"\} (\d+)',
                          urllib_get(d.url("/metrics")), re.M)
            check(m is not None and int(m.group(1)) == 2, f"pager silence compiles: {m}")
            check(d.stop() == 0, "daemon did not stop cleanly")
            log = d.log_text()
            check("silenced; held until the silence ends" in log, "no silence log line")
        finally:
            kill_started(*daemons)


if __name__ == "__main__":
    run_main(test)
