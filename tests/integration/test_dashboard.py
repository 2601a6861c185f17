"""The dashboard at / against a real daemon fed by the simulator, loaded in
headless Chromium on loopback.

- /static/ assets: content types, the exact embedded bytes, strong ETag and
  304 on If-None-Match, HEAD, 404 for unknown assets, 405 for POST.
- An attention-numerics run (with one MoE layer): the DOM Chromium renders
  lists the run, has plot canvases for the loss, the attention monitors and
  the router monitors, an alert table with one row per alert the API returns
  (same rules and steps), and alert markers at the fired steps. A screenshot
  is kept as a test artifact (BUILD/test-artifacts/dashboard.png).
- Empty states: a run without sketches says so; an unknown run says so.
- A run restarted from a checkpoint (a rewind): its attempts are listed and
  each plot has a dashed marker at the step the attempt restarted from.
- Through a stub in front of the daemon (assets relayed, the API refused):
  a 401 makes the page ask for a read token; an API that drops connections
  shows the "daemon unreachable" banner.

Chromium runs once per page load in its own process group with a timeout;
the group (which this test started) is killed if anything is left of it."""
import hashlib
import html.parser
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fstest import Daemon, Failure, check, run_all_pages, run_main

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_TIMEOUT_S = 180        # wall clock for one page load (ASan daemon: slow answers)
VIRTUAL_TIME_MS = 12000         # page time: the first refresh plus two periodic ones
DYGRAPHS_DIR = "/usr/share/javascript/dygraphs"

RUN = "dash-attn"
RUN_SCALARS = "dash-scalars"
RUN_REWIND = "dash-rewind"
REWIND_STEP = 40
STEPS = 240
SKETCH_EVERY = 4
FAULT_STEP = 130


# --- raw HTTP ---------------------------------------------------------------------

def request(d, method, path, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def check_assets(d, source_dir):
    files = {
        "/": (os.path.join(source_dir, "dashboard", "index.html"), "text/html; charset=utf-8"),
        "/static/app.js": (os.path.join(source_dir, "dashboard", "app.js"),
                           "text/javascript; charset=utf-8"),
        "/static/app.css": (os.path.join(source_dir, "dashboard", "app.css"),
                            "text/css; charset=utf-8"),
        "/static/dygraph.min.js": (os.path.join(DYGRAPHS_DIR, "dygraph.min.js"),
                                   "text/javascript; charset=utf-8"),
        "/static/dygraph.min.css": (os.path.join(DYGRAPHS_DIR, "dygraph.min.css"),
                                    "text/css; charset=utf-8"),
    }
    etags = set()
    for path, (src, ctype) in files.items():
        with open(src, "rb") as f:
            want = f.read()
        status, hdr, body = request(d, "GET", path)
        check(status == 200, f"GET {path}: {status}")
        check(hdr.get("content-type") == ctype, f"GET {path}: content-type {hdr.get('content-type')}")
        check(body == want, f"GET {path}: {len(body)} bytes differ from {src} ({len(want)})")
        etag = hdr.get("etag", "")
        check(re.fullmatch(r'"[0-9a-f]{32}"', etag) is not None, f"GET {path}: etag {etag!r}")
        check(etag[1:-1] == hashlib.sha256(want).hexdigest()[:32],
              f"GET {path}: etag is not the SHA-256 prefix of the bytes")
        check(hdr.get("cache-control") == "no-cache", f"GET {path}: cache-control {hdr}")
        check("default-src 'self'" in hdr.get("content-security-policy", ""),
              f"GET {path}: no CSP restricting the page to this daemon")
        etags.add(etag)

        # revalidation: the same tag (strong or weak form, or *) is a 304 without a body
        for inm in (etag, "W/" + etag, f'"nope", {etag}', "*"):
            status, hdr2, body2 = request(d, "GET", path, {"If-None-Match": inm})
            check(status == 304 and body2 == b"", f"GET {path} If-None-Match {inm}: {status}")
            check(hdr2.get("etag") == etag, f"304 for {path} lacks the ETag")
        status, _, body2 = request(d, "GET", path, {"If-None-Match": '"0000"'})
        check(status == 200 and body2 == want, f"GET {path} with another tag: {status}")

        status, hdr3, body3 = request(d, "HEAD", path)
        check(status == 200 and body3 == b"", f"HEAD {path}: {status}, {len(body3)} body bytes")
        check(hdr3.get("content-length") == str(len(want)),
              f"HEAD {path}: content-length {hdr3.get('content-length')}, want {len(want)}")
        check(hdr3.get("etag") == etag, f"HEAD {path}: etag")
    check(len(etags) == len(files), "two assets share an ETag")

    for path in ("/static/nope.js", "/static/", "/static/app.js/x", "/static/..%2Findex.html",
                 "/static/APP.JS", "/index.html"):
        status, hdr, body = request(d, "GET", path)
        check(status == 404, f"GET {path}: {status}, expected 404")
        check(hdr.get("content-type") == "application/json" and
              json.loads(body)["error"]["code"] == "not_found", f"GET {path}: {body[:200]!r}")
    status, hdr, _ = request(d, "POST", "/")
    check(status == 405 and "GET" in hdr.get("allow", ""), f"POST /: {status} {hdr}")
    # the JSON API is unchanged next to the assets
    check(d.get("/healthz")["status"] == "ok", "healthz")
    print(f"  assets: {len(files)} files, types, ETag/304, HEAD, 404, 405 ok")


# --- Chromium -----------------------------------------------------------------------------

def chromium(workdir, url, extra):
    """One headless Chromium run; returns its stdout. Chromium and its
    helpers live in a new session whose id is the child's pid: the whole
    group is killed if it overruns or leaves anything behind."""
    profile = os.path.join(workdir, f"chromium-profile-{time.monotonic_ns()}")
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
           f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
           "--disable-extensions", "--disable-background-networking", "--disable-sync",
           "--disable-dev-shm-usage", "--mute-audio",
           f"--virtual-time-budget={VIRTUAL_TIME_MS}"] + extra + [url]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out, err = b"", b"(timed out)"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    check(p.returncode == 0 or out, f"chromium exited {p.returncode}: {err[-2000:]!r}")
    return out.decode("utf-8", "replace")


class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent = tag, dict(attrs), parent
        self.children, self.text = [], ""

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()

    def find_all(self, tag=None, **attrs):
        out = []
        for n in self.walk():
            if tag is not None and n.tag != tag:
                continue
            if all(self._has(n, k.replace("_", "-"), v) for k, v in attrs.items()):
                out.append(n)
        return out

    @staticmethod
    def _has(n, key, want):
        if key == "class":
            return want in (n.attrs.get("class") or "").split()
        if want is True:
            return key in n.attrs
        return n.attrs.get(key) == want

    def all_text(self):
        return self.text + "".join(c.all_text() for c in self.children)


VOID = {"meta", "link", "input", "br", "img", "hr", "col", "source", "wbr"}


class Tree(html.parser.HTMLParser):
    """The DOM Chromium dumped, as a small tree (stdlib only)."""

    def __init__(self, text):
        super().__init__()
        self.root = Node("#root", {}, None)
        self.cur = self.root
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        n = Node(tag, attrs, self.cur)
        self.cur.children.append(n)
        if tag not in VOID:
            self.cur = n

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, attrs, self.cur))

    def handle_endtag(self, tag):
        n = self.cur
        while n is not None and n.tag != tag:
            n = n.parent
        if n is not None and n.parent is not None:
            self.cur = n.parent

    def handle_data(self, data):
        # text goes into a text child so that all_text keeps document order
        t = Node("#text", {}, self.cur)
        t.text = data
        self.cur.children.append(t)


def load_dom(workdir, url):
    dom = Tree(chromium(workdir, url, ["--dump-dom"])).root
    body = dom.find_all("body")
    check(body, "no <body> in the dumped DOM")
    return dom, body[0]


def hidden(node):
    while node is not None:
        if "hidden" in node.attrs:
            return True
        node = node.parent
    return False


# --- the test ------------------------------------------------------------------------------

def simulate(args, d, run, extra):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
           "--run", run, "--flush-timeout", "300"] + extra
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    print(p.stdout[-600:])
    check(p.returncode == 0, f"simulate {run} exited {p.returncode}")


def wait_alerts(d, run, last_sketch_step):
    """Monitors run after the reports commit: wait (bounded) until the last
    sketched step is evaluated and an alert has fired."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ser = d.get(f"/api/v1/series?run={run}&name=qk.d2.erank.min")["series"]
        alerts = run_all_pages(d, f"/api/v1/alerts?run={run}", "alerts")
        done = ser and max(s["last_step"] or 0 for s in ser) >= last_sketch_step
        if done and any(a["evidence"]["fired_step"] is not None for a in alerts):
            return alerts
        time.sleep(0.2)
    raise Failure(f"{run}: no fired alert by the last sketched step")


def check_run_page(args, workdir, d, alerts):
    dom, body = load_dom(workdir, d.url(f"/#run={RUN}"))
    check(body.attrs.get("data-state") == "ready",
          f"page state {body.attrs.get('data-state')!r}: "
          f"{' '.join(n.all_text() for n in dom.find_all(id='banner'))}")
    check(int(body.attrs.get("data-cycles", "0")) >= 1, "no refresh cycle completed")

    # the run list: both runs, the attention run with its firing count
    items = {n.attrs["data-run"]: n for n in dom.find_all("li", data_run=True)}
    check(RUN in items and RUN_SCALARS in items, f"runs listed: {sorted(items)}")
    check("selected" in items[RUN].attrs.get("class", ""), "chosen run not highlighted")
    order = [n.attrs["data-run"] for n in dom.find_all("li", data_run=True)]
    check(order.index(RUN_SCALARS) < order.index(RUN), f"runs not newest first: {order}")
    firing = sum(1 for a in alerts if a["state"] == "firing")
    check(f"{firing} firing" in items[RUN].all_text(),
          f"run list says {items[RUN].all_text()!r}, API has {firing} firing")

    # plots with canvases: loss, at least one attention monitor, the router
    plots = {n.attrs["data-plot"]: n for n in dom.find_all(data_plot=True)}
    def has_canvas(key):
        return key in plots and bool(plots[key].find_all("canvas"))
    check(has_canvas("scalar:loss"), f"no loss plot canvas; plots: {sorted(plots)}")
    check(has_canvas("scalar:grad_norm"), "no grad norm plot canvas")
    check(has_canvas("scalar:step_update_ratio"),
          f"no step-size plot canvas (simulate sends step_update_ratio); plots: {sorted(plots)}")
    qk = [k for k in plots if k.startswith("qk:") and has_canvas(k)]
    check(qk, f"no attention monitor plot with a canvas; plots: {sorted(plots)}")
    check(any(k.startswith("qk:qk.d2.erank:") for k in qk), f"no Δ2 erank plot: {qk}")
    check(any(has_canvas(k) for k in plots if k.startswith("router:")),
          f"MoE run without router plots: {sorted(plots)}")
    # the default layer is where the first attention alert fired
    attn = sorted((a for a in alerts if a["rule"].startswith("qk.") and
                   a["evidence"]["fired_step"] is not None),
                  key=lambda a: a["evidence"]["fired_step"])
    if attn:
        layer = attn[0]["labels"]["layer"]
        check(any(k.split(":")[2] == str(layer) for k in qk),
              f"attention plots {qk} are not of layer {layer}, where the first alert fired")

    # the alert table: one row per alert, newest first, same rules and steps
    rows = dom.find_all("tr", data_alert_id=True)
    check([int(r.attrs["data-alert-id"]) for r in rows] == [a["id"] for a in alerts],
          f"table rows {[r.attrs['data-alert-id'] for r in rows]} vs API "
          f"{[a['id'] for a in alerts]}")
    def cell(row, cls):
        c = row.find_all("td", **{"class": cls})
        return c[0].all_text().strip() if c else None
    def step_text(v):
        return "–" if v is None else str(v)
    for r, a in zip(rows, alerts):
        ev = a["evidence"]
        got = (cell(r, "rule"), cell(r, "state"), cell(r, "severity"), cell(r, "attribution"),
               cell(r, "first-breach"), cell(r, "fired"), cell(r, "resolved"))
        want = (a["rule"], a["state"], a["severity"], a["attribution"],
                step_text(ev["first_breach_step"]), step_text(ev["fired_step"]),
                step_text(ev["resolved_step"]))
        check(got == want, f"alert {a['id']}: row {got}, API {want}")
        links = r.find_all("a", href=f"/api/v1/alerts/{a['id']}")
        check(links, f"alert {a['id']}: the row does not link to its API document")

    # markers at fired steps, coloured by severity, on the loss plot
    fired = {a["id"]: a for a in alerts if a["evidence"]["fired_step"] is not None}
    marks = plots["scalar:loss"].find_all("a", **{"class": "alert-marker"})
    check({int(m.attrs["data-alert-id"]) for m in marks} == set(fired),
          f"loss plot markers {[m.attrs.get('data-alert-id') for m in marks]}, fired {sorted(fired)}")
    for m in marks:
        a = fired[int(m.attrs["data-alert-id"])]
        check(m.attrs.get("data-step") == str(a["evidence"]["fired_step"]),
              f"marker of alert {a['id']} at step {m.attrs.get('data-step')}")
        check(f"sev-{a['severity']}" in m.attrs["class"].split(), f"marker colour {m.attrs}")
        check(re.search(r"left:\s*[0-9.]+px", m.attrs.get("style", "")) is not None,
              f"marker not positioned: {m.attrs}")
    print(f"  page: {len(items)} runs, {len(plots)} plots, {len(rows)} alert rows, "
          f"{len(marks)} markers on the loss plot")

    # screenshot, kept as an artifact
    art = os.path.join(os.path.abspath(args.build_dir), "test-artifacts")
    os.makedirs(art, exist_ok=True)
    png = os.path.join(art, "dashboard.png")
    if os.path.exists(png):
        os.unlink(png)
    chromium(workdir, d.url(f"/#run={RUN}"), [f"--screenshot={png}", "--window-size=1400,1800"])
    check(os.path.exists(png), "no screenshot written")
    with open(png, "rb") as f:
        head = f.read(8)
    check(head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20000,
          f"screenshot is not a plausible PNG ({os.path.getsize(png)} bytes)")
    print(f"  screenshot: {png}")


def check_rewind_page(args, workdir, d):
    common = ["--ranks", "1", "--steps", "80", "--layers", "1", "--heads", "2", "--dh", "8",
              "--d", "32", "--sketch-every", "4"]
    simulate(args, d, RUN_REWIND, common)
    simulate(args, d, RUN_REWIND, common + ["--attempt", "1", "--resume-step", str(REWIND_STEP)])
    deadline = time.monotonic() + 120
    while not d.get(f"/api/v1/runs/{RUN_REWIND}")["run"]["attempts"][-1]["rebuilt_at"]:
        check(time.monotonic() < deadline, "the rewind was never rebuilt")
        time.sleep(0.2)
    dom, body = load_dom(workdir, d.url(f"/#run={RUN_REWIND}"))
    check(body.attrs.get("data-state") == "ready", "rewind run: page not ready")
    box = dom.find_all(id="run-attempts")
    check(box and not hidden(box[0]), "the attempts of a rewound run are not shown")
    spans = box[0].find_all("span", data_attempt=True)
    check([s.attrs["data-attempt"] for s in spans] == ["0", "1"] and
          f"from step {REWIND_STEP}" in spans[1].all_text(), f"attempts shown: "
          f"{[s.all_text() for s in spans]}")
    plots = {n.attrs["data-plot"]: n for n in dom.find_all(data_plot=True)}
    marks = plots["scalar:loss"].find_all("span", **{"class": "rewind-marker"})
    check(len(marks) == 1 and marks[0].attrs.get("data-step") == str(REWIND_STEP) and
          marks[0].attrs.get("data-attempt") == "1" and
          re.search(r"left:\s*[0-9.]+px", marks[0].attrs.get("style", "")) is not None,
          f"rewind markers on the loss plot: {[m.attrs for m in marks]}")
    print(f"  rewind: attempts listed, marker at step {REWIND_STEP}")


def check_empty_states(workdir, d):
    dom, body = load_dom(workdir, d.url(f"/#run={RUN_SCALARS}"))
    check(body.attrs.get("data-state") == "ready", "scalars-only run: page not ready")
    note = dom.find_all(id="qk-empty")
    check(note and not hidden(note[0]) and "no attention sketches" in note[0].all_text(),
          "a run without sketches does not say so")
    plots = {n.attrs["data-plot"]: n for n in dom.find_all(data_plot=True)}
    check("scalar:loss" in plots and plots["scalar:loss"].find_all("canvas"),
          "scalars-only run: no loss plot")
    check(not any(k.startswith("qk:") for k in plots), f"scalars-only run has {sorted(plots)}")
    step = plots.get("scalar:step_update_ratio")
    check(step is not None and not step.find_all("canvas") and
          "not reported by this run" in step.all_text(),
          "scalars-only run: the step-size plot does not say it was not reported")
    check(hidden(dom.find_all(id="router-section")[0]), "scalars-only run shows router plots")

    dom, body = load_dom(workdir, d.url("/#run=no-such-run"))
    msg = dom.find_all(id="run-empty")
    check(msg and not hidden(msg[0]) and "No run named" in msg[0].all_text(),
          "an unknown run does not say so")
    print("  empty states: scalars-only run and unknown run ok")


class Stub(BaseHTTPRequestHandler):
    """Relays the page's assets from the daemon; answers the API per mode:
    "auth" 401 (a read token is configured), "down" a dropped connection."""
    daemon_port = 0
    mode = "auth"

    def do_GET(self):
        if self.path.startswith("/api/"):
            if self.mode == "down":
                self.close_connection = True
                return  # no response at all: fetch() fails
            body = b'{"error":{"code":"unauthorized","message":"a read token is required"}}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("WWW-Authenticate", "Bearer")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.daemon_port, timeout=30)
        conn.request("GET", self.path)
        r = conn.getresponse()
        body = r.read()
        conn.close()
        self.send_response(r.status)
        self.send_header("Content-Type", r.getheader("Content-Type"))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *a):
        pass


def check_stub_states(workdir, d):
    for mode in ("auth", "down"):
        handler = type("StubMode", (Stub,), {"daemon_port": d.http_port, "mode": mode})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        try:
            url = f"http://127.0.0.1:{srv.server_address[1]}/#run={RUN}"
            dom, body = load_dom(workdir, url)
        finally:
            srv.shutdown()
            srv.server_close()
            t.join()
        state = body.attrs.get("data-state")
        if mode == "auth":
            form = dom.find_all("form", id="auth")
            check(state == "auth" and form and not hidden(form[0]),
                  f"401: page state {state!r}, token form shown: {form and not hidden(form[0])}")
            check(dom.find_all("input", id="token"), "401: no token input")
        else:
            banner = dom.find_all(id="banner")
            text = banner[0].all_text() if banner else ""
            check(state == "error" and not hidden(banner[0]) and "unreachable" in text,
                  f"API down: state {state!r}, banner {text!r}")
    print("  stub: 401 asks for a token; a dropped API shows 'unreachable'")


def main(args, workdir):
    check(os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing (deploy/install-deps.sh)")
    d = Daemon(args.build_dir, workdir)
    try:
        check_assets(d, args.source_dir)
        simulate(args, d, RUN, ["--ranks", "2", "--steps", str(STEPS), "--layers", "2",
                                "--heads", "4", "--dh", "16", "--d", "128",
                                "--sketch-every", str(SKETCH_EVERY),
                                "--scenario", "attention-numerics",
                                "--fault-step", str(FAULT_STEP),
                                "--experts", "4", "--moe-layers", "1"])
        last_sketch = (STEPS - 1) // SKETCH_EVERY * SKETCH_EVERY
        alerts = wait_alerts(d, RUN, last_sketch)
        # created after RUN: listed first (newest first)
        simulate(args, d, RUN_SCALARS, ["--ranks", "1", "--steps", "30", "--no-sketches"])
        alerts = run_all_pages(d, f"/api/v1/alerts?run={RUN}", "alerts")
        check_run_page(args, workdir, d, alerts)
        check_empty_states(workdir, d)
        check_stub_states(workdir, d)
        check_rewind_page(args, workdir, d)
    except Exception:
        print(d.log_text()[-3000:])
        raise
    finally:
        rc = d.stop()
    check(rc == 0, f"foreshockd exited {rc}")


if __name__ == "__main__":
    run_main(main)
