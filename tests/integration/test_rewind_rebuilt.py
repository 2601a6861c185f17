"""Every rewind of a run gets its attempts.rebuilt_at (issue 22, Medium:
null for 21 of 60 rewinds in a storm).

Two ways it stayed null, each made certain here without timing: a rewind's
rebuild waits while steps up to its step still reduce (a lagging rank of
a two-rank MoE run: a step's router tokens wait for both ranks, and
reduce_timeout_s is far away), so the test decides what happens before it
starts.

- Superseded: attempt 1 rewinds to step 7 and waits; attempt 2 rewinds to
  step 3 first. Attempt 1's rebuild is never run (attempt 2's replays the
  stored points instead), and its rebuilt_at stayed null for good; it now
  takes the time of the rebuild that stood for it.
- A plain restart meanwhile: attempt 3 rewinds to step 7 and waits;
  attempt 4 (a plain restart, no resume_step) says Hello; the lagging rank
  catches up and the rebuild is stored. It was recorded as attempt 4's (the
  run's latest attempt then), so attempt 3's rewind stayed null and the
  plain restart showed a rebuild; now the rewinding attempt gets it.
"""
import os
import subprocess

import fstest
from fstest import check


def hello(pb, port, run, rank, attempt, resume_step=None):
    """A Hello (rank of a 2-rank run) on its own connection, kept open. It
    declares simulate's model below, its MoE layer included: the router
    tokens of a step wait for every rank that announces the layer, and a
    Hello that announced none would let the lagging steps go."""
    c = fstest.RawConn(pb, port)
    f = fstest.hello(pb, run, rank=rank, world=2, attempt=attempt)
    m = f.hello.model
    m.n_layers, m.n_heads, m.n_kv_heads, m.d_head, m.d_model = 1, 2, 2, 8, 32
    m.n_experts, m.top_k = 2, 1
    m.moe_layers.extend([0])
    if resume_step is not None:
        f.hello.resume_step = resume_step
    c.send(f)
    r = c.recv()
    check(r is not None and r.WhichOneof("body") == "welcome",
          f"rank {rank} attempt {attempt}: no Welcome: {r}")
    return c


def simulate(args, d, run, rank, steps, attempt=0, resume_step=None):
    """Rank `rank` of a 2-rank MoE run, steps 0..steps-1 (after resume_step
    with one): a step's router tokens reduce until both ranks sent them."""
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
           "--run", run, "--ranks", "1", "--world-size", "2", "--first-rank", str(rank),
           "--steps", str(steps), "--layers", "1", "--heads", "2", "--dh", "8", "--d", "32",
           "--sketch-every", "1", "--experts", "2", "--top-k", "1", "--attempt", str(attempt),
           "--flush-timeout", "120"]
    if resume_step is not None:
        cmd += ["--resume-step", str(resume_step)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, f"simulate rank {rank}: exit {p.returncode}:\n{p.stdout}{p.stderr}")


def attempts(d, run):
    return {a["attempt"]: a for a in d.get(f"/api/v1/runs/{run}")["run"]["attempts"]}


def rebuilt(d, run, among):
    """The attempts once one of among shows a rebuild, else None."""
    a = attempts(d, run)
    return a if any(a.get(n, {}).get("rebuilt_at") for n in among) else None


def main(args, workdir):
    pb = fstest.proto_module(args.source_dir, workdir)
    conf = os.path.join(workdir, "foreshockd.conf")
    with open(conf, "w") as f:
        f.write("reduce_timeout_s = 3600\n")  # the lagging rank is waited for, not timed out
    d = fstest.Daemon(args.build_dir, workdir, config=conf)
    conns = []
    try:
        port, run = d.ingest_port, "storm"

        def hello_(rank, attempt, resume_step=None):
            conns.append(hello(pb, port, run, rank, attempt, resume_step))

        # Attempt 0: rank 0 at steps 0..10, rank 1 only 0..4: 5..10 reduce.
        simulate(args, d, run, 0, 11)
        simulate(args, d, run, 1, 5)

        # Superseded: attempt 1 to step 7 waits for steps 5..7; attempt 2
        # rewinds to step 3, which nothing holds up.
        hello_(0, 1, resume_step=7)
        check(attempts(d, run)[1]["rebuilt_at"] is None,
              "attempt 1 rebuilt while its steps still reduce")
        hello_(0, 2, resume_step=3)
        att = fstest.wait_until(lambda: rebuilt(d, run, [2]), what="attempt 2's rebuild")
        check(att[1]["rebuilt_at"] is not None and att[1]["resume_step"] == 7,
              f"attempt 1, superseded before its rebuild, has no rebuilt_at: {att[1]}")
        check(att[1]["rebuilt_at"] == att[2]["rebuilt_at"],
              f"attempt 1 has not attempt 2's rebuild time: {att}")

        # A plain restart while a rewind waits: attempt 2 re-does steps 4..10
        # (rank 1 only step 4); attempt 3 rewinds to step 7 and waits for
        # rank 1's steps 5..7; attempt 4 says Hello without a resume step;
        # then rank 1 catches up and the rebuild is stored.
        simulate(args, d, run, 0, 11, attempt=2, resume_step=3)
        simulate(args, d, run, 1, 5, attempt=2, resume_step=3)
        hello_(0, 3, resume_step=7)
        hello_(0, 4)
        att = attempts(d, run)
        check(att[3]["rebuilt_at"] is None and att[4]["rebuilt_at"] is None,
              f"attempt 3 rebuilt before its steps reduced: {att}")
        simulate(args, d, run, 1, 8, attempt=2, resume_step=4)
        att = fstest.wait_until(lambda: rebuilt(d, run, [3, 4]), what="attempt 3's rebuild")
        check(att[4]["rebuilt_at"] is None and att[4]["resume_step"] is None,
              f"the plain restart shows a rebuild: {att[4]}")
        check(att[3]["rebuilt_at"] is not None, f"attempt 3's rewind has no rebuilt_at: {att}")
        check(all(a["rebuilt_at"] is not None for a in att.values()
                  if a["resume_step"] is not None), f"a rewind without rebuilt_at: {att}")
        for c in conns:
            c.close()
        check(d.stop() == 0, "daemon exit code")
    finally:
        for c in conns:
            c.close()
        fstest.kill_started(d)


if __name__ == "__main__":
    fstest.run_main(main)
