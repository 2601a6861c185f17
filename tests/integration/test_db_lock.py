"""One daemon per database (hardening item 5): a second foreshockd on the
same database refuses to start with a clear message naming the first one's
pid, instead of splitting streams and paging twice; once the first is gone
(even by SIGKILL) a new one starts."""
import subprocess
import os

from fstest import Daemon, check, kill_started, run_main


def test(args, workdir):
    first = Daemon(args.build_dir, workdir)
    try:
        p = subprocess.run([os.path.join(args.build_dir, "foreshockd"), "--listen",
                            "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", first.db],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60)
        check(p.returncode != 0, "a second daemon on the same database started")
        check(f"in use by another foreshockd (pid {first.pid})" in p.stdout,
              f"unclear refusal: {p.stdout[-500:]}")
        first.kill()
        again = Daemon(args.build_dir, workdir, db=first.db)
        check(again.stop() == 0, "the daemon after the first did not stop cleanly")
    finally:
        kill_started(first)


if __name__ == "__main__":
    run_main(test)
