"""Silent HTTP connections cannot stall the API (hardening item 4): one
address holding many connections that never send a request is capped per
address, so /healthz from another address is answered at once; the silent
connections are closed after the idle timeout. Loopback only: 127.0.0.1
holds the silent connections, 127.0.0.2 asks (both are this machine)."""
import http.client
import resource
import socket

from fstest import Daemon, check, kill_started, run_main

SILENT = 1100  # past the global limit (1024): without a per-address cap the API stalls


class SourceHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection from a chosen loopback source address."""

    def __init__(self, host, port, source, timeout):
        super().__init__(host, port, timeout=timeout, source_address=(source, 0))


def test(args, workdir):
    # Room for the silent sockets here and in the daemon (which inherits it).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = SILENT + 512
    check(hard == resource.RLIM_INFINITY or hard >= want,
          f"RLIMIT_NOFILE hard limit {hard} is below {want}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    d = Daemon(args.build_dir, workdir)
    silent = []
    try:
        for _ in range(SILENT):
            s = socket.socket()
            s.settimeout(30)
            try:
                s.connect(("127.0.0.1", d.http_port))
            except OSError:
                s.close()
                continue
            silent.append(s)
        # From another loopback address, the API answers; the timeout only
        # bounds a broken test, the verdict is the answer itself.
        c = SourceHTTPConnection("127.0.0.1", d.http_port, "127.0.0.2", timeout=5)
        c.request("GET", "/healthz")
        r = c.getresponse()
        check(r.status == 200, f"/healthz answered {r.status}")
        r.read()
        c.close()
        # Connections past the per-address limit were closed by the daemon.
        closed = 0
        for s in silent:
            s.settimeout(30)
            try:
                if s.recv(1) == b"":
                    closed += 1
            except OSError:
                closed += 1
        check(closed == len(silent), f"only {closed} of {len(silent)} silent connections closed")
        check(d.stop() == 0, "daemon did not exit 0 on SIGTERM")
    finally:
        for s in silent:
            s.close()
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
