"""One daemon for the whole job, reached over the network: ingest over TLS
(OpenSSL on the libuv loop) with client certificates checked against a CA,
HTTPS (libmicrohttpd's TLS), per-run tokens. A throwaway CA and
certificates are made with the openssl CLI. Four ranks of a MoE job stream
over mutual TLS and every router series is computed with 0 incomplete
steps; a rank that trusts another CA, one whose certificate another CA
signed, one without a certificate and one speaking plain TCP are refused;
a per-run token admits its own runs and no other; the Python client speaks
TLS through libforeshock; the HTTP API answers over HTTPS (curl --cacert)
and not in the clear."""
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request

import fstest
from fstest import Daemon, check, run_main

ROUTER_SERIES = ["router.similarity", "router.centered_energy", "router.kappa", "router.erank",
                 "router.srank", "router.entropy", "router.entropy_norm",
                 "router.entropy_spread", "router.maxvio", "router.load_entropy",
                 "router.dead_experts", "router.balance", "router.zloss"]
GLOBAL_TOKEN = "global-token-0123"
TEAM_A_TOKEN = "team-a-token-4567"


def make_pki(d):
    """ca, a rogue ca; server (localhost, 127.0.0.1), client and badclient
    (signed by the rogue CA) certificates, EC P-256."""
    def run(*cmd):
        subprocess.run(cmd, cwd=d, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)

    def key(name):
        run("openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-out", f"{name}.key")

    for ca in ("ca", "rogue"):
        key(ca)
        run("openssl", "req", "-x509", "-new", "-key", f"{ca}.key", "-out", f"{ca}.pem",
            "-days", "2", "-subj", f"/CN=foreshock-test-{ca}")
    for serial, (name, cn, ext, ca) in enumerate((
            ("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
             "extendedKeyUsage=serverAuth\n", "ca"),
            ("client", "rank", "extendedKeyUsage=clientAuth\n", "ca"),
            ("badclient", "rank", "extendedKeyUsage=clientAuth\n", "rogue")), start=1):
        key(name)
        run("openssl", "req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={cn}")
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext)
        run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey",
            f"{ca}.key", "-set_serial", str(serial), "-days", "2", "-out", f"{name}.pem",
            "-extfile", f"{name}.ext")
    return {n: os.path.join(d, n) for n in os.listdir(d)}


def simulate(args, endpoint, run, token, tls, extra=(), ranks=1, steps=20, timeout_s=60):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", endpoint,
           "--run", run, "--ranks", str(ranks), "--steps", str(steps), "--layers", "2",
           "--heads", "2", "--dh", "8", "--d", "32", "--sketch-every", "5",
           "--flush-timeout", "60" if ranks > 1 else "4", "--token", token] + list(tls) + \
        list(extra)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout_s)
    return p.returncode, p.stdout


class HttpsDaemon(Daemon):
    def url(self, path):
        return f"https://localhost:{self.http_port}{path}"

    def get(self, path, expect=200):
        ctx = ssl.create_default_context(cafile=self.cafile)
        with urllib.request.urlopen(self.url(path), timeout=30, context=ctx) as r:
            check(r.status == expect, f"GET {path}: {r.status}")
            return json.loads(r.read())


def test(args, workdir):
    pki_dir = os.path.join(workdir, "pki")
    os.makedirs(pki_dir)
    pki = make_pki(pki_dir)
    conf = os.path.join(workdir, "tls.conf")
    with open(conf, "w") as f:
        f.write(f"""token = {GLOBAL_TOKEN}
tls_cert = {pki['server.pem']}
tls_key = {pki['server.key']}
tls_client_ca = {pki['ca.pem']}
http_tls_cert = {pki['server.pem']}
http_tls_key = {pki['server.key']}
reduce_timeout_s = 30

[run "team-a-*"]
token = {TEAM_A_TOKEN}
""")
    mtls = ["--tls-ca", pki["ca.pem"], "--tls-cert", pki["client.pem"],
            "--tls-key", pki["client.key"]]
    d = HttpsDaemon(args.build_dir, workdir, config=conf)
    d.cafile = pki["ca.pem"]
    try:
        # The name in the certificate is checked: localhost, by name.
        ep = f"localhost:{d.ingest_port}"
        rc, out = simulate(args, ep, "job-1", GLOBAL_TOKEN, mtls, ranks=4, steps=60,
                           extra=["--experts", "4"], timeout_s=300)
        check(rc == 0, f"4 ranks over mutual TLS: exit {rc}\n{out[-2000:]}")
        last = 59
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ser = d.get("/api/v1/series?run=job-1&name=router.zloss")["series"]
            if ser and all(s["last_step"] == last for s in ser):
                break
            time.sleep(0.2)
        for name in ROUTER_SERIES:
            ser = d.get(f"/api/v1/series?run=job-1&name={name}")["series"]
            check(len(ser) == 2 and all(s["points"] > 0 for s in ser), f"{name}: {ser}")
        inc = d.get("/api/v1/runs/job-1/incomplete")["incomplete"]
        check(inc == [], f"incomplete steps over TLS: {inc[:4]}")

        refusals = [
            ("a rank trusting another CA", "job-2",
             ["--tls-ca", pki["rogue.pem"], "--tls-cert", pki["client.pem"],
              "--tls-key", pki["client.key"]], "certificate"),
            ("a certificate another CA signed", "job-3",
             ["--tls-ca", pki["ca.pem"], "--tls-cert", pki["badclient.pem"],
              "--tls-key", pki["badclient.key"]], "unknown ca"),
            ("no client certificate", "job-4", ["--tls-ca", pki["ca.pem"]], "certificate"),
            ("plain TCP", "job-5", [], "closed"),
        ]
        for what, run, tls, says in refusals:
            rc, out = simulate(args, ep, run, GLOBAL_TOKEN, tls)
            check(rc == 1 and says in out and "acked=0" in out,
                  f"{what}: exit {rc}, expected a refusal naming '{says}':\n{out[-1500:]}")
        runs = {r["id"] for r in d.get("/api/v1/runs")["runs"]}
        check(runs == {"job-1"}, f"refused ranks created runs: {runs}")

        # Per-run tokens: team-a-* runs need the team's token, others the global one.
        for run, token, ok in (("team-a-7", TEAM_A_TOKEN, True), ("team-a-8", GLOBAL_TOKEN, False),
                               ("other-1", TEAM_A_TOKEN, False), ("other-2", GLOBAL_TOKEN, True)):
            rc, out = simulate(args, ep, run, token, mtls)
            if ok:
                check(rc == 0, f"{run} with its token: exit {rc}\n{out[-1500:]}")
            else:
                check(rc == 1 and "token missing or wrong" in out,
                      f"{run} with another run's token was not refused:\n{out[-1500:]}")

        # The Python client through libforeshock, over mutual TLS.
        sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
        from foreshock._lib import Client
        from foreshock.report import Report
        cl = Client("127.0.0.1", d.ingest_port, "py-tls", token=GLOBAL_TOKEN,
                    lib_path=os.path.join(args.build_dir, "libforeshock.so"),
                    tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"])
        rep = Report(step=0)
        rep.scalars["loss"] = 1.5
        check(cl.submit(rep) == 0, "python submit")
        check(cl.flush(30) == 0, f"python client over TLS: {cl.stats()}")
        cl.close(5)

        # HTTPS: curl with the CA; without it, and in the clear, nothing.
        # (Not with the sanitizer runtime preloaded into this process.)
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        url = f"https://localhost:{d.http_port}/api/v1/runs"
        p = subprocess.run(["curl", "-sS", "--cacert", pki["ca.pem"], url],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60, env=env)
        check(p.returncode == 0 and "job-1" in p.stdout, f"curl --cacert: {p.stdout[:500]}")
        p = subprocess.run(["curl", "-sS", url], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60, env=env)
        check(p.returncode != 0, "curl trusted the daemon without its CA")
        p = subprocess.run(["curl", "-sS", f"http://localhost:{d.http_port}/healthz"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60, env=env)
        check(p.returncode != 0 or "ok" not in p.stdout, "plain HTTP answered on the HTTPS port")
        metrics = subprocess.run(["curl", "-sS", "--cacert", pki["ca.pem"],
                                  f"https://localhost:{d.http_port}/metrics"],
                                 stdout=subprocess.PIPE, text=True, timeout=60, env=env).stdout
        fails = [l for l in metrics.splitlines() if l.startswith("foreshock_tls_failures_total")]
        check(fails and float(fails[0].split()[-1]) >= 3, f"tls failures metric: {fails}")
    finally:
        d.stop()


if __name__ == "__main__":
    fstest.preload_sanitizers()
    run_main(test)
