"""A bad HTTPS certificate or key fails the start with the file's path and
what is wrong with it (issue 22, Medium). The daemon used to say only
"http: cannot listen on HOST:PORT": libmicrohttpd refuses to start on a
certificate it cannot use and says why only to its logger. The files are
now checked as ingest's are (daemon/tls.c) before libmicrohttpd starts.
Certificates are made with the openssl CLI."""
import os
import subprocess

import fstest
from fstest import check, run_main


def openssl(*cmd):
    subprocess.run(["openssl", *cmd], check=True, capture_output=True)


def start(args, workdir, name, cert, key):
    """Runs foreshockd with these HTTPS files; returns (exit code, log)."""
    conf = os.path.join(workdir, f"{name}.conf")
    with open(conf, "w") as f:
        f.write(f"http_tls_cert = {cert}\nhttp_tls_key = {key}\n")
    log = os.path.join(workdir, f"{name}.log")
    with open(log, "w") as f:
        p = subprocess.Popen([os.path.join(args.build_dir, "foreshockd"), "--listen",
                              "127.0.0.1:0", "--http", "127.0.0.1:0", "--db",
                              os.path.join(workdir, f"{name}.db"), "--config", conf],
                             stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=120)  # a hang guard, not a latency verdict
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
    with open(log) as f:
        return rc, f.read()


def test(args, workdir):
    def path(n):
        return os.path.join(workdir, n)
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", path("key.pem"), "-out", path("cert.pem"), "-subj", "/CN=localhost",
            "-days", "2")
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
            path("other.key"))
    with open(path("garbage.pem"), "w") as f:
        f.write("not a PEM file\n")
    cases = [
        # name, cert, key, the file the error must name, words of the reason
        ("garbage-cert", path("garbage.pem"), path("key.pem"), path("garbage.pem"), "PEM"),
        ("garbage-key", path("cert.pem"), path("garbage.pem"), path("garbage.pem"), "key"),
        ("other-key", path("cert.pem"), path("other.key"), path("other.key"), "mismatch"),
        ("cert-is-key", path("key.pem"), path("key.pem"), path("key.pem"), "certificate"),
    ]
    for name, cert, key, named, why in cases:
        rc, text = start(args, workdir, name, cert, key)
        errors = [l for l in text.splitlines() if " error " in l]
        check(rc == 1, f"{name}: exit {rc} (None: it hung), expected 1:\n{text}")
        check(any("http_tls_cert" in l and named in l and why in l for l in errors),
              f"{name}: no error naming {named} and '{why}':\n{text}")
        check("cannot listen" not in text, f"{name}: still blames the listener:\n{text}")
        print(f"{name}: {errors[-1].split(' error ', 1)[1]}", flush=True)
    # The good pair starts (the checks above are about the files).
    conf = path("good.conf")
    with open(conf, "w") as f:
        f.write(f"http_tls_cert = {path('cert.pem')}\nhttp_tls_key = {path('key.pem')}\n")
    d = fstest.Daemon(args.build_dir, workdir, config=conf)
    try:
        check(d.stop() == 0, "good pair: daemon exit code")
    finally:
        fstest.kill_started(d)


if __name__ == "__main__":
    run_main(test)
