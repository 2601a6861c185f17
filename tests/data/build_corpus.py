"""Builds tests/data/corpus (the detection corpus's stored series) and
tests/data/recordings (the few raw recordings CI replays end to end) from a
recorded corpus (client/python/experiments/corpus.py writes it: a
manifest.json and one recording per run).

    /usr/bin/python3 tests/data/build_corpus.py --corpus /work/corpus-out \
        --build-dir build [--replay-runs NAME,NAME,...]

Every recording is replayed into one foreshockd with its default settings,
which computes the monitors; the daemon is stopped (it finishes the math of
every complete step first) and its database is cut down to what detection
reads (the per-layer aggregates it detects on, router series, rank 0's loss,
grad norm, LR, weight norms and update ratios: evaluate.c's
eval_input_rule), vacuumed and xz-compressed into corpus/corpus.db.xz. The
manifest keeps what each run was (architecture, schedule, scenario, fault
step, divergence step, split). `foreshock backtest --db` reads the result;
tests/bench/scorecard.py scores it.
"""
import argparse
import json
import lzma
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
READY_RE = re.compile(r"ready ingest=127\.0\.0\.1:(\d+) http=127\.0\.0\.1:(\d+)")

# What detection reads (evaluate.c, eval_input_rule) plus the LR and loss.
KEEP_SQL = """
    name IN ('qk.d2.erank.min', 'qk.d2.entropy.min', 'qk.d2.srank.min', 'qk.cqk.max')
        AND head = -1
    OR name LIKE 'router.%'
    OR name IN ('loss', 'grad_norm', 'lr', 'weight_norm', 'update_ratio', 'step_update_ratio')
        AND rank = 0
"""
# windows/every: the sketch windows and cadence the run's Monitor sent, when
# the recorder's manifest says (scorecard.py replays a run sent at other
# than the default cadence as it was sent).
META_KEYS = ("name", "arch", "shape", "head_dim", "schedule", "scenario", "seed", "split",
             "fault_step", "divergence_step", "steps", "bits", "lr_mult", "lr_fault_step",
             "lr_hidden", "windows", "every")


def start_daemon(build_dir, workdir):
    log = open(os.path.join(workdir, "foreshockd.log"), "w")
    db = os.path.join(workdir, "all.db")
    p = subprocess.Popen([os.path.join(build_dir, "foreshockd"), "--listen", "127.0.0.1:0",
                          "--http", "127.0.0.1:0", "--db", db], stdout=log,
                         stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(log.name) as f:
            m = READY_RE.search(f.read())
        if m:
            return p, db, int(m.group(1))
        if p.poll() is not None:
            sys.exit(f"foreshockd exited: see {log.name}")
        time.sleep(0.05)
    sys.exit("foreshockd not ready")


def load_pb(workdir):
    """foreshock_pb2, generated from proto/foreshock.proto into workdir."""
    src = os.path.dirname(os.path.dirname(HERE))
    out = os.path.join(workdir, "pb")
    os.makedirs(out, exist_ok=True)
    subprocess.run(["protoc", f"--proto_path={os.path.join(src, 'proto')}", f"--python_out={out}",
                    os.path.join(src, "proto", "foreshock.proto")], check=True)
    sys.path.insert(0, out)
    import foreshock_pb2
    return foreshock_pb2


def read_frames(path):
    """(magic, [frame bytes]) of a recording (foreshock.h, "Recordings")."""
    with open(path, "rb") as f:
        data = f.read()
    magic, pos, frames = data[:8], 8, []
    while pos + 4 <= len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        if pos + 4 + n > len(data):
            break
        frames.append(data[pos + 4:pos + 4 + n])
        pos += 4 + n
    return magic, frames


def filter_recording(pb, src, dst, windows, every):
    """Writes src as a default Monitor would have sent it: attention sketches
    of `windows` only, and sketches (attention, router, per-layer norms) only
    at steps that are multiples of `every`; scalars every step. Router token
    sums of the dropped sketch steps are dropped with them."""
    magic, frames = read_frames(src)
    with open(dst, "wb") as g:
        g.write(magic)
        for raw in frames:
            f = pb.Frame()
            f.ParseFromString(raw)
            if f.WhichOneof("body") == "report":
                r = f.report
                keep = [a for a in r.attention if a.window in windows]
                del r.attention[:]
                if r.step % every == 0:
                    r.attention.extend(keep)
                else:
                    del r.router_gram[:]
                    del r.router_tokens[:]
                    if r.HasField("scalars"):
                        del r.scalars.layer_weight_norm[:]
                        del r.scalars.layer_update_ratio[:]
            out = f.SerializeToString()
            g.write(len(out).to_bytes(4, "big") + out)


def xz(src, dst):
    with open(src, "rb") as f, lzma.open(dst, "wb", preset=9 | lzma.PRESET_EXTREME) as g:
        shutil.copyfileobj(f, g)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="corpus.py's output directory")
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--out", default=HERE, help="tests/data (default: this directory)")
    ap.add_argument("--name", default="corpus",
                    help="directory under --out for the stored series (corpus; the shapes "
                         "corpus: corpus-shapes)")
    ap.add_argument("--replay-runs", default="",
                    help="runs whose recordings CI replays end to end (comma separated), kept "
                         "as a default Monitor would have sent them (--windows, --every)")
    ap.add_argument("--windows", default="10,50", help="windows kept in those recordings")
    ap.add_argument("--every", type=int, default=10, help="sketch cadence kept in them")
    a = ap.parse_args()
    with open(os.path.join(a.corpus, "manifest.json")) as f:
        manifest = json.load(f)
    runs = manifest["runs"] if isinstance(manifest, dict) else manifest
    runs = [r for r in runs if r.get("complete", True)]
    for r in runs:  # the steps actually run (a faulted run stops after divergence)
        r["steps"] = r.get("steps_recorded") or r["steps"]
    cli = os.path.join(a.build_dir, "foreshock")
    with tempfile.TemporaryDirectory(prefix="foreshock-corpus-") as tmp:
        proc, db, port = start_daemon(a.build_dir, tmp)
        try:
            for r in runs:
                rec = r["recording"]
                if not os.path.isabs(rec):
                    rec = os.path.join(a.corpus, rec)
                out = subprocess.run([cli, "replay", rec, "--endpoint", f"127.0.0.1:{port}",
                                      "--run", r["name"]], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                if out.returncode != 0:
                    sys.exit(f"replay {rec}: {out.stdout}")
                print(out.stdout.strip(), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=600)
        con = sqlite3.connect(db)
        con.executescript(f"""
            DELETE FROM points WHERE series_id IN (SELECT id FROM series WHERE NOT ({KEEP_SQL}));
            DELETE FROM series WHERE NOT ({KEEP_SQL});
            DELETE FROM alert_events; DELETE FROM alerts; DELETE FROM detector_state;
            DELETE FROM outbox; DELETE FROM incomplete; DELETE FROM spool; DELETE FROM reports;
        """)
        con.commit()
        spool = db + ".spool"  # frames of steps the daemon did not evaluate (daemon/spool.h)
        left = sum(os.path.getsize(os.path.join(spool, f)) for f in os.listdir(spool)) \
            if os.path.isdir(spool) else 0
        con.execute("VACUUM")
        con.close()
        if left:
            sys.exit("the daemon left unevaluated steps in its spool")
        os.makedirs(os.path.join(a.out, a.name), exist_ok=True)
        xz(db, os.path.join(a.out, a.name, "corpus.db.xz"))
    meta = [{k: r.get(k) for k in META_KEYS if k in r} for r in runs]
    with open(os.path.join(a.out, a.name, "manifest.json"), "w") as f:
        json.dump({"runs": meta}, f, indent=1)
        f.write("\n")

    keep = [n for n in a.replay_runs.split(",") if n]
    if keep:
        pb_dir = tempfile.TemporaryDirectory(prefix="foreshock-pb-")
        pb = load_pb(pb_dir.name)
        rec_dir = os.path.join(a.out, "recordings")
        os.makedirs(rec_dir, exist_ok=True)
        entries = []
        for r in runs:
            if r["name"] not in keep:
                continue
            rec = r["recording"] if os.path.isabs(r["recording"]) else os.path.join(
                a.corpus, r["recording"])
            name = r["name"] + ".fsrec.xz"
            with tempfile.TemporaryDirectory(prefix="foreshock-rec-") as tmp:
                small = os.path.join(tmp, "rec.fsrec")
                filter_recording(pb, rec, small, {int(w) for w in a.windows.split(",")},
                                 a.every)
                xz(small, os.path.join(rec_dir, name))
            every = a.every
            last = int(r["steps"]) - int(r["steps"]) % every
            entries.append(dict({k: r.get(k) for k in META_KEYS}, file=name, run=r["name"],
                                last_sketch_step=last))
        with open(os.path.join(rec_dir, "manifest.json"), "w") as f:
            json.dump({"runs": entries}, f, indent=1)
            f.write("\n")
        pb_dir.cleanup()
    size = os.path.getsize(os.path.join(a.out, a.name, "corpus.db.xz"))
    print(f"corpus: {len(runs)} runs, corpus.db.xz {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
