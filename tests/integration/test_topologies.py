"""The issue's acceptance run: a simulated 4-node x 8-rank MoE job through
each documented topology produces every router and attention series with 0
incomplete steps.

- A daemon per node: four daemons, each hearing its node's 8 ranks of the
  32 (the model sharded over the node, its ranks declared as the local
  group); each computes every series over its group, with the group's
  lowest rank as lead.
- One daemon for the job, over mutual TLS: all 32 ranks stream to it.
"""
import os
import subprocess
import time

from fstest import Daemon, check, run_main
from test_tls import HttpsDaemon, make_pki

NODES, PER_NODE = 4, 8
STEPS = 40
ROUTER = ["router.similarity", "router.centered_energy", "router.kappa", "router.erank",
          "router.srank", "router.entropy", "router.entropy_norm", "router.entropy_spread",
          "router.maxvio", "router.load_entropy", "router.dead_experts", "router.balance",
          "router.zloss"]
ATTENTION = ["qk.d2.entropy", "qk.d2.erank", "qk.d2.srank", "qk.d3.erank", "qk.cqk",
             "qk.d2.erank.min", "qk.cqk.max"]
MODEL = ["--experts", "4", "--layers", "2", "--heads", "2", "--dh", "8", "--d", "64",
         "--steps", str(STEPS), "--sketch-every", "5", "--flush-timeout", "120"]


def start_sim(args, endpoint, ranks, extra):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", endpoint,
           "--run", "big", "--ranks", str(ranks)] + MODEL + list(extra)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p):
    out, _ = p.communicate(timeout=600)
    check(p.returncode == 0, f"simulate exited {p.returncode}:\n{out[-2000:]}")


def complete(d, what):
    """Every router and attention series up to the last step, nothing incomplete."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ser = d.get("/api/v1/series?run=big&name=router.zloss")["series"]
        if len(ser) == 2 and all(s["last_step"] == STEPS - 1 for s in ser):
            break
        time.sleep(0.2)
    for name in ROUTER + ATTENTION:
        ser = d.get(f"/api/v1/series?run=big&name={name}")["series"]
        check(ser and all(s["points"] > 0 for s in ser), f"{what}: series {name}: {ser}")
    run = d.get("/api/v1/runs/big")["run"]
    inc = d.get("/api/v1/runs/big/incomplete")["incomplete"]
    check(run["incomplete"] == 0 and inc == [], f"{what}: incomplete steps {inc[:4]}")
    return run


def test(args, workdir):
    # A daemon per node.
    daemons = []
    try:
        for n in range(NODES):
            sub = os.path.join(workdir, f"node{n}")
            os.makedirs(sub)
            daemons.append(Daemon(args.build_dir, sub))
        sims = [start_sim(args, d.endpoint, PER_NODE,
                          ["--world-size", str(NODES * PER_NODE), "--first-rank",
                           str(n * PER_NODE), "--local-group"])
                for n, d in enumerate(daemons)]
        for p in sims:
            finish(p)
        for n, d in enumerate(daemons):
            run = complete(d, f"node {n}")
            topo = run["topology"]
            first = n * PER_NODE
            check(topo and topo["local_ranks"] == f"{first}-{first + PER_NODE - 1}" and
                  topo["lead_rank"] == first, f"node {n}: topology {topo}")
    finally:
        for d in daemons:
            d.stop()

    # One daemon for the job, every rank over mutual TLS.
    pki_dir = os.path.join(workdir, "pki")
    os.makedirs(pki_dir)
    pki = make_pki(pki_dir)
    conf = os.path.join(workdir, "job.conf")
    with open(conf, "w") as f:
        f.write(f"tls_cert = {pki['server.pem']}\ntls_key = {pki['server.key']}\n"
                f"tls_client_ca = {pki['ca.pem']}\nhttp_tls_cert = {pki['server.pem']}\n"
                f"http_tls_key = {pki['server.key']}\n")
    sub = os.path.join(workdir, "job")
    os.makedirs(sub)
    d = HttpsDaemon(args.build_dir, sub, config=conf)
    d.cafile = pki["ca.pem"]
    try:
        finish(start_sim(args, f"localhost:{d.ingest_port}", NODES * PER_NODE,
                         ["--tls-ca", pki["ca.pem"], "--tls-cert", pki["client.pem"],
                          "--tls-key", pki["client.key"]]))
        run = complete(d, "per-job daemon")
        check(run["topology"] is None and run["streams"] == NODES * PER_NODE,
              f"per-job daemon: {run['streams']} streams, topology {run['topology']}")
    finally:
        d.stop()


if __name__ == "__main__":
    run_main(test)
