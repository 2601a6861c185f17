"""Half-open HTTPS handshakes cost no CPU. A client that sends the first
bytes of a TLS ClientHello to the HTTPS port and then nothing more made a
libmicrohttpd worker spin until the idle timeout closed the connection: in
its epoll mode (what MHD_USE_AUTO picks on Linux) libmicrohttpd 0.9.75 keeps
a connection whose gnutls_handshake returned GNUTLS_E_AGAIN on its
ready list, so the worker alternated epoll_wait(..., 0) and a recv that
returned EAGAIN, about 1 s of CPU per second per worker (daemon/http.c now
asks for poll()).

Resource bound, not speed: with HALF_OPEN such connections held and nothing
else to do, the daemon's CPU time (utime + stime from /proc/PID/stat) over
IDLE_S seconds stays under CPU_BOUND_S (the spin used about IDLE_S per
worker it reached); a complete HTTPS request still gets its answer while
they are held, and the half-open ones are still open (the bound was
measured while they were)."""
import os
import socket
import ssl
import time
import urllib.request

from fstest import Daemon, check, kill_started, run_main
from test_tls import make_pki

HALF_OPEN = 4
IDLE_S = 2.0
CPU_BOUND_S = 0.5
# A TLS record header announcing a 512-byte handshake record, and the start
# of a ClientHello in it: the server has to wait for the rest.
PARTIAL_CLIENT_HELLO = bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03])


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def still_open(s):
    """The daemon has not closed s (nothing to read, no EOF)."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def test(args, workdir):
    pki_dir = os.path.join(workdir, "pki")
    os.makedirs(pki_dir)
    pki = make_pki(pki_dir)
    d = Daemon(args.build_dir, workdir,
               extra=["--set", f"http_tls_cert={pki['server.pem']}",
                      "--set", f"http_tls_key={pki['server.key']}"])
    held = []
    try:
        for _ in range(HALF_OPEN):
            s = socket.create_connection(("127.0.0.1", d.http_port), timeout=30)
            s.sendall(PARTIAL_CLIENT_HELLO)
            held.append(s)
        time.sleep(0.2)  # let the workers see the bytes before the window opens
        before = cpu_seconds(d.pid)
        time.sleep(IDLE_S)
        used = cpu_seconds(d.pid) - before
        check(all(still_open(s) for s in held),
              "a half-open handshake was closed within the window: the bound measured nothing")
        ctx = ssl.create_default_context(cafile=pki["ca.pem"])
        with urllib.request.urlopen(f"https://localhost:{d.http_port}/healthz", timeout=30,
                                    context=ctx) as r:
            check(r.status == 200, f"/healthz over HTTPS: {r.status}")
        check(used < CPU_BOUND_S,
              f"{HALF_OPEN} half-open HTTPS handshakes cost {used:.2f} s of CPU in {IDLE_S} s "
              f"idle (bound {CPU_BOUND_S} s): a worker spins")
        print(f"{HALF_OPEN} half-open HTTPS handshakes held {IDLE_S} s: {used:.2f} s CPU")
        for s in held:
            s.close()
        check(d.stop() == 0, "daemon did not exit 0")
    finally:
        for s in held:
            s.close()
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
