"""GET /metrics while the simulator streams into the daemon: every scrape
passes `promtool check metrics`, and at the end the values agree with the
simulator and the JSON API (reports committed = reports acked, a run's
last step, open alerts, a monitor's latest value)."""
import os
import re
import subprocess
import time
import urllib.request

from fstest import Daemon, check, kill_started, parse_simulate_summary, run_main

RANKS = 2
STEPS = 600
RATE = 100            # reports per second per rank: the load lasts >= 6 s
MIN_SCRAPES_DURING_LOAD = 3
RUN = "metrics-run"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
AGREE_DEADLINE_S = 120

SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(d, workdir, n):
    with urllib.request.urlopen(d.url("/metrics"), timeout=30) as r:
        check(r.status == 200, f"/metrics status {r.status}")
        ctype = r.headers.get("Content-Type")
        check(ctype == CONTENT_TYPE, f"/metrics Content-Type {ctype!r}")
        text = r.read().decode()
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    if p.returncode != 0:
        path = os.path.join(workdir, f"scrape-{n}.txt")
        with open(path, "w") as f:
            f.write(text)
        check(False, f"promtool check metrics failed on scrape {n}:\n{p.stdout}{p.stderr}")
    return text


def parse(text):
    """{(name, frozenset(labels)): value}"""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        check(m is not None, f"unparsable sample line: {line!r}")
        labels = frozenset(LABEL_RE.findall(m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def agree(d, workdir, what, fn):
    """Polls until fn(samples) returns (True, _) or the deadline passes."""
    deadline = time.monotonic() + AGREE_DEADLINE_S
    while True:
        ok, detail = fn(parse(scrape(d, workdir, "agree")))
        if ok:
            return
        check(time.monotonic() < deadline, f"{what}: no agreement: {detail}")
        time.sleep(0.2)


def test(args, workdir):
    d = Daemon(args.build_dir, workdir)
    sim = None
    try:
        first = parse(scrape(d, workdir, 0))
        info = [(dict(k[1]), v) for k, v in first.items() if k[0] == "foreshock_build_info"]
        check(len(info) == 1 and info[0][1] == 1 and info[0][0].get("version"),
              f"build_info: {info}")
        check(value(first, "foreshock_ready") == 1, "not ready")
        check(value(first, "foreshock_reports_committed_total") == 0, "reports before any load")

        sim = subprocess.Popen(
            [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
             "--run", RUN, "--ranks", str(RANKS), "--steps", str(STEPS), "--rate", str(RATE),
             "--layers", "2", "--heads", "2", "--dh", "8", "--d", "32",
             "--sketch-every", "10", "--experts", "4"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        during, last_committed = 0, 0
        while sim.poll() is None:
            s = parse(scrape(d, workdir, during + 1))
            c = value(s, "foreshock_reports_committed_total")
            check(c is not None and c >= last_committed, f"reports_committed went {last_committed}"
                  f" -> {c}")
            last_committed = c
            if sim.poll() is None:
                during += 1
        out = sim.stdout.read()
        print(out[-1500:])
        check(sim.returncode == 0, f"simulate exited {sim.returncode}")
        check(during >= MIN_SCRAPES_DURING_LOAD,
              f"only {during} scrapes while the simulator ran (rate-limited to >= "
              f"{STEPS // RATE} s)")
        summ = parse_simulate_summary(out)
        check(summ["acked"] == RANKS * STEPS, f"acked {summ['acked']}")

        s = parse(scrape(d, workdir, "end"))
        committed = value(s, "foreshock_reports_committed_total")
        check(committed == summ["acked"],
              f"reports_committed_total {committed} != acked {summ['acked']}")
        check(value(s, "foreshock_reports_duplicate_total") == 0, "duplicates")
        check(value(s, "foreshock_reports_received_total") >= committed, "received < committed")
        check(value(s, "foreshock_commits_total") > 0, "no commits")
        check(value(s, "foreshock_commit_duration_seconds_count") > 0, "empty commit histogram")
        check(value(s, "foreshock_http_requests_total") > during, "http_requests_total")
        run = d.get(f"/api/v1/runs/{RUN}")["run"]
        check(value(s, "foreshock_run_last_step", run=RUN) == run["last_step"] == STEPS - 1,
              f"run_last_step {value(s, 'foreshock_run_last_step', run=RUN)} vs API {run}")
        check(value(s, "foreshock_silences_active") == 0, "silences_active")
        for k in s:
            check(not (k[0] == "foreshock_monitor_value" and "head" in dict(k[1])),
                  f"a per-head series in foreshock_monitor_value: {k}")

        # the latest loss of the lowest rank
        loss = d.get(f"/api/v1/series?run={RUN}&name=loss&rank=0")["series"][0]
        pts = d.get(f"/api/v1/series/{loss['id']}/points?from={STEPS - 1}&to={STEPS - 1}")
        want_loss = pts["points"][0][1]
        got = value(s, "foreshock_run_loss", run=RUN)
        check(got is not None and abs(got - want_loss) <= 1e-9 * max(1, abs(want_loss)),
              f"run_loss {got} vs API {want_loss}")

        # open alerts by state agree with the API (the monitor stage may
        # still be finishing the last steps: poll)
        def alerts_agree(sm):
            doc = d.get("/api/v1/alerts?state=open&limit=10000")
            api = {}
            for a in doc["alerts"]:
                key = (a["state"], a["severity"])
                api[key] = api.get(key, 0) + 1
            mine = {(st, sv): value(sm, "foreshock_alerts", state=st, severity=sv)
                    for st in ("pending", "firing") for sv in ("warning", "critical")}
            return all(mine[k] == api.get(k, 0) for k in mine), (mine, api)
        agree(d, workdir, "foreshock_alerts vs /api/v1/alerts", alerts_agree)

        # a per-layer monitor series: the metric equals the API's last point
        ser = d.get(f"/api/v1/series?run={RUN}&name=router.maxvio&layer=0")["series"]
        check(len(ser) == 1, f"router.maxvio layer 0: {ser}")

        def monitor_agrees(sm):
            x = d.get(f"/api/v1/series?run={RUN}&name=router.maxvio&layer=0")["series"][0]
            p = d.get(f"/api/v1/series/{x['id']}/points?from={x['last_step']}"
                      f"&to={x['last_step']}")["points"][0][1]
            got = value(sm, "foreshock_monitor_value", run=RUN, layer="0",
                        monitor="router.maxvio")
            return got is not None and p is not None and abs(got - p) <= 1e-9 * max(1, abs(p)), \
                (got, p)
        agree(d, workdir, "monitor_value vs the series' last point", monitor_agrees)

        # metrics_max_runs = 0: no per-run families' samples
        check(d.stop() == 0, "daemon did not exit 0")
        d = Daemon(args.build_dir, workdir, extra=["--set", "metrics_max_runs=0"])
        s = parse(scrape(d, workdir, "no-runs"))
        check(not any(k[0] in ("foreshock_run_last_step", "foreshock_run_loss",
                               "foreshock_monitor_value") for k in s),
              "per-run samples with metrics_max_runs=0")
        check(d.stop() == 0, "daemon did not exit 0")
    finally:
        kill_started(sim, d)


if __name__ == "__main__":
    run_main(test)
