"""Remote write over TLS with a client certificate and HTTP basic auth, into
a Prometheus whose web config requires both (throwaway CA from the openssl
CLI, a bcrypt password hash). One daemon, four [remote_write] targets:

- "good": the CA, the client certificate and the right password: every
  point of the run arrives;
- "badpw": the wrong password: the receiver answers 401, which is not
  retried: the batch is logged with the status, counted in
  foreshock_remote_write_samples_failed_total, and passed (its cursor moves);
- "headers": a bearer token and a tenant, to a receiver in the test that
  records the request headers;
- "nocert": no client certificate: the TLS handshake fails, a network
  error, retried with backoff for as long as it lasts: its cursor stays.

A bad [remote_write] section stops the daemon at startup with status 2."""
import base64
import json
import os
import ssl
import subprocess
import urllib.parse
import urllib.request
import warnings

with warnings.catch_warnings():  # deprecated in 3.11, gone in 3.13: bcrypt hashes for the test
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import crypt
    except ImportError:
        crypt = None

from fstest import (Daemon, Receiver, Skip, check, db_rows, kill_started, metrics,
                    parse_simulate_summary, run_main, wait_until)
from test_remote_write import free_port, rw_metric
from test_tls import make_pki

PASSWORD = "s3cret-remote-write"
STEPS = 40


def test(args, workdir):
    if crypt is None or not crypt.mksalt(crypt.METHOD_BLOWFISH):
        raise Skip("this Python has no crypt module with bcrypt (Prometheus's basic auth hashes)")
    # A bad section: exit 2 with the reason.
    bad = os.path.join(workdir, "bad.conf")
    with open(bad, "w") as f:
        f.write('[remote_write "x"]\nurl = http://127.0.0.1:1/api/v1/write\nlabels = run=a\n')
    p = subprocess.run([os.path.join(args.build_dir, "foreshockd"), "--config", bad,
                        "--db", os.path.join(workdir, "bad.db")],
                       capture_output=True, text=True, timeout=60)
    check(p.returncode == 2 and "label 'run' is set by the daemon" in p.stderr,
          f"bad [remote_write]: exit {p.returncode}: {p.stderr}")

    pki_dir = os.path.join(workdir, "pki")
    os.makedirs(pki_dir)
    pki = make_pki(pki_dir)
    web = os.path.join(workdir, "web.yml")
    with open(web, "w") as f:
        f.write(f"tls_server_config:\n  cert_file: {pki['server.pem']}\n"
                f"  key_file: {pki['server.key']}\n"
                "  client_auth_type: RequireAndVerifyClientCert\n"
                f"  client_ca_file: {pki['ca.pem']}\n"
                "basic_auth_users:\n"
                f"  fs: '{crypt.crypt(PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH))}'\n")
    conf = os.path.join(workdir, "prometheus.yml")
    with open(conf, "w") as f:
        f.write("global: {}\n")
    port = free_port()
    prom = d = None
    headers = Receiver()  # "headers": bearer token and tenant, to a receiver that records them
    try:
        prom = subprocess.Popen(
            ["prometheus", f"--config.file={conf}", f"--web.config.file={web}",
             f"--storage.tsdb.path={workdir}/prom", f"--web.listen-address=127.0.0.1:{port}",
             "--web.enable-remote-write-receiver"],
            stdout=open(os.path.join(workdir, "prometheus.log"), "w"), stderr=subprocess.STDOUT)
        ctx = ssl.create_default_context(cafile=pki["ca.pem"])
        ctx.load_cert_chain(pki["client.pem"], pki["client.key"])
        auth = "Basic " + base64.b64encode(f"fs:{PASSWORD}".encode()).decode()

        def get(path):
            r = urllib.request.Request(f"https://127.0.0.1:{port}{path}",
                                       headers={"Authorization": auth})
            with urllib.request.urlopen(r, context=ctx, timeout=10) as resp:
                return json.loads(resp.read()) if path.startswith("/api") else resp.status

        def ready():
            check(prom.poll() is None, f"prometheus exited {prom.returncode}")
            try:
                return get("/-/ready") == 200
            except OSError:
                return False
        wait_until(ready, timeout=60, what="prometheus ready over TLS")

        pw, wrong = os.path.join(workdir, "pw"), os.path.join(workdir, "wrong")
        with open(pw, "w") as f:
            f.write(PASSWORD + "\n")
        with open(wrong, "w") as f:
            f.write("not-the-password\n")
        url = f"https://127.0.0.1:{port}/api/v1/write"
        dconf = os.path.join(workdir, "foreshockd.conf")
        with open(dconf, "w") as f:
            for name, pwfile, cert in (("good", pw, True), ("badpw", wrong, True),
                                       ("nocert", pw, False)):
                f.write(f'[remote_write "{name}"]\nurl = {url}\ntls_ca = {pki["ca.pem"]}\n'
                        f"basic_auth_user = fs\nbasic_auth_password_file = {pwfile}\n"
                        "timeout = 5\n")
                if cert:
                    f.write(f"tls_cert = {pki['client.pem']}\ntls_key = {pki['client.key']}\n")
            token = os.path.join(workdir, "token")
            with open(token, "w") as t:
                t.write("tok-123\n")
            f.write(f'[remote_write "headers"]\nurl = {headers.url}/api/v1/write\n'
                    f"bearer_token_file = {token}\ntenant = team-a\n")
        d = Daemon(args.build_dir, workdir, config=dconf)
        sim = subprocess.run(
            [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
             "--run", "tls-run", "--ranks", "2", "--steps", str(STEPS), "--no-sketches",
             "--flush-timeout", "120"], capture_output=True, text=True, timeout=300)
        s = parse_simulate_summary(sim.stdout + sim.stderr)
        check(sim.returncode == 0 and s["acked"] == 2 * STEPS, f"simulate: {s}")

        def cursor(target):
            rows = db_rows(d.db, "SELECT pos FROM remote_write_cursor WHERE target = ? AND "
                                 "kind = 0", (target,))
            return rows[0][0] if rows else -1
        wait_until(lambda: cursor("good") == STEPS - 1 and cursor("badpw") == STEPS - 1,
                   timeout=120, what="good and badpw cursors at the end")
        doc = get("/api/v1/query?" + urllib.parse.urlencode(
            {"query": 'count_over_time(foreshock_loss{run="tls-run"}[1h])'}))
        counts = sorted((r["metric"]["rank"], r["value"][1]) for r in doc["data"]["result"])
        check(counts == [("0", str(STEPS)), ("1", str(STEPS))], f"loss samples: {counts}")

        reqs = headers.wait_for(lambda r: r, what="a request with the headers")
        h = {k.lower(): v for k, v in reqs[0]["headers"].items()}
        want = {"authorization": "Bearer tok-123", "x-scope-orgid": "team-a",
                "content-encoding": "snappy", "content-type": "application/x-protobuf",
                "x-prometheus-remote-write-version": "0.1.0"}
        check(all(h.get(k) == v for k, v in want.items()), f"headers: {h}")

        failed = "foreshock_remote_write_samples_failed_total"
        check(rw_metric(d, failed, "badpw") == 2 * 6 * STEPS,
              f"badpw: {rw_metric(d, failed, 'badpw')} samples counted failed, want every one")
        check(rw_metric(d, failed, "good") == 0 and rw_metric(d, failed, "nocert") == 0,
              "good or nocert counted failed samples")
        wait_until(lambda: rw_metric(d, "foreshock_remote_write_retries_total", "nocert") > 0,
                   timeout=60, what="nocert retrying")
        check("[nocert]" in d.log_text() and "retrying" in d.log_text(), "no retry logged")
        check(rw_metric(d, "foreshock_remote_write_retries_total", "good") == 0,
              "good was retried")
        check(rw_metric(d, "foreshock_remote_write_pending", "nocert") > 0
              and rw_metric(d, "foreshock_remote_write_pending", "good") == 0,
              "pending: nocert should lag, good not")
        check(cursor("nocert") == -1, f"nocert's cursor moved: {cursor('nocert')}")
        log = d.log_text()
        check("[badpw]" in log and "HTTP 401 (not retried)" in log, "no 401 logged for badpw")
        check(PASSWORD not in log, "the password is in the log")
        print(f"good: {STEPS} loss samples per rank over TLS + basic auth; badpw: 401 counted "
              f"({rw_metric(d, failed, 'badpw'):.0f} samples), passed; "
              "nocert: retried, cursor held")
        check(d.stop() == 0, "daemon did not stop cleanly")
    finally:
        kill_started(d, prom)
        headers.close()


if __name__ == "__main__":
    run_main(test)
