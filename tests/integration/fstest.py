"""Shared helpers for Foreshock integration tests.

Every test starts the real daemon (build/foreshockd) on loopback with
ephemeral ports and a database in a fresh temporary directory, talks to it
over real sockets, and stops only the processes it started, by PID.

Run a test directly:  /usr/bin/python3 tests/integration/test_x.py --build-dir build
"""
import argparse
import importlib
import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

READY_RE = re.compile(r"foreshockd ready ingest=(\S+):(\d+) http=(\S+):(\d+)")
STARTUP_TIMEOUT_S = 30.0


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--build-dir", required=True)
    p.add_argument("--source-dir", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    return p.parse_args()


def preload_sanitizers():
    """For tests that load libforeshock.so into Python: under the ASan build
    tree, re-exec with the sanitizer runtimes preloaded
    (foreshock.testing.preload_sanitizers says why); otherwise returns."""
    args = parse_args()
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    from foreshock.testing import preload_sanitizers as preload
    preload(os.path.join(args.build_dir, "libforeshock.so"))


class Failure(Exception):
    pass


def check(cond, msg):
    """Assertion that survives python -O and says what failed."""
    if not cond:
        raise Failure(msg)


def proto_module(source_dir, workdir):
    """Generates foreshock_pb2 from proto/foreshock.proto with protoc into
    workdir and imports it (generated code never enters git)."""
    out = os.path.join(workdir, "pb")
    os.makedirs(out, exist_ok=True)
    proto_dir = os.path.join(source_dir, "proto")
    subprocess.run(["protoc", f"--proto_path={proto_dir}", f"--python_out={out}",
                    os.path.join(proto_dir, "foreshock.proto")], check=True)
    sys.path.insert(0, out)
    return importlib.import_module("foreshock_pb2")


def http_call(url, method=None, data=None, json_body=None, token=None, timeout=30):
    """One HTTP request whatever its status: (status, headers, body bytes).
    data: raw request bytes; json_body: an object sent as JSON instead;
    token: sent as a bearer token."""
    if json_body is not None:
        data = json.dumps(json_body).encode()
    r = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        r.add_header("Content-Type", "application/json")
    if token is not None:
        r.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


class Daemon:
    """A foreshockd process on loopback. Start with ports 0 (pick) or given
    ports (for a restart on the same address)."""

    def __init__(self, build_dir, workdir, ingest_port=0, http_port=0, extra=(), db=None,
                 config=None, binary=None, wrapper=()):
        """binary: an installed foreshockd instead of build_dir's; wrapper:
        a command that execs it (setpriv to another user), so that the
        PID is still the daemon's."""
        self.build_dir = build_dir
        self.workdir = workdir
        self.db = db or os.path.join(workdir, "foreshock.db")
        self.log_path = os.path.join(workdir, f"foreshockd.{int(time.time()*1000)}.log")
        args = list(wrapper) + [binary or os.path.join(build_dir, "foreshockd"),
                "--listen", f"127.0.0.1:{ingest_port}",
                "--http", f"127.0.0.1:{http_port}",
                "--db", self.db]
        if config:
            args += ["--config", config]
        args += list(extra)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.ingest_port, self.http_port = self._wait_ready()

    def _wait_ready(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Failure(f"foreshockd exited with {self.proc.returncode}:\n{self.log_text()}")
            m = READY_RE.search(self.log_text())
            if m:
                return int(m.group(2)), int(m.group(4))
            time.sleep(0.05)
        raise Failure("foreshockd did not log its ready line:\n" + self.log_text())

    def log_text(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @property
    def pid(self):
        return self.proc.pid

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.ingest_port}"

    @property
    def http(self):
        return f"127.0.0.1:{self.http_port}"

    def url(self, path):
        return f"http://127.0.0.1:{self.http_port}{path}"

    def get(self, path, expect=200):
        """GET a JSON document; checks the status code."""
        status, _, body = http_call(self.url(path))
        check(status == expect, f"GET {path}: status {status}, expected {expect}: {body[:500]!r}")
        return json.loads(body)

    def request(self, method, path, body=None, token=None, expect=200):
        """An HTTP request with an optional JSON body and bearer token;
        checks the status code and returns the JSON document (None if the
        reply has no body)."""
        status, _, out = http_call(self.url(path), method, json_body=body, token=token)
        check(status == expect,
              f"{method} {path}: status {status}, expected {expect}: {out[:500]!r}")
        return json.loads(out) if out else None

    def kill(self):
        """SIGKILL: the crash case."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()

    def stop(self, timeout=60):
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise Failure("foreshockd did not stop within %ss of SIGTERM" % timeout)
        self.log.close()
        return self.proc.returncode


def run_all_pages(daemon, path, key):
    """Follows keyset pagination ("next") and returns every item."""
    items, after = [], None
    while True:
        sep = "&" if "?" in path else "?"
        doc = daemon.get(path + (f"{sep}after={after}" if after else ""))
        items += doc[key]
        after = doc.get("next")
        if not after:
            return items


def metrics(daemon):
    """The daemon's /metrics samples: {"name" or "name{labels}": value}."""
    with urllib.request.urlopen(daemon.url("/metrics"), timeout=30) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


def same_series(got, want, rel, what, ref):
    """Checks two {series key: {step: value or None}} maps hold the same
    series, steps and absent points, and every value within relative `rel`
    (of max(1, |want|)); `what` names got and `ref` want in the messages.
    Returns (values compared, worst relative error)."""
    check(set(got) == set(want), f"{what}: series differ from {ref}: "
          f"{sorted(set(got) ^ set(want))[:10]}")
    worst, n = 0.0, 0
    for key, pts in want.items():
        check(set(got[key]) == set(pts), f"{what} {key}: steps {sorted(got[key])} vs "
              f"{sorted(pts)}")
        for step, v in pts.items():
            g = got[key][step]
            check((g is None) == (v is None), f"{what} {key} step {step}: {g} vs {v}")
            if v is None:
                continue
            err = abs(g - v) / max(1.0, abs(v))
            worst = max(worst, err)
            n += 1
            check(err <= rel, f"{what} {key} step {step}: {g} vs {ref} {v}")
    return n, worst


def kill_started(*procs):
    """Teardown for a finally: block. SIGKILLs, by its own PID, each of procs
    that still runs and reaps it: Daemon objects and subprocess.Popen this
    test started (None is skipped, so a process not started yet is fine).
    A process that already stopped (a check passed on its exit code) is left
    as it is; nothing the test did not start is touched."""
    for p in procs:
        if p is None:
            continue
        if isinstance(p, Daemon):
            if p.proc.poll() is None:
                p.kill()
        elif p.poll() is None:
            p.kill()
            p.wait()


SKIP_EXIT = 77  # ctest's SKIP_RETURN_CODE for these tests (tests/CMakeLists.txt)


class Skip(Exception):
    """The test cannot run here (not root, a tool missing): run_main exits
    SKIP_EXIT, which ctest reports as skipped, with the reason."""


def project_version(source_dir):
    """The version in CMakeLists.txt's project() (what packages carry)."""
    m = re.search(r"project\(foreshock VERSION (\S+)",
                  open(os.path.join(source_dir, "CMakeLists.txt")).read())
    check(m is not None, "no project VERSION in CMakeLists.txt")
    return m.group(1)


def cmake_install(build_dir, prefix, destdir=None, component=None, timeout=300, cwd=None):
    """`cmake --install build_dir --prefix prefix` (into DESTDIR destdir,
    one component if given, run in cwd); returns its output, raises Failure."""
    cmd = ["cmake", "--install", build_dir, "--prefix", prefix]
    if component:
        cmd += ["--component", component]
    env = dict(os.environ)
    env.pop("DESTDIR", None)
    if destdir:
        env["DESTDIR"] = destdir
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=timeout, cwd=cwd)
    check(p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}:\n{p.stdout[-3000:]}")
    return p.stdout


class CapturedWarnings(logging.Handler):
    """The WARNING (and worse) records of a logger, as messages: add it
    with logging.getLogger("foreshock").addHandler(...)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def count(self, *parts):
        """How many messages hold every one of parts."""
        return sum(all(p in m for p in parts) for m in self.messages)


def run_main(fn):
    """Runs fn(args, workdir) in a temporary directory; prints a closing line
    that ctest logs show, and exits non-zero on failure."""
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="foreshock-it-") as workdir:
        try:
            fn(args, workdir)
        except Failure as e:
            print(f"FAIL: {e}", flush=True)
            sys.exit(1)
        except Skip as e:
            print(f"SKIP: {e}", flush=True)
            sys.exit(SKIP_EXIT)
    print("PASS", flush=True)


SIMULATE_SUMMARY_RE = re.compile(
    r"simulate: run=(\S+) ranks=(\d+) steps=(\d+) submitted=(\d+) acked=(\d+) dropped=(\d+) reconnects=(\d+)")


def parse_simulate_summary(text):
    m = SIMULATE_SUMMARY_RE.search(text)
    check(m is not None, "no simulate summary line in:\n" + text[-3000:])
    keys = ["run", "ranks", "steps", "submitted", "acked", "dropped", "reconnects"]
    vals = [m.group(1)] + [int(m.group(i)) for i in range(2, 8)]
    return dict(zip(keys, vals))


def simulate_and_read_back(cli, daemon, run, ranks=2, steps=40, cwd=None):
    """Streams a small simulated run into daemon with the CLI at path cli
    (`foreshock simulate`), then reads it back over HTTP: every report
    acknowledged and stored, one loss point per rank and step. Raises
    Failure."""
    sim = subprocess.run(
        [cli, "simulate", "--endpoint", daemon.endpoint, "--run", run, "--ranks", str(ranks),
         "--steps", str(steps), "--layers", "2", "--heads", "2", "--dh", "8", "--d", "32",
         "--sketch-every", "5", "--flush-timeout", "120"],
        capture_output=True, text=True, timeout=300, cwd=cwd)
    check(sim.returncode == 0, f"{cli} simulate exited {sim.returncode}:\n"
                               f"{(sim.stdout + sim.stderr)[-2000:]}")
    s = parse_simulate_summary(sim.stdout + sim.stderr)
    check(s["submitted"] == s["acked"] == ranks * steps and s["dropped"] == 0,
          f"simulate summary: {s}")
    runs = run_all_pages(daemon, "/api/v1/runs", "runs")
    mine = [r for r in runs if r["id"] == run]
    check(mine and mine[0]["reports"] == ranks * steps, f"runs: {runs}")
    loss = run_all_pages(daemon, f"/api/v1/series?run={run}&name=loss", "series")
    check(sorted(x["labels"]["rank"] for x in loss) == list(range(ranks)),
          f"loss series: {loss}")
    for ser in loss:
        doc = daemon.get(f"/api/v1/series/{ser['id']}/points?from=0&limit={steps + 1}")
        check([p[0] for p in doc["points"]] == list(range(steps)),
              f"loss points of rank {ser['labels']['rank']}: {doc['points']}")


# --- raw protocol client, for tests that must send bad frames -----------------

def frame_bytes(pb, frame):
    body = frame.SerializeToString()
    return struct.pack(">I", len(body)) + body


class RawConn:
    """A plain socket speaking the length-prefixed protocol."""

    def __init__(self, pb, port, timeout=30, ssl_context=None):
        self.pb = pb
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if ssl_context is not None:  # TLS on ingest (tls_cert/tls_key)
            self.sock = ssl_context.wrap_socket(self.sock, server_hostname="localhost")

    def send_raw(self, data):
        self.sock.sendall(data)

    def send(self, frame):
        self.sock.sendall(frame_bytes(self.pb, frame))

    def _read_exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def recv(self):
        """Next frame, or None when the daemon closed the connection."""
        hdr = self._read_exact(4)
        if hdr is None:
            return None
        (n,) = struct.unpack(">I", hdr)
        body = self._read_exact(n)
        if body is None:
            return None
        f = self.pb.Frame()
        f.ParseFromString(body)
        return f

    def close(self):
        self.sock.close()


def hello(pb, run, rank=0, world=1, attempt=0, version=1, token=None):
    f = pb.Frame()
    h = f.hello
    h.protocol_version = version
    h.run_id = run
    h.attempt = attempt
    h.rank = rank
    h.world_size = world
    if token is not None:
        h.token = token
    return f


def report(pb, seq, step, loss=None):
    f = pb.Frame()
    r = f.report
    r.seq = seq
    r.step = step
    r.scalars.loss = 1.0 / (1 + step) if loss is None else loss
    r.scalars.grad_norm = 1.0
    return f


# --- paging: an HTTP receiver in this process, scalar alerts, the database -----

class Receiver:
    """An HTTP server on 127.0.0.1 (ephemeral port) in a thread of the test
    process that records every request. `respond(req)` returns the status
    for a request (a dict with method, path, headers, body, json); the
    default answers 200. Stop it with close() (also on failure: use it in a
    `with` block)."""

    def __init__(self, respond=None):
        import http.server
        import threading
        self.requests = []
        self.lock = threading.Lock()
        self.respond = respond or (lambda req: 200)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Buffered: the status line, headers and body leave in one write
            # (unbuffered, Nagle + the client's delayed ACK add ~40 ms).
            wbufsize = 1 << 16

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                try:
                    doc = json.loads(body)
                except ValueError:
                    doc = None
                req = {"method": "POST", "path": self.path, "headers": dict(self.headers),
                       "body": body, "json": doc, "time": time.time()}
                status = outer.respond(req)
                req["status"] = status
                with outer.lock:
                    outer.requests.append(req)
                out = b'{"status":"ok"}' if status < 400 else b'{"error":"test says no"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def snapshot(self):
        with self.lock:
            return list(self.requests)

    def wait_for(self, pred, timeout=60, what="requests"):
        """Polls until pred(list of requests) is true; returns the list."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reqs = self.snapshot()
            if pred(reqs):
                return reqs
            time.sleep(0.05)
        raise Failure(f"receiver: timed out waiting for {what}; got {len(self.snapshot())}: "
                      + repr([(r['path'], r['status'], r['body'][:300]) for r in self.snapshot()][-5:]))

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def send_losses(pb, port, run, losses, first_step=0):
    """Streams rank-0 reports of run `run` with the given loss values (one
    per step from first_step; NaN fires the non-finite loss rule at once,
    five normal ones after it resolve it) and waits for the last Ack.
    Resumes the stream's seq from Welcome. Returns the next step."""
    c = RawConn(pb, port)
    try:
        c.send(hello(pb, run))
        w = c.recv()
        check(w is not None and w.HasField("welcome"), f"no Welcome: {w}")
        seq = w.welcome.last_seq
        step = first_step
        for loss in losses:
            seq += 1
            c.send(report(pb, seq, step, loss=loss))
            step += 1
        while True:
            f = c.recv()
            check(f is not None, "connection closed before the last Ack")
            if f.HasField("ack") and f.ack.seq >= seq:
                return step
    finally:
        c.close()


def db_rows(db, sql, args=()):
    """Rows of a read-only query on the daemon's database (WAL: beside it)."""
    import sqlite3
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def db_exec(db, sql, args=()):
    """One write on the daemon's database beside it (tests only: silences)."""
    import sqlite3
    con = sqlite3.connect(db, timeout=30)
    try:
        with con:
            con.execute(sql, args)
    finally:
        con.close()


def free_port():
    """An ephemeral loopback port for a peer that cannot report the one it
    bound (Alertmanager, Prometheus, a launcher's MASTER_PORT); the small
    race with other processes between this close and the peer's bind is
    accepted. A torch.distributed group of our own ranks rendezvouses
    through a file instead (rendezvous()): no port, no race."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(workdir, name):
    """A torch.distributed init_method for ranks on this machine: a file
    store in the test's own directory, new for each group (FileStore must
    not find an old file). A tcp:// rendezvous on a port from free_port()
    lost that race to a concurrent test's bind (EADDRINUSE in CI)."""
    path = os.path.join(os.path.abspath(workdir), f"rendezvous-{name}")
    check(not os.path.exists(path), f"rendezvous file {path} already exists")
    return "file://" + path


def wait_until(pred, timeout=60, what="condition", interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise Failure(f"timed out waiting for {what}")
