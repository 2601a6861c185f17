"""The pager's memory bound never starves a target, and retry times from
the table are bounded (a database written beside the daemon, then a start).

The outbox holds 1100 undone rows for a target that answers 503 (more than
the pager keeps in memory, PAGER_MAX_ROWS = 1024), then rows for a target
that works: one due now, one whose stored retry time is a day ahead (what a
wall clock stepped back leaves behind), and one for a target that is no
longer configured. The working target gets both its pages within seconds
(each target has its own share of memory, and no retry waits longer than
backoff_max), and the row of the removed target is given up.

Then a target that hangs (timeout 1 s) with ten due pages, beside a
working one: the hanging target costs one timeout per pass, not one per
page (its other due rows wait for the failed row's retry), so the working
target's page goes out after at most two hanging requests, not ten."""
import os
import shutil
import sqlite3
import threading
import time

from fstest import (Daemon, Receiver, check, db_rows, kill_started, proto_module, run_main,
                    send_losses, wait_until)

NAN = float("nan")
DEAD_ROWS = 1100
RUNS = 10

CONFIG = """
[target "dead"]
type = webhook
url = {url}/dead
backoff_initial = 3600
backoff_max = 3600

[target "live"]
type = webhook
url = {url}/live
backoff_initial = 0.2
backoff_max = 1
"""


HANG_CONFIG = """
[target "hang"]
type = webhook
url = {url}/hang
timeout = 1
connect_timeout = 1
backoff_initial = 3600
backoff_max = 3600

[target "live"]
type = webhook
url = {url}/live
"""

INSERT = ("INSERT INTO outbox (alert_id, event_id, target, kind, severity, attribution, "
          "created_at, updated_at, attempts, next_attempt_at) "
          "VALUES (?, ?, ?, 1, 'critical', 'non-finite', ?, ?, ?, ?)")


def firing_alerts(args, workdir, pb):
    """RUNS firing alerts, stored by a daemon without targets (no outbox
    rows). Returns the database path and [(alert id, to_firing event id)]."""
    d = Daemon(args.build_dir, workdir, db=os.path.join(workdir, "base.db"))
    try:
        for i in range(RUNS):
            send_losses(pb, d.ingest_port, f"r{i}", [0.5] * 5 + [NAN])
        alerts = wait_until(lambda: (lambda rows: rows if len(rows) == RUNS else None)(db_rows(
            d.db, "SELECT a.id, e.id FROM alerts a JOIN alert_events e ON e.alert_id = a.id "
                  "AND e.change = 'to_firing' ORDER BY a.id")), what="the firing alerts")
        check(d.stop() == 0, "first daemon did not stop cleanly")
    finally:
        kill_started(d)
    check(db_rows(d.db, "SELECT count(*) FROM outbox")[0][0] == 0, "outbox not empty")
    return d.db, [tuple(a) for a in alerts]


def copy_db(src, dst):
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(src + suffix):
            shutil.copy(src + suffix, dst + suffix)
    return dst


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    base, alerts = firing_alerts(args, workdir, pb)
    starvation(args, workdir, copy_db(base, os.path.join(workdir, "a.db")), alerts)
    hanging(args, workdir, copy_db(base, os.path.join(workdir, "b.db")), alerts)


def starvation(args, workdir, db, alerts):
    now = time.time()
    con = sqlite3.connect(db, timeout=30)
    with con:
        ins = INSERT
        for i in range(DEAD_ROWS):
            a = alerts[i % 2]
            con.execute(ins, (a[0], a[1], "dead", now, now, 0, None))
        con.execute(ins, (alerts[0][0], alerts[0][1], "live", now, now, 0, None))
        con.execute(ins, (alerts[1][0], alerts[1][1], "live", now, now, 1, now + 86400))
        con.execute(ins, (alerts[0][0], alerts[0][1], "gone", now, now, 0, None))
    con.close()
    ids = {t: [r[0] for r in db_rows(db, "SELECT id FROM outbox WHERE target = ? ORDER BY id",
                                     (t,))] for t in ("dead", "live", "gone")}
    check(min(ids["live"]) > 1024, f"live rows must lie past the memory bound: {ids['live']}")

    with Receiver(lambda req: 200 if req["path"] == "/live" else 503) as rx:
        conf = os.path.join(workdir, "foreshockd.conf")
        with open(conf, "w") as f:
            f.write(CONFIG.format(url=rx.url))
        d = Daemon(args.build_dir, workdir, db=db, config=conf)
        try:
            reqs = rx.wait_for(lambda rs: {r["json"]["alert"]["run"] for r in rs
                                           if r["path"] == "/live"} == {"r0", "r1"},
                               timeout=30, what="both pages at the working target")
            check(any(r["path"] == "/dead" for r in reqs), "the dead target was never tried")
            state = dict(wait_until(lambda: (lambda rows: rows if all(
                s != 0 for _, s in rows) else None)(db_rows(
                    d.db, "SELECT id, state FROM outbox WHERE target IN ('live', 'gone')")),
                timeout=30, what="live and gone rows done"))
            check(all(state[i] == 1 for i in ids["live"]), f"live rows {state}")
            gone = db_rows(d.db, "SELECT state, last_error FROM outbox WHERE target = 'gone'")
            check(gone == [(2, "target no longer configured")], f"gone row {gone}")
            check(d.stop() == 0, "daemon did not stop cleanly")
        finally:
            kill_started(d)



def hanging(args, workdir, db, alerts):
    now = time.time()
    con = sqlite3.connect(db, timeout=30)
    with con:
        for a in alerts:
            con.execute(INSERT, (a[0], a[1], "hang", now, now, 0, None))
        con.execute(INSERT, (alerts[0][0], alerts[0][1], "live", now, now, 0, None))
    con.close()
    lock, started, release = threading.Lock(), {"n": 0, "at_live": None}, threading.Event()

    def respond(req):
        if req["path"] == "/live":
            with lock:
                started["at_live"] = started["n"]
            return 200
        with lock:
            started["n"] += 1
        release.wait(30)
        return 200

    with Receiver(respond) as rx:
        conf = os.path.join(workdir, "hang.conf")
        with open(conf, "w") as f:
            f.write(HANG_CONFIG.format(url=rx.url))
        d = Daemon(args.build_dir, workdir, db=db, config=conf)
        try:
            rx.wait_for(lambda rs: any(r["path"] == "/live" for r in rs), timeout=60,
                        what="the working target's page")
            with lock:
                n = started["at_live"]
            check(n is not None and n <= 2,
                  f"{n} requests to the hanging target started before the working one's page")
            check(d.stop() == 0, "daemon did not stop cleanly")
        finally:
            release.set()
            kill_started(d)


if __name__ == "__main__":
    run_main(test)
