"""Spool damage is reported, never silent (issue 22, items 6 and 7).

Rank 0 of a two-rank run sends FRAMES reports with router token statistics:
they are acknowledged and wait in the spool log for rank 1, which never
comes (reduce_timeout_s is an hour), so every frame is an acknowledged frame
of a step not yet evaluated. Then, one case each:

- intact: SIGKILL and restart; every frame re-fed, /readyz "ready" (the
  control: the checks below can pass);
- a flipped body byte, a corrupted header: SIGKILL, damage one record,
  restart; that frame is reported lost (damaged), the others are re-fed (a
  bad header no longer ends the segment);
- a segment deleted after SIGKILL: every frame reported missing;
- the spool directory deleted under the running daemon: the next commit
  stops, nothing more is acknowledged, /readyz 503 names the spool, a new
  Hello is refused saying why, one log line, SIGTERM gives the unwritable
  report up at once (even with shutdown_timeout_s = 0); after a restart the
  loss is reported and new reports are acknowledged again.

Reported means: an ERROR log line with the counts,
foreshock_spool_lost_frames_total{why=...}, and /readyz 200 with status
"degraded" and the counts."""
import json
import os
import re
import shutil

from fstest import (Daemon, RawConn, check, db_rows, hello, http_call, kill_started, metrics,
                    proto_module, report, run_main, wait_until)

RUN = "spool-damage"
FRAMES = 10
DAMAGED = 3  # the seq whose record a damage case hits


def tokens_report(pb, seq):
    f = report(pb, seq, seq - 1)
    t = f.report.router_tokens.add()
    t.layer, t.n_experts, t.n_tok = 0, 4, 100
    t.sum_h, t.sum_h2, t.sum_lse2 = 1.0, 2.0, 3.0
    t.load.extend([25, 25, 25, 25])
    t.sum_p.extend([25.0, 25.0, 25.0, 25.0])
    return f


def send_frames(pb, d, first, last, rank=0):
    """Reports first..last from `rank` on one connection, until the last Ack."""
    c = RawConn(pb, d.ingest_port)
    try:
        c.send(hello(pb, RUN, rank=rank, world=2))
        w = c.recv()
        check(w is not None and w.HasField("welcome"), f"no Welcome: {w}")
        for seq in range(first, last + 1):
            c.send(tokens_report(pb, seq))
        while True:
            f = c.recv()
            check(f is not None and not f.HasField("error"), f"no Ack: {f}")
            if f.HasField("ack") and f.ack.seq >= last:
                return
    finally:
        c.close()


def readyz(d):
    status, _, body = http_call(d.url("/readyz"))
    return status, json.loads(body)


def start(args, workdir, conf, **kw):
    return Daemon(args.build_dir, workdir, config=conf, **kw)


def refed(d):
    m = re.search(r"re-fed (\d+) spooled reports", d.log_text())
    return int(m.group(1)) if m else 0


def expect_reported(d, missing, damaged):
    """The restart reported `missing` + `damaged` lost frames everywhere it should."""
    m = metrics(d)
    got = (m.get('foreshock_spool_lost_frames_total{why="missing"}'),
           m.get('foreshock_spool_lost_frames_total{why="damaged"}'))
    check(got == (missing, damaged), f"lost frames metric (missing, damaged) {got}, "
          f"expected {(missing, damaged)}")
    line = (rf"error stage: spool \S+: {missing + damaged} of {FRAMES} acknowledged frames of "
            rf"steps not yet evaluated are lost \({missing} missing, {damaged} damaged\)")
    check(re.search(line, d.log_text()), f"no ERROR line /{line}/ in:\n{d.log_text()[-3000:]}")
    status, doc = readyz(d)
    check(status == 200 and doc.get("status") == "degraded" and
          doc["spool"]["lost_missing"] == missing and doc["spool"]["lost_damaged"] == damaged,
          f"/readyz {status} {doc}")


def record_of(db, seq):
    (seg, off), = db_rows(db, "SELECT segment, byte_offset FROM spool_frames WHERE seq = ?", (seq,))
    return os.path.join(db + ".spool", f"{seg:016x}.seg"), off


def flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


def case_after_kill(args, pb, root, name, damage):
    """FRAMES acked, SIGKILL, damage(db), restart: returns the restarted daemon."""
    workdir = os.path.join(root, name)
    os.mkdir(workdir)
    conf = os.path.join(workdir, "foreshockd.conf")
    with open(conf, "w") as f:
        f.write("reduce_timeout_s = 3600\n")
    d = start(args, workdir, conf)
    restarted = None
    try:
        send_frames(pb, d, 1, FRAMES)
        rows = db_rows(d.db, "SELECT count(*) FROM spool_frames")[0][0]
        check(rows == FRAMES, f"{rows} spool_frames rows for {FRAMES} acked frames")
        d.kill()
        damage(d.db)
        restarted = start(args, workdir, conf, db=d.db)
        return restarted
    except BaseException:
        kill_started(d, restarted)
        raise


def test(args, root):
    pb = proto_module(args.source_dir, root)

    # The control: nothing damaged, nothing reported.
    d = case_after_kill(args, pb, root, "intact", lambda db: None)
    try:
        check(refed(d) == FRAMES, f"re-fed {refed(d)} of {FRAMES}")
        status, doc = readyz(d)
        check(status == 200 and doc == {"status": "ready"}, f"/readyz {status} {doc}")
        m = metrics(d)
        check(m['foreshock_spool_lost_frames_total{why="damaged"}'] == 0 and
              m['foreshock_spool_lost_frames_total{why="missing"}'] == 0 and
              m["foreshock_spool_damaged_records_total"] == 0, "losses reported for nothing")
        check(d.stop() == 0, "daemon did not stop cleanly")
    finally:
        kill_started(d)

    # One flipped bit in a body: that frame is lost, the others re-fed.
    def body(db):
        path, off = record_of(db, DAMAGED)
        flip(path, off + 56 + 20)
    d = case_after_kill(args, pb, root, "body", body)
    try:
        check(refed(d) == FRAMES - 1, f"re-fed {refed(d)}, expected {FRAMES - 1}")
        expect_reported(d, 0, 1)
        check(metrics(d)["foreshock_spool_damaged_records_total"] == 1, "damaged records")
    finally:
        kill_started(d)

    # A corrupted header: passed over to the next record, not the end of the segment.
    def header(db):
        path, off = record_of(db, DAMAGED)
        flip(path, off + 20)
    d = case_after_kill(args, pb, root, "header", header)
    try:
        check(refed(d) == FRAMES - 1,
              f"re-fed {refed(d)}, expected {FRAMES - 1}: the records after a bad header")
        expect_reported(d, 0, 1)
        m = metrics(d)
        (nxt,), = db_rows(d.db, "SELECT byte_offset FROM spool_frames WHERE seq = ?",
                          (DAMAGED + 1,))
        _, off = record_of(d.db, DAMAGED)
        check(m["foreshock_spool_damaged_records_total"] == 1 and
              m["foreshock_spool_skipped_bytes_total"] == nxt - off,
              f"damaged records / skipped bytes: {m['foreshock_spool_damaged_records_total']} "
              f"{m['foreshock_spool_skipped_bytes_total']}, expected 1 {nxt - off}")
    finally:
        kill_started(d)

    # A segment deleted after SIGKILL.
    def segment(db):
        path, _ = record_of(db, 1)
        os.unlink(path)
    d = case_after_kill(args, pb, root, "segment", segment)
    try:
        check(refed(d) == 0, f"re-fed {refed(d)} from a deleted segment")
        expect_reported(d, FRAMES, 0)
    finally:
        kill_started(d)

    # The spool directory deleted under the running daemon. shutdown_timeout_s
    # = 0 (finish every commit, however long): a commit that can never
    # succeed must not hold the stop.
    workdir = os.path.join(root, "running")
    os.mkdir(workdir)
    conf = os.path.join(workdir, "foreshockd.conf")
    with open(conf, "w") as f:
        f.write("reduce_timeout_s = 3600\nshutdown_timeout_s = 0\n")
    d = start(args, workdir, conf)
    restarted = None
    c = None
    try:
        send_frames(pb, d, 1, FRAMES)
        status, doc = readyz(d)
        check(status == 200 and doc == {"status": "ready"}, f"/readyz before: {status} {doc}")
        c = RawConn(pb, d.ingest_port)  # a trainer connected before
        c.send(hello(pb, RUN, rank=0, world=2))
        w = c.recv()
        check(w is not None and w.HasField("welcome") and w.welcome.last_seq == FRAMES,
              f"Welcome: {w}")
        shutil.rmtree(d.db + ".spool")
        c.send(tokens_report(pb, FRAMES + 1))
        wait_until(lambda: readyz(d)[0] == 503, timeout=60, what="/readyz 503")
        status, doc = readyz(d)
        msg = doc.get("error", {}).get("message", "")
        check("spool" in msg and "dir_removed" in msg,
              f"/readyz 503 without the reason: {doc}")
        m = metrics(d)
        check(m['foreshock_spool_fault{reason="dir_removed"}'] == 1, "foreshock_spool_fault")
        check(db_rows(d.db, "SELECT count(*) FROM reports WHERE seq = ?", (FRAMES + 1,))[0][0] == 0,
              "a report was committed after the spool directory was deleted")
        # A new trainer is told why.
        c2 = RawConn(pb, d.ingest_port)
        try:
            c2.send(hello(pb, RUN, rank=1, world=2))
            e = c2.recv()
            check(e is not None and e.HasField("error") and "spool" in e.error.message,
                  f"Hello while the spool is gone: {e}")
        finally:
            c2.close()
        lines = [l for l in d.log_text().splitlines() if "was removed under the running" in l]
        check(len(lines) == 1 and " error spool: " in lines[0], f"fault log lines: {lines}")
        check(not os.path.exists(d.db + ".spool"), "the daemon recreated the spool directory")
        c.close()
        c = None
        rc = d.stop(timeout=120)
        check(rc != 0 and re.search(r"1 items not written \(none was acknowledged",
                                    d.log_text()),
              f"stop with the spool gone: exit {rc}\n{d.log_text()[-2000:]}")
        restarted = start(args, workdir, conf, db=d.db)
        expect_reported(restarted, FRAMES, 0)
        send_frames(pb, restarted, FRAMES + 1, FRAMES + 2)  # acknowledged again
    finally:
        if c:
            c.close()
        kill_started(d, restarted)


if __name__ == "__main__":
    run_main(test)
