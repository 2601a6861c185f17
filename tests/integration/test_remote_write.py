"""Remote write into the real engines Debian ships: two daemons for two
simulated jobs, each writing to a Prometheus (--web.enable-remote-write-
receiver) and a VictoriaMetrics, all on loopback. Mid-run one daemon is
SIGKILLed and restarted, and VictoriaMetrics is stopped and restarted (an
outage of a few seconds, while both daemons keep storing and their senders
retry: the queue is the database, so a 5-minute outage differs only in the
lag). Then every series each daemon serves over its HTTP API must be in
both stores with every point exactly once and the same values, alert states
included; one daemon also sends the heads' series (per_head) to Prometheus
from a third target, so Prometheus gets those samples twice and must keep
them once. Last, one daemon's cursors are moved back (a crash between a 2xx
and the cursor's commit, made certain) and it resends everything: both
stores still hold each point once.

Prometheus needs storage.tsdb.out_of_order_time_window for a resend to be
accepted (and deduplicated), VictoriaMetrics -dedup.minScrapeInterval=1ms
(docs/fleet.md)."""
import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.parse

from fstest import (Daemon, Skip, check, db_exec, db_rows, free_port, http_call, kill_started,
                    metrics, parse_simulate_summary, run_all_pages, run_main, wait_until)

SHAPE = ["--layers", "2", "--heads", "2", "--dh", "8", "--d", "32", "--sketch-every", "5"]
STEPS = 400
RATE = "40"  # steps per second: a run lasts ~10 s, each step its own millisecond



class Engine:
    """A Prometheus or VictoriaMetrics process on a fixed loopback port (so
    that a restart is the same address the daemons send to)."""

    def __init__(self, kind, workdir):
        self.kind, self.workdir = kind, workdir
        self.port = free_port()
        self.data = os.path.join(workdir, f"{kind}-data")
        self.proc = None
        self.starts = 0
        # Prometheus keeps the float64 sent; VictoriaMetrics 1.79 stores a
        # decimal mantissa and exponent and keeps 12 significant digits
        # (10.007152326802462 reads back as 10.0071523268).
        self.rel = 0.0 if kind == "prometheus" else 1e-11

    def start(self):
        self.starts += 1
        log = open(os.path.join(self.workdir, f"{self.kind}.{self.starts}.log"), "w")
        if self.kind == "prometheus":
            conf = os.path.join(self.workdir, "prometheus.yml")
            with open(conf, "w") as f:
                # Resent batches (after a crash) arrive out of order: accepted,
                # and deduplicated, within this window.
                f.write("global: {}\nstorage:\n  tsdb:\n    out_of_order_time_window: 2h\n")
            cmd = ["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={self.data}",
                   f"--web.listen-address=127.0.0.1:{self.port}",
                   "--web.enable-remote-write-receiver"]
        else:
            cmd = ["victoria-metrics", f"-httpListenAddr=127.0.0.1:{self.port}",
                   f"-storageDataPath={self.data}", "-dedup.minScrapeInterval=1ms",
                   "-search.latencyOffset=0s", "-search.disableCache"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        ready = "/-/ready" if self.kind == "prometheus" else "/health"

        def up():
            check(self.proc.poll() is None, f"{self.kind} exited {self.proc.returncode}")
            try:
                return http_call(self.base + ready, timeout=2)[0] == 200
            except OSError:
                return False
        wait_until(up, timeout=60, what=f"{self.kind} ready")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def write_url(self):
        return self.base + "/api/v1/write"

    def query(self, expr, at):
        q = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        status, _, body = http_call(f"{self.base}/api/v1/query?{q}", timeout=60)
        check(status == 200, f"{self.kind}: {expr}: HTTP {status}: {body[:300]!r}")
        doc = json.loads(body)
        check(doc["status"] == "success", f"{self.kind}: {expr}: {doc}")
        return doc["data"]


def start_daemon(args, workdir, name, engines, ports=(0, 0), heads_to=None):
    """A daemon with a [remote_write] target per engine, and with heads_to a
    target "heads" (per_head = true) to that engine as well."""
    d = os.path.join(workdir, name)
    os.makedirs(d, exist_ok=True)
    conf = os.path.join(d, "foreshockd.conf")
    with open(conf, "w") as f:
        for e in engines:
            f.write(f'[remote_write "{e.kind}"]\nurl = {e.write_url}\nlabels = cluster=it\n'
                    "batch_samples = 2000\ntimeout = 5\n")
        if heads_to:
            f.write(f'[remote_write "heads"]\nurl = {heads_to.write_url}\nlabels = cluster=it\n'
                    "per_head = true\n")
    return Daemon(args.build_dir, d, ingest_port=ports[0], http_port=ports[1], config=conf,
                  db=os.path.join(d, "foreshock.db"))


def simulate(args, daemon, run, extra):
    return subprocess.Popen(
        [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", daemon.endpoint,
         "--run", run, "--ranks", "2", "--steps", str(STEPS), "--rate", RATE,
         "--flush-timeout", "300"] + SHAPE + extra,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metric_name(series):
    return "foreshock_" + "".join(c if c.isalnum() or c == "_" else "_" for c in series)


def expected_series(daemon, run, heads=False):
    """{(metric, frozenset(labels)): [values in step order]} from the daemon's
    HTTP API: every series without a head label (what is sent by default),
    with heads those of the heads too (per_head)."""
    out = {}
    for ser in run_all_pages(daemon, f"/api/v1/series?run={run}", "series"):
        labels = ser["labels"]
        want = {"run": run, "cluster": "it"}
        if labels.get("head", -1) >= 0:
            if not heads:
                continue
            want["head"] = str(labels["head"])
        if labels.get("layer", -1) >= 0:
            want["layer"] = str(labels["layer"])
        if labels.get("window", 0) > 0:
            want["window"] = str(labels["window"])
        if labels.get("rank", -1) >= 0:
            want["rank"] = str(labels["rank"])
        values, start = [], 0
        while start is not None:
            doc = daemon.get(f"/api/v1/series/{ser['id']}/points?from={start}&limit=10000")
            values += [p[1] for p in doc["points"] if p[1] is not None]
            start = doc.get("next_from")
        if values:
            out[(metric_name(ser["name"]), frozenset(want.items()))] = values
    return out


def received(engine, run, at):
    """{(metric, labels without attempt): [values in time order]} of every
    foreshock_ series of run in engine: raw samples of a range selector."""
    data = engine.query(f'{{__name__=~"foreshock_.+",run="{run}"}}[2h]', at)
    check(data["resultType"] == "matrix", f"{engine.kind}: {data['resultType']}")
    out = {}
    for r in data["result"]:
        m = dict(r["metric"])
        name = m.pop("__name__")
        m.pop("attempt", None)
        key = (name, frozenset(m.items()))
        vals = [(float(t), float(v)) for t, v in r["values"]]
        out.setdefault(key, []).extend(vals)
    # A resend delivers the same sample again (at-least-once): a store may
    # keep the copy until it merges (VictoriaMetrics did, for 2 of 25 alert
    # samples, under AddressSanitizer's slowness). The same timestamp and
    # value in one series is one sample; anything else still counts.
    return {k: [v for _, v in sorted(set(vs))] for k, vs in out.items()}


def same(a, b, rel):
    """Equal sequences: exactly (rel 0), or within a relative rel."""
    return len(a) == len(b) and all(x == y or math.isclose(x, y, rel_tol=rel, abs_tol=0)
                                    for x, y in zip(a, b))


def compare(engine, daemon, run, at, heads=False):
    want = expected_series(daemon, run, heads)
    got = received(engine, run, at)
    alerts = {k: v for k, v in got.items() if k[0] == "foreshock_alert"}
    got = {k: v for k, v in got.items() if k[0] != "foreshock_alert"}
    check(want, f"{run}: the daemon serves no series")
    missing = sorted(str(k) for k in want if k not in got)
    check(not missing, f"{engine.kind}: {run}: {len(missing)} series missing, e.g. {missing[:3]}")
    extra = sorted(str(k) for k in got if k not in want)
    check(not extra, f"{engine.kind}: {run}: series the daemon does not serve: {extra[:3]}")
    points = 0
    for k, vals in want.items():
        g = got[k]
        check(same(vals, g, engine.rel), f"{engine.kind}: {run}: {k}: {len(g)} samples, want {len(vals)}"
                             f" (first differing: {next((i for i, (x, y) in enumerate(zip(vals, g)) if x != y), None)})")
        points += len(vals)
    # Alert states: one sample per transition the daemon recorded.
    events = db_rows(daemon.db, "SELECT e.id FROM alert_events e JOIN alerts a ON "
                     "a.id = e.alert_id JOIN runs r ON r.id = a.run_id WHERE r.name = ?", (run,))
    n_alert = sum(len(v) for v in alerts.values())
    check(n_alert == len(events), f"{engine.kind}: {run}: {n_alert} foreshock_alert samples, "
                                  f"{len(events)} transitions")
    return len(want), points, len(events)


def compare_soon(engine, daemon, run, heads=False, timeout=60):
    """compare, retried for a while: VictoriaMetrics makes what it received
    searchable after its in-memory buffers are flushed (about a second)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return compare(engine, daemon, run, time.time() + 1, heads)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def fleet_queries(source_dir):
    """(what, PromQL, must have a result) of the fleet dashboard's panels and
    annotations ($run: both jobs) and of the fleet rules."""
    dash = json.load(open(os.path.join(source_dir, "deploy", "grafana", "foreshock-fleet.json")))
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']}", t["expr"], True))
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            out.append((f"annotation {a['name']}", a["expr"], True))
    out = [(w, e.replace("$run", "job-a|job-b").replace("$cluster", ".*"), need)
           for w, e, need in out]
    import yaml
    rules = yaml.safe_load(open(os.path.join(source_dir, "deploy", "prometheus",
                                             "foreshock-fleet-rules.yml")))
    for g in rules["groups"]:
        for r in g["rules"]:
            # Recording rules and the alert on foreshock_alert read the
            # remote-write series; the others read the daemons' /metrics.
            on_store = "record" in r or "foreshock_alert" in r["expr"]
            out.append((f"rule {r.get('record') or r.get('alert')}", r["expr"], on_store))
    return out


def rw_metric(daemon, name, target=None):
    """A remote-write family of the daemon's /metrics: one target's sample,
    or the sum over its targets."""
    m = metrics(daemon)
    if target is not None:
        return m.get(f'{name}{{target="{target}"}}', 0)
    return sum(v for k, v in m.items() if k.startswith(name + "{"))


def sent(daemon):
    return rw_metric(daemon, "foreshock_remote_write_samples_sent_total")


TARGETS = {False: ("prometheus", "victoria-metrics"),
           True: ("prometheus", "victoria-metrics", "heads")}  # by "is daemon b"


def settled(daemon, targets):
    """Every target acknowledged every stored step and alert transition: its
    cursors (the daemon's own record of what was acknowledged) are at the
    end."""
    last = dict(db_rows(daemon.db, "SELECT id, last_step FROM runs"))
    top = db_rows(daemon.db, "SELECT coalesce(max(id), 0) FROM alert_events")[0][0]
    cur = {(t, k, r): p for t, k, r, p in
           db_rows(daemon.db, "SELECT target, kind, run_id, pos FROM remote_write_cursor")}
    return all(cur.get((t, 0, run), -1) >= step for t in targets for run, step in last.items()) \
        and all(top == 0 or cur.get((t, 1, 0), 0) >= top for t in targets)


def test(args, workdir):
    for tool in ("prometheus", "victoria-metrics"):
        if not shutil.which(tool):
            raise Skip(f"{tool} is not installed (deploy/install-deps.sh installs it)")
    prom, vm = Engine("prometheus", workdir), Engine("victoria-metrics", workdir)
    a = b = a2 = b2 = sim_a = sim_b = None
    try:
        prom.start()
        vm.start()
        a = start_daemon(args, workdir, "a", (prom, vm))
        # b sends the heads' series to Prometheus too, from a third target:
        # what the two Prometheus targets both send arrives twice, is kept once.
        b = start_daemon(args, workdir, "b", (prom, vm), heads_to=prom)
        sim_a = simulate(args, a, "job-a", [])
        sim_b = simulate(args, b, "job-b", ["--scenario", "lr-spike", "--fault-step", "150"])

        # A crash of daemon a once its senders have delivered some of the run.
        wait_until(lambda: sent(a) > 0, timeout=120, what="daemon a's first remote write")
        a_ports = (a.ingest_port, a.http_port)
        a.kill()
        a = start_daemon(args, workdir, "a", (prom, vm), ports=a_ports)

        # An outage of VictoriaMetrics while both runs go on: the senders retry.
        vm.stop()
        retries = lambda d: rw_metric(d, "foreshock_remote_write_retries_total",
                                      "victoria-metrics")
        wait_until(lambda: retries(a) > 0 and retries(b) > 0, timeout=120,
                   what="both daemons retrying against the stopped VictoriaMetrics")
        # An outage longer than one backoff step; the 5 minutes is a
        # manual run: FORESHOCK_RW_OUTAGE_S=300.
        time.sleep(float(os.environ.get("FORESHOCK_RW_OUTAGE_S", "3")))
        vm.start()

        for sim in (sim_a, sim_b):
            out, _ = sim.communicate(timeout=600)
            s = parse_simulate_summary(out)
            check(sim.returncode == 0 and s["acked"] == s["submitted"] == 2 * STEPS,
                  f"simulate: {s}\n{out[-2000:]}")
        for d in (a, b):
            wait_until(lambda: settled(d, TARGETS[d is b]), timeout=180,
                       what="remote write caught up")
        for engine in (prom, vm):
            for d, run in ((a, "job-a"), (b, "job-b")):
                heads = engine is prom and d is b
                n, pts, ev = compare_soon(engine, d, run, heads)
                print(f"{engine.kind}: {run}: {n} series{' with heads' if heads else ''}, {pts} "
                      f"points, {ev} alert transitions: each once, values equal")
        check(compare(prom, b, "job-b", time.time() + 1, heads=True)[2] > 0,
              "job-b's fault raised no alert transition")
        # Every query of the fleet dashboard and rules runs on both stores,
        # and those over the sent series find them.
        for engine in (prom, vm):
            # Asked at the runs' last sample, not now: an instant query looks
            # back 5 minutes, which a long outage or a slow machine can pass.
            last = engine.query('{__name__=~"foreshock_.+",run=~"job-a|job-b"}[2h]', time.time())
            at = max(float(t) for r in last["result"] for t, _ in r["values"])
            for what, expr, need in fleet_queries(args.source_dir):
                data = engine.query(expr, at)
                check(not need or data["result"], f"{engine.kind}: {what}: no result for {expr}")
        print("fleet dashboard and rules: every query answers on both stores")

        # A resend of everything (cursors moved back while b is stopped):
        # still each point once in both stores.
        before = sent(b)
        b_ports = (b.ingest_port, b.http_port)
        check(b.stop() == 0, "daemon b did not stop cleanly")
        rows = db_rows(b.db, "SELECT count(*) FROM remote_write_cursor")
        check(rows[0][0] == 6, f"cursor rows: {rows}, want a run and an alert cursor a target")
        db_exec(b.db, "UPDATE remote_write_cursor SET pos = -1 WHERE kind = 0")
        db_exec(b.db, "UPDATE remote_write_cursor SET pos = 0 WHERE kind = 1")
        b = start_daemon(args, workdir, "b", (prom, vm), ports=b_ports, heads_to=prom)
        wait_until(lambda: settled(b, TARGETS[True]) and sent(b) > 0, timeout=180,
                   what="the resend")
        for engine in (prom, vm):
            n, pts, _ = compare_soon(engine, b, "job-b", engine is prom)
            print(f"{engine.kind}: job-b after a full resend: {n} series, {pts} points, each once")
        print(f"daemon b sent {before:.0f} samples, then {sent(b):.0f} again")
        for d in (a, b):
            check(rw_metric(d, "foreshock_remote_write_samples_failed_total") == 0,
                  "a receiver refused samples")
            check(rw_metric(d, "foreshock_remote_write_retries_total", "prometheus") == 0,
                  "requests to the Prometheus that stayed up were retried")
            check(d.stop() == 0, "a daemon did not stop cleanly")
    finally:
        kill_started(sim_a, sim_b, a, b, prom.proc, vm.proc)


if __name__ == "__main__":
    run_main(test)
