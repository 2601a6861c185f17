"""A recording holding a report the daemon refuses (a time that is not
finite, a step not below 2^63) stops `foreshock replay` and `foreshock
backtest` with an error naming the file and the report, instead of
resending it for ever (issue 22, High).

The daemon refuses such a report, and its empty placeholder too, since the
placeholder keeps the step and the time: libforeshock refuses it at
submission (-ERANGE), and a placeholder the daemon still refuses fails the
client instead of looping. Recordings are written here byte for byte
(magic, then length-prefixed frames) with the protobuf module generated from
proto/foreshock.proto.
"""
import os
import struct
import subprocess

import fstest
from fstest import check

MAGIC = b"FSREC01\n"  # FSC_RECORD_MAGIC
WAIT_S = 120  # far above a 3-report replay; a loop for ever runs into it


def recording(pb, path, run, bad_step=None, bad_time=None):
    """Three reports; the second carries the bad step or time."""
    frames = [fstest.hello(pb, run)]
    for i, step in enumerate([1, 2, 3]):
        f = fstest.report(pb, i + 1, step)
        f.report.time_unix = 1.7e9 + step
        if i == 1 and bad_step is not None:
            f.report.step = bad_step
        if i == 1 and bad_time is not None:
            f.report.time_unix = bad_time
        frames.append(f)
    with open(path, "wb") as out:
        out.write(MAGIC)
        for f in frames:
            out.write(fstest.frame_bytes(pb, f))


def run_cli(args):
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=WAIT_S)
    except subprocess.TimeoutExpired as e:  # the process was killed by run()
        raise fstest.Failure(f"{' '.join(args)}: still running after {WAIT_S} s (a loop?)\n"
                             f"{(e.stderr or b'')[-2000:]!r}")


def main(args, workdir):
    pb = fstest.proto_module(args.source_dir, workdir)
    cli = os.path.join(args.build_dir, "foreshock")
    cases = {
        "nan-time": dict(bad_time=float("nan")),
        "inf-time": dict(bad_time=float("inf")),
        "huge-step": dict(bad_step=1 << 63),
        "max-step": dict(bad_step=(1 << 64) - 1),
    }
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        for name, bad in cases.items():
            rec = os.path.join(workdir, f"{name}.fsrec")
            recording(pb, rec, f"refused-{name}", **bad)
            r = run_cli([cli, "replay", rec, "--endpoint", daemon.endpoint, "--timeout", "30"])
            out = r.stdout + r.stderr
            check(r.returncode == 1, f"replay {name}: exit {r.returncode}, expected 1:\n{out}")
            check(f"{rec}: report 2 (step {bad.get('bad_step', 2)}) refused" in r.stderr and
                  "2^63" in r.stderr, f"replay {name}: the error does not name report 2:\n{out}")

            b = run_cli([cli, "backtest", rec])
            out = b.stdout + b.stderr
            check(b.returncode == 1, f"backtest {name}: exit {b.returncode}, expected 1:\n{out}")
            check(f"{rec}: report 2" in b.stderr and "replay into the throwaway daemon failed"
                  in b.stderr, f"backtest {name}: the error does not name report 2:\n{out}")
        # The same recording without the bad report replays whole (the
        # checks above are about the bad report, not the file).
        good = os.path.join(workdir, "good.fsrec")
        recording(pb, good, "refused-good")
        r = run_cli([cli, "replay", good, "--endpoint", daemon.endpoint, "--timeout", "30"])
        check(r.returncode == 0 and "3 reports, 3 acknowledged" in r.stdout,
              f"replay good: exit {r.returncode}:\n{r.stdout}{r.stderr}")
        check(daemon.stop() == 0, "daemon exit code")
    finally:
        fstest.kill_started(daemon)


if __name__ == "__main__":
    fstest.run_main(main)
