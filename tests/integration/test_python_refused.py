"""Reports the daemon will never take are dropped and counted by the client,
not resent forever (hardening item 8, client side).

One libforeshock stream (through the Python binding) against a daemon with
max_frame_bytes 32K sends ten reports; three of them the daemon will never
take:
  - step 3: 4,097 per-layer weight norms (the limit is 4,096): the daemon
    answers Error{ERROR_LIMIT, seq 3};
  - step 6: 32.8 KB, above the daemon's max_frame_bytes (from the Welcome):
    never sent;
  - step 8: a negative weight norm: Error{ERROR_MALFORMED, seq 8}.
Steps 3 and 8 go in through fsc_submit_packed (a recording from a newer
client, say), which checks only that the bytes are a Report.

Each refused report is dropped, counted (dropped and daemon_refused: 3),
logged, and its seq goes as an empty report so that the stream's seqs stay
dense: the other seven are acked and stored with their loss, the daemon
holds ten reports, flush returns 0, and the client reconnected only once
per error the daemon sent. Before, ERROR_LIMIT meant "reconnect and resend"
for ever, and a dropped report left a gap that the daemon (seqs increase by
one) refused with ERROR_SEQUENCE, again for ever.
"""
import ctypes
import os
import sys
import urllib.request
import json

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check, kill_started  # noqa: E402

STEPS = 10
LIMIT_STEP, LARGE_STEP, MALFORMED_STEP = 3, 6, 8


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    import numpy as np
    from foreshock._lib import Client
    from foreshock.report import Report
    pb = fstest.proto_module(args.source_dir, workdir)

    d = fstest.Daemon(args.build_dir, workdir, extra=("--set", "max_frame_bytes=32K"))
    try:
        c = Client("127.0.0.1", d.ingest_port, "refused-run", backoff_max_ms=200,
                   lib_path=os.path.join(args.build_dir, "libforeshock.so"))
        lib = c.lib
        lib.fsc_submit_packed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.fsc_submit_packed.restype = ctypes.c_int

        def packed(step, norms):
            r = pb.Report()
            r.seq, r.step = 1, step  # the client numbers it
            r.scalars.loss = 1.0 / step
            r.scalars.layer_weight_norm.extend(norms)
            return r.SerializeToString()

        for step in range(1, STEPS + 1):
            if step == LIMIT_STEP:
                b = packed(step, [1.0] * 4097)
                rc = lib.fsc_submit_packed(c._h, b, len(b))
            elif step == MALFORMED_STEP:
                b = packed(step, [1.0, -1.0])
                rc = lib.fsc_submit_packed(c._h, b, len(b))
            elif step == LARGE_STEP:
                rc = c.submit(Report(step=step, scalars={"loss": 1.0 / step},
                                     layer_weight_norm=np.ones(4096, np.float32),
                                     layer_update_ratio=np.ones(4096, np.float32)))
            else:
                rc = c.submit(Report(step=step, scalars={"loss": 1.0 / step}))
            check(rc == 0, f"step {step}: submit returned {rc}")
            # One at a time: which connection carries which report does not
            # depend on the machine's speed.
            rc = c.flush(60)
            st = c.stats()
            check(rc == 0, f"step {step}: flush returned {rc} (the client keeps resending?): {st}")
        st = c.stats()
        print(f"client stats: {st}")
        check(st["submitted"] == STEPS and st["acked"] == STEPS - 3 and st["dropped"] == 3 and
              st["daemon_refused"] == 3 and st["buffered_reports"] == 0,
              f"counts after the flush: {st}")
        check(st["reconnects"] == 2, f"{st['reconnects']} reconnects, expected one per daemon "
              "refusal (2): the client must not loop")
        check("max_frame_bytes" in st["last_error"] or "refused" in st["last_error"],
              f"last_error does not say why: {st['last_error']!r}")
        c.close(10)

        run = d.get("/api/v1/runs/refused-run")["run"]
        check(run["reports"] == STEPS, f"daemon holds {run['reports']} reports, expected "
              f"{STEPS} (dense seqs: the refused ones as empty reports)")
        series = d.get("/api/v1/series?run=refused-run&name=loss")["series"]
        check(len(series) == 1, f"loss series: {series}")
        pts = d.get(f"/api/v1/series/{series[0]['id']}/points?from=0&to=100")["points"]
        steps = [p[0] if isinstance(p, list) else p["step"] for p in pts]
        want = [s for s in range(1, STEPS + 1) if s not in (LIMIT_STEP, LARGE_STEP, MALFORMED_STEP)]
        check(steps == want, f"loss at steps {steps}, expected {want}")
        with urllib.request.urlopen(d.url("/metrics"), timeout=30) as r:
            text = r.read().decode()
        errors = [float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("foreshock_protocol_errors_total ")]
        check(errors == [2.0], f"protocol errors {errors}, expected 2 (one per refused report)")
        log = d.log_text()
        print("\n".join(line for line in log.splitlines() if "error" in line)[-2000:])
        check(d.stop() == 0, "daemon did not exit 0")
    finally:
        kill_started(d)


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
