"""HTTP writes do not hold a server thread while the writer is slow.
Another connection holds the database's write lock, so the writer can commit
nothing; with one HTTP thread, three silence POSTs and one DELETE are handed
to the writer and wait for their commit. Meanwhile /metrics, /healthz,
/api/v1/alerts and /api/v1/silences must be answered while none of the
writes is; once the lock goes, every write is answered as before, only once
durable: 201 with the new silence, 200 with the expired one.

Before, each write waited for the commit on a libmicrohttpd thread, so the
first write alone kept every read waiting until it gave up (503 after 10 s).
No timing decides the verdict: the writes are known to be at the writer
(writer_queue_items counts them until they commit) before the reads are
sent, the reads are answered while the lock is still held, and the writes
are checked unanswered before the lock goes and answered after."""
import json
import sqlite3
import threading

from fstest import Daemon, check, http_call, kill_started, metrics, run_main, wait_until

WRITE = "write-t0ken"
POSTS = 3


def req(d, method, path, body=None, token=None):
    """(status, parsed JSON) of one request, with time for a held write."""
    status, _, text = http_call(d.url(path), method, json_body=body, token=token, timeout=60)
    return status, json.loads(text or b"null")


def silence(i):
    return {"matchers": [{"name": "run", "value": f"held-{i}"}], "duration": "1h",
            "createdBy": "test", "comment": f"held {i}"}


def test(args, workdir):
    d = Daemon(args.build_dir, workdir,
               extra=["--set", "http_threads=1", "--set", f"http_write_token={WRITE}"])
    lock = None
    try:
        status, doc = req(d, "POST", "/api/v1/silences", silence("old"), WRITE)
        check(status == 201, f"create before the hold: {status} {doc}")
        old = doc["silence"]["id"]

        lock = sqlite3.connect(d.db, timeout=30, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        answers = {}  # name -> (status, doc), set when a write is answered
        answered = threading.Lock()

        def write(name, method, path, body):
            got = req(d, method, path, body, WRITE)
            with answered:
                answers[name] = got

        writes = [threading.Thread(target=write, daemon=True,
                                   args=(f"post{i}", "POST", "/api/v1/silences", silence(i)))
                  for i in range(POSTS)]
        writes.append(threading.Thread(target=write, daemon=True,
                                       args=("delete", "DELETE", f"/api/v1/silences/{old}",
                                             None)))
        for t in writes:
            t.start()

        n = len(writes)
        m = wait_until(lambda: (lambda x: x if x["foreshock_writer_queue_items"] >= n else None)(
            metrics(d)), timeout=120, what=f"{n} writes to reach the writer")
        with answered:
            early = dict(answers)
        check(not early, f"writes answered while the writer could commit nothing: {early}")

        status, doc = req(d, "GET", "/healthz")
        check(status == 200 and doc == {"status": "ok"}, f"/healthz: {status} {doc}")
        status, doc = req(d, "GET", "/api/v1/alerts")
        check(status == 200 and doc["alerts"] == [], f"/api/v1/alerts: {status} {doc}")
        status, doc = req(d, "GET", "/api/v1/silences")
        check(status == 200 and [s["id"] for s in doc["silences"]] == [old],
              f"/api/v1/silences under the lock: {status} {doc}")
        with answered:
            early = dict(answers)
        check(not early, f"writes answered before the lock went: {early}")
        print(f"{n} writes held by the writer ({m['foreshock_writer_queue_items']:.0f} items "
              f"queued, one HTTP thread); /metrics, /healthz, /api/v1/alerts and "
              f"/api/v1/silences answered meanwhile")

        lock.execute("ROLLBACK")
        lock.close()
        lock = None
        for t in writes:
            t.join(timeout=120)
            check(not t.is_alive(), "a write was not answered after the lock went")
        ids = set()
        for i in range(POSTS):
            status, doc = answers[f"post{i}"]
            check(status == 201, f"POST {i}: {status} {doc}")
            check(doc["silence"]["comment"] == f"held {i}", f"POST {i}: {doc}")
            ids.add(doc["silence"]["id"])
        check(len(ids) == POSTS and old not in ids, f"silence ids: {ids}, old {old}")
        status, doc = answers["delete"]
        check(status == 200 and doc["silence"]["id"] == old and
              doc["silence"]["status"]["state"] == "expired", f"DELETE: {status} {doc}")

        status, doc = req(d, "GET", "/api/v1/silences?state=active")
        check(status == 200 and {s["id"] for s in doc["silences"]} == ids,
              f"active silences after the commit: {doc}")
        check(d.stop() == 0, "daemon did not exit 0")
    finally:
        if lock is not None:
            lock.close()
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
