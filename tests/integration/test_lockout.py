"""A flood from one address cannot lock trainers out (issue 22, Critical 1).

An outside probe held every ingest slot with ~1,080 sockets from one
address, reopened as the daemon closed them: trainers' TLS Hellos failed
(slots were taken before the handshake, so mutual TLS did not help) and
plain-TCP Hellos with a valid token got "connection limit reached". Slots
are now spent on strangers only within max_unauthenticated (and
max_unauthenticated_per_address); when they are full, a newcomer from a
less busy address takes the slot of the busiest address's oldest
unauthenticated connection (daemon/admit.h).

Here FLOOD sockets from 127.0.0.2 (Linux routes all of 127/8 to lo) keep
twice max_connections open and reopen each one the daemon closes; they
never send a Hello, and hello_timeout_s is long, so nothing but admission
frees a slot while the test runs. Once they hold every slot, trainers from
127.0.0.1 connect with a valid token, one at a time: each must be welcomed
and get its report acked, over plain TCP and over mutual TLS, while the
flood goes on. The verdict is the outcome (a Welcome or an Error), not a
time. Third part: with a per-address share below the budget, the flood is
refused by that limit and a trainer needs no eviction at all."""
import os
import select
import socket
import ssl
import threading

from fstest import (Daemon, Failure, RawConn, check, hello, kill_started, metrics, proto_module,
                    report, run_main, wait_until)
from test_tls import make_pki

SLOTS = 32         # max_connections: small, so that a flood of 2 x SLOTS is cheap
FLOOD = 2 * SLOTS  # sockets the flood keeps open
TRAINERS = 3
TOKEN = "lockout-token-0123"
FLOOD_ADDR = "127.0.0.2"


class Flood:
    """FLOOD sockets from FLOOD_ADDR to port, each reopened once the daemon
    closes it (or sends anything: an Error before it closes). Sends
    nothing; a TLS port sees handshakes that never start."""

    def __init__(self, port, n=FLOOD):
        self.port, self.n = port, n
        self.socks = []
        self.opened = 0
        self.stop = threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5,
                                     source_address=(FLOOD_ADDR, 0))
        self.opened += 1
        return s

    def _run(self):
        try:
            self.socks = [self._open() for _ in range(self.n)]
            while not self.stop.is_set():
                ready, _, _ = select.select(self.socks, [], [], 0.02)
                for s in ready:
                    try:
                        s.recv(65536)
                    except OSError:
                        pass
                    s.close()
                    self.socks[self.socks.index(s)] = self._open()
        except Exception as e:  # reported by close()
            self.error = e

    def close(self):
        self.stop.set()
        self.thread.join(timeout=30)
        for s in self.socks:
            s.close()
        check(self.error is None, f"the flood itself failed: {self.error!r}")


def wait_flood_holds(d, holds):
    """The flood holds `holds` slots and was refused beyond them."""
    return wait_until(
        lambda: (lambda m: m if m["foreshock_connections"] >= holds and
                 m["foreshock_connections_rejected_total"] > 0 else None)(metrics(d)),
        timeout=60, what=f"the flood to hold {holds} slots")


def trainer(pb, port, run, ctx=None):
    """A trainer from 127.0.0.1: Hello with the token, Welcome, a report,
    its Ack. Raises Failure with what it got instead."""
    try:
        c = RawConn(pb, port, timeout=30, ssl_context=ctx)
    except (OSError, ssl.SSLError) as e:
        raise Failure(f"{run}: locked out before its Hello: {e!r}") from None
    try:
        c.send(hello(pb, run, token=TOKEN))
        w = c.recv()
        check(w is not None and w.HasField("welcome"), f"{run}: locked out: {w}")
        c.send(report(pb, 1, 0))
        a = c.recv()
        check(a is not None and a.HasField("ack") and a.ack.seq == 1, f"{run}: no Ack: {a}")
    except (OSError, ssl.SSLError) as e:
        raise Failure(f"{run}: connection failed: {e!r}") from None
    return c


def phase(args, workdir, pb, name, extra, ctx=None, holds=SLOTS):
    d = Daemon(args.build_dir, workdir,
               extra=["--set", f"token={TOKEN}", "--set", f"max_connections={SLOTS}",
                      "--set", "hello_timeout_s=600"] + list(extra))
    flood, kept = None, []
    try:
        flood = Flood(d.ingest_port)
        before = wait_flood_holds(d, holds)
        for i in range(TRAINERS):
            kept.append(trainer(pb, d.ingest_port, f"{name}-{i}", ctx))
        m = metrics(d)
        check(flood.opened > FLOOD, f"{name}: the flood never reopened a socket")
        evicted = m["foreshock_ingest_evicted_total"]
        if holds == SLOTS:
            check(evicted >= TRAINERS,
                  f"{name}: {evicted:.0f} evictions for {TRAINERS} trainers in a full daemon")
        else:
            check(evicted == 0, f"{name}: {evicted:.0f} evictions with room left")
        check(m["foreshock_ingest_unauthenticated"] <= SLOTS, f"{name}: {m}")
        flood.close()
        flood = None
        # The counters by reason and the total are separate atomics: while
        # the flood runs a scrape can fall between their increments. Once
        # it stopped, two scrapes in a row that agree are a settled state.
        keys = [f'foreshock_ingest_refused_total{{reason="{r}"}}'
                for r in ("max_connections", "per_address", "unauthenticated")]
        keys.append("foreshock_connections_rejected_total")
        m, prev = metrics(d), None
        for _ in range(100):
            if prev is not None and all(m[k] == prev[k] for k in keys):
                break
            prev, m = m, metrics(d)
        refused = {r: m[f'foreshock_ingest_refused_total{{reason="{r}"}}']
                   for r in ("max_connections", "per_address", "unauthenticated")}
        check(sum(refused.values()) == m["foreshock_connections_rejected_total"],
              f"{name}: refusals by reason {refused} do not add up to "
              f"{m['foreshock_connections_rejected_total']:.0f}")
        for c in kept:
            c.close()
        print(f"{name}: {TRAINERS} trainers welcomed and acked during a flood of {FLOOD} "
              f"sockets from {FLOOD_ADDR} holding {holds} of {SLOTS} slots "
              f"({before['foreshock_connections_rejected_total']:.0f} refusals when the first "
              f"trainer came); evicted {evicted:.0f}, refused {refused}")
        check(d.stop() == 0, f"{name}: daemon did not exit 0")
    finally:
        if flood is not None:
            flood.stop.set()
        for c in kept:
            c.close()
        kill_started(d)


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    phase(args, workdir, pb, "plain", [])

    pki_dir = os.path.join(workdir, "pki")
    os.makedirs(pki_dir)
    pki = make_pki(pki_dir)
    ctx = ssl.create_default_context(cafile=pki["ca.pem"])
    ctx.load_cert_chain(pki["client.pem"], pki["client.key"])
    phase(args, workdir, pb, "mutual-tls",
          ["--set", f"tls_cert={pki['server.pem']}", "--set", f"tls_key={pki['server.key']}",
           "--set", f"tls_client_ca={pki['ca.pem']}"], ctx)

    # One address's share below the budget: the flood is refused by it and
    # leaves room; nobody needs to be evicted.
    phase(args, workdir, pb, "per-address",
          ["--set", f"max_unauthenticated_per_address={SLOTS // 4}"], holds=SLOTS // 4)


if __name__ == "__main__":
    run_main(test)
