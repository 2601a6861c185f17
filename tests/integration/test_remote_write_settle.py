"""Remote write sends a step only once it is settled: a rank that lags
holds the cursor back, so its late points are not passed over. Rank 0 of a
2-rank run reports steps 0-9, rank 1 only 0-4 and stays connected; the
cursor stops at step 4 and stays there while the sender polls again and
again. Then rank 1 reports 5-9: Prometheus ends with every step of both
ranks, once.

Runs that end leave the sidecar once they are sent: with a short run
retention and the receiver down, an ended run stays in the database past
its retention; once the receiver is up and has acknowledged the run, the
retention deletes it (and its cursor row)."""
import json
import os
import time
import urllib.parse

from fstest import (Daemon, RawConn, check, db_rows, hello, http_call, kill_started,
                    proto_module, report, run_main, send_losses, wait_until)
from test_remote_write import Engine


def cursor(d):
    rows = db_rows(d.db, "SELECT pos FROM remote_write_cursor WHERE kind = 0")
    return rows[0][0] if rows else -1


def stream(pb, conn, run, rank, steps, seq0=0):
    """Reports steps on an open connection (after its Hello); waits for the last Ack."""
    seq = seq0
    for step in steps:
        seq += 1
        f = report(pb, seq, step, loss=float(100 * rank + step))
        f.report.time_unix = 1.7e9 + step  # one second a step: distinct timestamps
        conn.send(f)
    while True:
        f = conn.recv()
        check(f is not None, f"rank {rank}: closed before the last Ack")
        if f.HasField("ack") and f.ack.seq >= seq:
            return seq


def retention_waits(args, workdir, pb):
    prom = Engine("prometheus", os.path.join(workdir, "ret"))
    os.makedirs(prom.workdir)
    d = None
    try:
        conf = os.path.join(prom.workdir, "foreshockd.conf")
        with open(conf, "w") as f:  # the receiver is not started yet
            f.write(f"[remote_write]\nurl = {prom.write_url}\ntimeout = 2\n")
        d = Daemon(args.build_dir, prom.workdir, config=conf,
                   extra=["--set", "run_idle_end_s=0.5", "--set", "run_retention_s=0.5"])
        send_losses(pb, d.ingest_port, "short", [1.0, 2.0, 3.0])
        wait_until(lambda: db_rows(d.db, "SELECT ended_at FROM runs")[0][0] is not None,
                   what="the run ended")
        time.sleep(3)  # six retentions: the run must outlive them while unsent
        check(db_rows(d.db, "SELECT count(*) FROM runs")[0][0] == 1,
              "an ended run was deleted before the remote store had it")
        prom.start()
        wait_until(lambda: db_rows(d.db, "SELECT count(*) FROM runs")[0][0] == 0, timeout=120,
                   what="the sent run deleted by retention")
        check(db_rows(d.db, "SELECT count(*) FROM remote_write_cursor WHERE kind = 0")[0][0] == 0,
              "the deleted run's cursor row stayed")
        q = urllib.parse.urlencode({"query": 'count_over_time(foreshock_loss{run="short"}[1h])'})
        status, _, body = http_call(f"{prom.base}/api/v1/query?{q}")
        res = json.loads(body)["data"]["result"]
        check(status == 200 and [r["value"][1] for r in res] == ["3"], f"received: {body[:300]!r}")
        print("an ended run stayed past its retention until sent, then was deleted")
        check(d.stop() == 0, "daemon did not stop cleanly")
    finally:
        kill_started(d, prom.proc)


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    prom = Engine("prometheus", workdir)
    d = None
    conns = []
    try:
        prom.start()
        conf = os.path.join(workdir, "foreshockd.conf")
        with open(conf, "w") as f:
            f.write(f"[remote_write]\nurl = {prom.write_url}\n")
        d = Daemon(args.build_dir, workdir, config=conf)
        for rank in (0, 1):
            c = RawConn(pb, d.ingest_port)
            c.send(hello(pb, "lag", rank=rank, world=2))
            w = c.recv()
            check(w is not None and w.HasField("welcome"), f"rank {rank}: {w}")
            conns.append(c)
        stream(pb, conns[0], "lag", 0, range(10))
        seq1 = stream(pb, conns[1], "lag", 1, range(5))
        wait_until(lambda: cursor(d) == 4, timeout=60, what="the cursor at rank 1's step 4")
        time.sleep(3)  # three of the sender's idle polls: it must not pass rank 1
        check(cursor(d) == 4, f"the cursor passed the lagging rank: {cursor(d)}")
        stream(pb, conns[1], "lag", 1, range(5, 10), seq0=seq1)
        wait_until(lambda: cursor(d) == 9, timeout=60, what="the cursor at the end")
        q = urllib.parse.urlencode({"query": 'foreshock_loss{run="lag"}[1h]',
                                    "time": f"{1.7e9 + 60:.0f}"})
        status, _, body = http_call(f"{prom.base}/api/v1/query?{q}")
        check(status == 200, f"query: {status} {body[:200]!r}")
        got = {r["metric"]["rank"]: [float(v) for _, v in r["values"]]
               for r in json.loads(body)["data"]["result"]}
        want = {str(rank): [float(100 * rank + s) for s in range(10)] for rank in (0, 1)}
        check(got == want, f"received {got}, want {want}")
        print("the lagging rank held the cursor at step 4; all 20 points arrived once")
        retention_waits(args, workdir, pb)
        for c in conns:
            c.close()
        check(d.stop() == 0, "daemon did not stop cleanly")
    finally:
        for c in conns:
            c.close()
        kill_started(d, prom.proc)


if __name__ == "__main__":
    run_main(test)
