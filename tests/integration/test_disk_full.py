"""Disk full (hardening item 6): the daemon's database lives on a small tmpfs
that the test fills with a filler file.

While commits fail for lack of space:
  - a new trainer's Hello is answered (Error{ERROR_INTERNAL} naming the
    storage failure), not left waiting;
  - /readyz names the failure ("storage: database or disk is full"), not
    "starting or shutting down";
  - nothing is acknowledged that is not stored.
When the filler goes, commits resume: the stuck reports are acked and a new
Hello gets its Welcome. Full again, SIGTERM ends the daemon within about
shutdown_timeout_s (it gives up what it could not write, never acked, and
exits 1). After a restart with space every acked report is there and the
trainer's resend completes the stream.

Needs root for `mount -t tmpfs`; exits 77 (ctest: skipped) with the reason
when mounting is impossible.
"""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import Daemon, RawConn, check, hello, kill_started, proto_module  # noqa: E402

SKIP = 77
FS_SIZE = "4m"
SHUTDOWN_TIMEOUT_S = 3
WAIT_S = 120  # upper bound for anything the daemon should do "soon"
LAYERS = 4096  # per-layer weight norms per big report: 4096 point rows


def mount_tmpfs(path):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE}", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return (r.stderr or r.stdout).strip() or f"mount exited {r.returncode}"
    return None


def umount(path):
    if subprocess.run(["umount", path], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path):
    """Writes zeros into path until the filesystem is full."""
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        # The last partial page, byte by byte would be slow: a few small writes.
        for n in (4096, 512, 64, 1):
            try:
                while True:
                    f.write(b"\0" * n)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise


def http_status(d, path):
    status, _, body = fstest.http_call(d.url(path))
    return status, body


def metric(d, name):
    _, body = http_status(d, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def wait_until(pred, what, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise fstest.Failure(f"timed out after {timeout} s waiting for {what}")


class Trainer:
    """One stream on a raw connection; remembers what was acked."""

    def __init__(self, pb, port, run):
        self.pb, self.port, self.run = pb, port, run
        self.acked = 0
        self.sent = 0
        self.connect()

    def connect(self):
        self.conn = RawConn(self.pb, self.port, timeout=WAIT_S)
        self.conn.send(hello(self.pb, self.run))
        f = self.conn.recv()
        check(f is not None and f.WhichOneof("body") == "welcome",
              f"{self.run}: expected Welcome, got {f}")
        check(f.welcome.last_seq >= self.acked,
              f"{self.run}: Welcome last_seq {f.welcome.last_seq} below acked {self.acked}: "
              "an acknowledged report was lost")
        self.acked = f.welcome.last_seq
        self.sent = self.acked
        return f.welcome.last_seq

    def report(self, seq, big):
        f = self.pb.Frame()
        r = f.report
        r.seq, r.step = seq, seq
        r.scalars.loss = 1.0 / seq
        if big:
            r.scalars.layer_weight_norm.extend([1.0 + 1e-4 * i + seq for i in range(LAYERS)])
        return f

    def send(self, big=False):
        self.sent += 1
        self.conn.send(self.report(self.sent, big))

    def poll_acks(self, timeout, stopping=False):
        """Reads frames for up to timeout seconds; returns False when the
        connection closed. stopping: the daemon may say it is stopping."""
        self.conn.sock.settimeout(timeout)
        try:
            while True:
                f = self.conn.recv()
                if f is None:
                    return False
                kind = f.WhichOneof("body")
                if stopping and kind == "error" and f.error.code == self.pb.ERROR_SHUTTING_DOWN:
                    continue
                check(kind == "ack", f"{self.run}: unexpected {kind}: {f}")
                check(f.ack.seq <= self.sent, f"{self.run}: ack {f.ack.seq} beyond sent {self.sent}")
                self.acked = max(self.acked, f.ack.seq)
        except (socket.timeout, TimeoutError):
            return True
        finally:
            self.conn.sock.settimeout(WAIT_S)

    def wait_acked(self, seq, what):
        deadline = time.monotonic() + WAIT_S
        while self.acked < seq:
            check(time.monotonic() < deadline, f"{self.run}: {what}: acked {self.acked} < {seq}")
            check(self.poll_acks(0.5), f"{self.run}: connection closed waiting for ack {seq}")


def hello_answer(pb, port, run):
    """A new trainer's Hello: returns the answer frame (fails on silence)."""
    c = RawConn(pb, port, timeout=WAIT_S)
    try:
        c.send(hello(pb, run))
        try:
            f = c.recv()
        except (socket.timeout, TimeoutError):
            raise fstest.Failure(f"Hello of {run} got no answer within {WAIT_S} s")
        check(f is not None, f"Hello of {run}: connection closed without an answer")
        return f
    finally:
        c.close()


def fill_until_failing(d, t, filler):
    """Fills the disk, then sends big reports until commits fail."""
    fill(filler)

    def failing():
        if metric(d, "foreshock_storage_failing") == 1:
            return True
        t.send(big=True)
        t.poll_acks(0.2)
        return False
    wait_until(failing, "commits to fail on the full disk")


def test(args, workdir):
    mnt = os.path.join(workdir, "mnt")
    why = mount_tmpfs(mnt)
    if why:
        print(f"SKIP: cannot mount a {FS_SIZE} tmpfs at {mnt} ({why}); this test needs root")
        sys.exit(SKIP)
    pb = proto_module(args.source_dir, workdir)
    d = d2 = None
    filler = os.path.join(mnt, "filler")
    try:
        db = os.path.join(mnt, "fs.db")
        extra = ("--set", f"shutdown_timeout_s={SHUTDOWN_TIMEOUT_S}")
        d = Daemon(args.build_dir, workdir, db=db, extra=extra)
        a = Trainer(pb, d.ingest_port, "full-run")
        for _ in range(10):
            a.send()
        a.wait_acked(10, "before the disk fills")

        # --- full: Hello answered, /readyz names the failure, no false ack ----
        fill_until_failing(d, a, filler)
        print(f"commits fail: acked {a.acked}, sent {a.sent}")
        f = hello_answer(pb, d.ingest_port, "late-run")
        check(f.WhichOneof("body") == "error", f"Hello on a full disk: expected Error, got {f}")
        check(f.error.code == pb.ERROR_INTERNAL,
              f"Hello on a full disk: code {f.error.code}, expected ERROR_INTERNAL")
        check("disk is full" in f.error.message, f"Error does not name the cause: {f.error}")
        print(f"Hello on a full disk: Error {f.error.code}: {f.error.message}")
        status, body = http_status(d, "/readyz")
        check(status == 503, f"/readyz on a full disk: {status} {body!r}")
        msg = json.loads(body)["error"]["message"]
        check("storage" in msg and "database or disk is full" in msg,
              f"/readyz does not name the storage failure: {msg!r}")
        print(f"/readyz: 503 {msg}")
        a.poll_acks(1.0)  # poll_acks refuses any ack beyond what was sent

        # --- space returns: the stuck reports commit, Hellos are welcomed -----
        os.unlink(filler)
        a.wait_acked(a.sent, "after space returned")
        b = Trainer(pb, d.ingest_port, "after-run")
        b.send()
        b.wait_acked(1, "new stream after space returned")
        wait_until(lambda: http_status(d, "/readyz")[0] == 200, "/readyz 200 again")
        print(f"space back: acked {a.acked} of {a.sent}; a new stream streams")

        # --- full again: SIGTERM ends within the bound -----------------------
        fill_until_failing(d, a, filler)
        acked_before_stop = a.acked
        t0 = time.monotonic()
        os.kill(d.pid, signal.SIGTERM)
        try:
            d.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + WAIT_S)
        except subprocess.TimeoutExpired:
            raise fstest.Failure(f"SIGTERM on a full disk: still running after "
                                 f"{SHUTDOWN_TIMEOUT_S + WAIT_S} s")
        took = time.monotonic() - t0
        d.log.close()
        log = d.log_text()
        print(f"SIGTERM on a full disk: exited {d.proc.returncode} after {took:.1f} s")
        check(d.proc.returncode == 1,
              f"exit status {d.proc.returncode} after giving up unwritten data, expected 1")
        check("not written" in log, "the log does not say what was given up:\n" + log[-3000:])
        check("Sanitizer" not in log and "runtime error" not in log,
              "sanitizer report (exit status 1 is also ASan's):\n" + log[-5000:])
        print("\n".join(line for line in log.splitlines()[-12:]))
        a.poll_acks(0.5, stopping=True)  # acks sent before the close
        a.conn.close()

        # --- restart with space: every acked report is there ------------------
        # (a writer queue of 2 items, for the last phase)
        os.unlink(filler)
        d2 = Daemon(args.build_dir, workdir, db=db,
                    extra=extra + ("--set", "writer_queue_max_items=2",
                                   "--set", "writer_batch_max_items=1"))
        a.port = d2.ingest_port
        acked = a.acked
        resume = a.connect()
        check(resume >= acked, f"restart: last_seq {resume} < acked {acked}")
        for _ in range(5):
            a.send()
        a.wait_acked(a.sent, "after the restart")
        run = d2.get("/api/v1/runs/full-run")["run"]
        check(run["reports"] == a.sent,
              f"restart: {run['reports']} reports stored, expected {a.sent} (dense seqs)")
        print(f"restart: acked before stop {acked_before_stop}, resume point {resume}, "
              f"{run['reports']} reports stored")

        # --- full, and the writer queue full: ingest stops reading streams,
        # yet a new Hello is read and answered ---------------------------------
        fill_until_failing(d2, a, filler)
        pauses = metric(d2, "foreshock_backpressure_pauses_total")
        for _ in range(3):
            a.send()
        wait_until(lambda: metric(d2, "foreshock_backpressure_pauses_total") > pauses,
                   "ingest to pause on the full writer queue")
        f = hello_answer(pb, d2.ingest_port, "queued-run")
        check(f.WhichOneof("body") == "error" and f.error.code == pb.ERROR_INTERNAL and
              "disk is full" in f.error.message,
              f"Hello with the writer queue full on a full disk: {f}")
        print(f"Hello with the writer queue full: Error {f.error.code}: {f.error.message}")
        os.unlink(filler)
        a.wait_acked(a.sent, "after space returned (queue full)")
        run = d2.get("/api/v1/runs/full-run")["run"]
        check(run["reports"] == a.sent, f"{run['reports']} reports stored, expected {a.sent}")
        b = Trainer(pb, d2.ingest_port, "queued-run")
        print(f"space back: all {a.sent} reports stored; queued-run welcomed")
        check(d2.stop() == 0, "restarted daemon did not exit 0")
    finally:
        kill_started(d, d2)
        umount(mnt)


if __name__ == "__main__":
    fstest.run_main(test)
