"""Paging through a real Alertmanager (API v2). Alertmanager routes to a
webhook receiver run by this test (short group_wait / group_interval, with
send_resolved); the daemon is fed by the simulator with an
attention-numerics fault that stops (--fault-until), so its alerts fire and
then resolve. While firing, `amtool alert query` shows the alert with our
labels (alertname, run, severity, family, signature, layer, window) and
generatorURL; the receiver gets it firing, then resolved. Alertmanager and
the daemon are stopped by PID even on failure."""
import json
import os
import signal
import subprocess
import time
import urllib.request

from fstest import (Daemon, Failure, Receiver, check, db_rows, free_port, kill_started, run_main,
                    wait_until)

AM = "/usr/bin/prometheus-alertmanager"
AMTOOL = "/usr/bin/amtool"
RUN = "am-run"

AM_CONFIG = """
route:
  receiver: rx
  group_by: ['alertname', 'run', 'layer']
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
- name: rx
  webhook_configs:
  - url: {url}/am
    send_resolved: true
"""

CONFIG = """
[target "am"]
type = alertmanager
url = http://127.0.0.1:{port}/
resend_interval = 1
backoff_initial = 0.2
backoff_max = 1
"""



def start_alertmanager(workdir, rx_url):
    conf = os.path.join(workdir, "am.yml")
    with open(conf, "w") as f:
        f.write(AM_CONFIG.format(url=rx_url))
    port = free_port()
    log = open(os.path.join(workdir, "am.log"), "w")
    proc = subprocess.Popen([AM, f"--config.file={conf}",
                             f"--storage.path={os.path.join(workdir, 'am-data')}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=log, stderr=subprocess.STDOUT)

    def ready():
        if proc.poll() is not None:
            raise Failure("alertmanager exited: " + open(log.name).read()[-2000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    try:
        wait_until(ready, timeout=60, what="alertmanager ready")
    except Failure:
        proc.kill()
        proc.wait()
        raise
    return proc, port


def amtool_alerts(port):
    out = subprocess.run([AMTOOL, "alert", "query", f"--alertmanager.url=http://127.0.0.1:{port}",
                          "-o", "json"], capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, f"amtool failed: {out.stderr}")
    return json.loads(out.stdout or "[]")


def test(args, workdir):
    with Receiver() as rx:
        am, am_port = start_alertmanager(workdir, rx.url)
        d = None
        sim = None
        try:
            conf = os.path.join(workdir, "foreshockd.conf")
            with open(conf, "w") as f:
                f.write(CONFIG.format(port=am_port))
            d = Daemon(args.build_dir, workdir, config=conf)
            # --rate keeps the fault on for about 10 s of wall time.
            sim = subprocess.Popen(
                [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
                 "--run", RUN, "--ranks", "2", "--steps", "400", "--layers", "2", "--heads", "4",
                 "--dh", "16", "--d", "128", "--sketch-every", "5", "--scenario",
                 "attention-numerics", "--fault-step", "160", "--fault-until", "260",
                 "--diverge-after", "200", "--rate", "10", "--flush-timeout", "300"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

            def ours():
                return [a for a in amtool_alerts(am_port)
                        if a["labels"].get("run") == RUN
                        and a["labels"].get("alertname", "").startswith("qk.d2.")]
            firing = wait_until(ours, timeout=120, what="our alert in amtool alert query",
                                interval=0.3)
            a = firing[0]
            lab = a["labels"]
            print("amtool:", json.dumps(lab))
            check(lab["signature"] == "attention-numerics" and lab["family"] == "attention_d2"
                  and lab["severity"] in ("warning", "critical") and lab["layer"] in ("0", "1")
                  and lab["window"] == "5" and "head" not in lab, f"labels {lab}")
            check("/api/v1/alerts/" in a["generatorURL"]
                  and a["generatorURL"].startswith(f"http://127.0.0.1:{d.http_port}"),
                  f"generatorURL {a['generatorURL']}")
            check(a["annotations"]["summary"].startswith(lab["alertname"] + " firing"),
                  f"annotations {a['annotations']}")
            name, layer = lab["alertname"], lab["layer"]

            def notes(status):
                return [al for r in rx.snapshot() if r["path"] == "/am" and r["json"]
                        for al in r["json"]["alerts"]
                        if al["labels"].get("alertname") == name
                        and al["labels"].get("layer") == layer and al["status"] == status]
            wait_until(lambda: notes("firing"), timeout=60, what="firing notification")
            out, _ = sim.communicate(timeout=600)
            check(sim.returncode == 0, f"simulate exited {sim.returncode}: {out[-1500:]}")
            resolved = wait_until(lambda: notes("resolved"), timeout=120,
                                  what="resolved notification")
            r = resolved[0]
            check(r["labels"] == lab, f"resolved labels {r['labels']} != {lab}")
            check(r["endsAt"] > r["startsAt"], f"times {r['startsAt']} {r['endsAt']}")
            # The daemon says the same: resolved, and the outbox rows delivered.
            alerts = d.get(f"/api/v1/alerts?run={RUN}")["alerts"]
            check(any(x["rule"] == name and x["state"] == "resolved" for x in alerts),
                  "alert not resolved in the daemon")
            rows = wait_until(lambda: [r for r in [db_rows(d.db, "SELECT kind, state FROM outbox")]
                                       if r and all(s != 0 for _, s in r)],
                              what="every outbox row done")[0]
            check(all(s == 1 for _, s in rows), f"outbox rows {rows}")
            check(d.stop() == 0, "daemon did not stop cleanly")
        finally:
            kill_started(sim, d)
            am.send_signal(signal.SIGTERM)
            try:
                am.wait(timeout=30)
            except subprocess.TimeoutExpired:
                am.kill()
                am.wait()


if __name__ == "__main__":
    run_main(test)
