"""Stopping `foreshock backtest` (SIGTERM, SIGINT) while it streams
recordings into its throwaway daemon kills that daemon by its PID, reaps it
and removes its temporary directory, then dies of the signal (issue 22,
Medium). A finished backtest leaves no directory either (the daemon's lock
file and spool directory used to stay).

Mid-run without timing: the recording is a FIFO this test holds open after
writing a Hello and one report, so the replay inside backtest waits for the
next frame for as long as the test wants. TMPDIR points into the test's
directory, so the throwaway directory is found there.
"""
import os
import signal
import subprocess

import fstest
from fstest import check

MAGIC = b"FSREC01\n"  # FSC_RECORD_MAGIC


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def daemon_child(pid, tmp):
    """The throwaway foreshockd of backtest pid once it logged ready, and
    its directory under tmp; None before."""
    for c in children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except FileNotFoundError:
            continue
        if not argv[0].endswith(b"foreshockd"):
            continue
        dirs = [x for x in os.listdir(tmp) if x.startswith("foreshock-backtest-")]
        if len(dirs) != 1:
            return None
        d = os.path.join(tmp, dirs[0])
        try:
            with open(os.path.join(d, "foreshockd.log")) as f:
                if "ready ingest=" in f.read():
                    return c, d
        except FileNotFoundError:
            pass
    return None


def gone(pid):
    """Not running: no such process, or a zombie nobody reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def stop_mid_run(pb, cli, workdir, sig):
    tmp = os.path.join(workdir, f"tmp-{sig.name}")
    os.mkdir(tmp)
    fifo = os.path.join(workdir, f"rec-{sig.name}.fsrec")
    os.mkfifo(fifo)
    w = os.open(fifo, os.O_RDWR)  # held open: the reader never sees the end
    bt = child = None
    try:
        os.write(w, MAGIC + fstest.frame_bytes(pb, fstest.hello(pb, "bt-signal")) +
                 fstest.frame_bytes(pb, fstest.report(pb, 1, 0)))
        env = dict(os.environ, TMPDIR=tmp)
        # Output to a file: the daemon inherits it, and a pipe would stay
        # open as long as that daemon lives.
        out_path = os.path.join(workdir, f"backtest-{sig.name}.out")
        with open(out_path, "wb") as out:
            bt = subprocess.Popen([cli, "backtest", fifo], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
        child, tdir = fstest.wait_until(lambda: bt.poll() is None and daemon_child(bt.pid, tmp),
                                        what="backtest's throwaway daemon")
        # The replay took the report (the run exists) and waits for more.
        fstest.wait_until(lambda: os.path.exists(os.path.join(tdir, "backtest.db")),
                          what="the throwaway database")
        os.kill(bt.pid, sig)
        bt.wait(timeout=60)
        with open(out_path, errors="replace") as f:
            out = f.read()
        check(bt.returncode == -sig, f"{sig.name}: backtest exited {bt.returncode}:\n{out}")
        check(fstest.wait_until(lambda: gone(child), timeout=30,
                                what=f"{sig.name}: throwaway daemon {child} gone"), "")
        if os.path.exists(tdir):
            raise fstest.Failure(f"{sig.name}: {tdir} left: {os.listdir(tdir)}")
        check(os.listdir(tmp) == [], f"{sig.name}: left in TMPDIR: {os.listdir(tmp)}")
        print(f"  {sig.name}: daemon {child} gone, {tdir} removed", flush=True)
    finally:
        os.close(w)
        fstest.kill_started(bt)
        if child is not None and not gone(child):  # the defect: it outlived backtest
            os.kill(child, signal.SIGKILL)


def main(args, workdir):
    pb = fstest.proto_module(args.source_dir, workdir)
    cli = os.path.join(args.build_dir, "foreshock")
    for sig in (signal.SIGTERM, signal.SIGINT):
        stop_mid_run(pb, cli, workdir, sig)

    # A backtest that runs to its end leaves nothing in TMPDIR either.
    tmp = os.path.join(workdir, "tmp-done")
    os.mkdir(tmp)
    rec = os.path.join(workdir, "done.fsrec")
    with open(rec, "wb") as f:
        f.write(MAGIC + fstest.frame_bytes(pb, fstest.hello(pb, "bt-done")))
        for step in range(5):
            f.write(fstest.frame_bytes(pb, fstest.report(pb, step + 1, step)))
    r = subprocess.run([cli, "backtest", rec], env=dict(os.environ, TMPDIR=tmp),
                       capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, f"backtest: exit {r.returncode}:\n{r.stdout}{r.stderr}")
    check(os.listdir(tmp) == [], f"a finished backtest left {os.listdir(tmp)}")


if __name__ == "__main__":
    fstest.run_main(main)
