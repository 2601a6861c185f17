"""A start that fails after the ingest listener is bound exits 1 with the
reason: here the HTTP address is taken by another socket. The daemon used
to hang in that case (the monitor stage's sweep timer kept its closing loop
running), so a supervisor waited for its stop timeout instead of seeing the
failure."""
import os
import socket
import subprocess

from fstest import check, run_main


def test(args, workdir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    log = os.path.join(workdir, "foreshockd.log")
    with open(log, "w") as f:
        p = subprocess.Popen([os.path.join(args.build_dir, "foreshockd"), "--listen",
                              "127.0.0.1:0", "--http", f"127.0.0.1:{port}", "--db",
                              os.path.join(workdir, "f.db")], stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=120)  # a hang guard, not a latency verdict
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
    taken.close()
    with open(log) as f:
        text = f.read()
    check(rc == 1, f"foreshockd with its HTTP address taken: exit {rc} (None: it hung)\n{text}")
    check("cannot listen" in text, f"no reason logged:\n{text}")
    print("HTTP address taken: exit 1, reason logged")


if __name__ == "__main__":
    run_main(test)
