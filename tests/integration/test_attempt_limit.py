"""One Hello cannot use up a run's attempts (issue 22, High).

A rewind needs an attempt above every earlier one of its run, and attempts
are 32-bit: one Hello of attempt 2^32-1 used to be taken, and every later
rewind of the run (attempt n+1, resume_step S) then started nothing, with
no word. The daemon now refuses a Hello that starts an attempt more than
FS_MAX_ATTEMPT_JUMP (1024) above the run's latest (above 0 for a new run),
with an error naming both, and the run's rewinds go on.
"""
import fstest
from fstest import check

JUMP = 1024  # FS_MAX_ATTEMPT_JUMP, daemon/fs_limits.h
TOP = (1 << 32) - 1


def hello(pb, port, run, attempt, resume_step=None):
    """One Hello on a fresh connection: ("welcome", None) or ("error",
    (code name, message))."""
    c = fstest.RawConn(pb, port)
    try:
        f = fstest.hello(pb, run, attempt=attempt)
        if resume_step is not None:
            f.hello.resume_step = resume_step
        c.send(f)
        r = c.recv()
        check(r is not None, f"{run} attempt {attempt}: connection closed without an answer")
        kind = r.WhichOneof("body")
        if kind == "error":
            return kind, (pb.ErrorCode.Name(r.error.code), r.error.message)
        check(kind == "welcome", f"{run} attempt {attempt}: answered {kind}")
        return kind, None
    finally:
        c.close()


def attempts(d, run):
    return {a["attempt"]: a for a in d.get(f"/api/v1/runs/{run}")["run"]["attempts"]}


def main(args, workdir):
    pb = fstest.proto_module(args.source_dir, workdir)
    d = fstest.Daemon(args.build_dir, workdir)
    try:
        port = d.ingest_port
        check(hello(pb, port, "a", 0) == ("welcome", None), "a: attempt 0")
        kind, err = hello(pb, port, "a", TOP, resume_step=0)
        check(kind == "error" and err[0] == "ERROR_MALFORMED" and f"attempt {TOP}" in err[1] and
              "latest attempt 0" in err[1], f"a: attempt 2^32-1 answered {kind} {err}")
        # The run's next rewind still happens.
        check(hello(pb, port, "a", 1, resume_step=0) == ("welcome", None), "a: attempt 1")
        att = fstest.wait_until(lambda: (lambda a: a if 1 in a else None)(attempts(d, "a")),
                                what="attempt 1 of run a in /api/v1/runs/a")
        check(sorted(att) == [0, 1] and att[1]["resume_step"] == 0,
              f"a: attempts {sorted(att)}: {att}")

        # The bound, both sides, from the latest attempt and for a new run.
        check(hello(pb, port, "a", 1 + JUMP) == ("welcome", None), "a: latest + 1024")
        kind, err = hello(pb, port, "a", 2 + 2 * JUMP)
        check(kind == "error" and f"latest attempt {1 + JUMP}" in err[1],
              f"a: latest + 1025 answered {kind} {err}")
        check(hello(pb, port, "a", 3) == ("welcome", None), "a: an older attempt reconnects")
        kind, err = hello(pb, port, "b", TOP)
        check(kind == "error" and "latest attempt 0" in err[1],
              f"b: a new run at 2^32-1 answered {kind} {err}")
        check(hello(pb, port, "c", JUMP) == ("welcome", None), "c: a new run at 1024")
        runs = {r["id"] for r in fstest.run_all_pages(d, "/api/v1/runs", "runs")}
        check(runs == {"a", "c"}, f"a refused Hello stored its run: {runs}")
        check(d.stop() == 0, "daemon exit code")
    finally:
        fstest.kill_started(d)


if __name__ == "__main__":
    fstest.run_main(main)
