"""Spectra solved on the host by the Monitor's pool of spectra threads
(spectra_on="host", the default on CUDA) equal, bit for bit, the spectra
solved in turn on one thread (foreshock.spectra.qk_spectra called once per
attention spec, the sender's own path), whatever spectra_threads is.

The pool is what solves every host spectrum, the Grams of a model on the
CPU included, so a CPU machine runs the same code as a GPU trainer with
spectra_on="host" from the moment the pinned copy has landed.

Checked, on test_python_routes.py's GQA trajectory (a frozen K, a frozen Q,
a NaN head) with route="spectrum", into a RecordingTransport:
  - the AttentionSpectrum sketches of spectra_threads=1 and =3 equal those
    of a Monitor whose sender solves in turn (no pool), values and NaNs;
  - the pool was used (its threads exist before close, at most
    spectra_threads of them) and spectra_on_host counts every sketch step;
  - a worker runs one OpenMP thread, while the trainer's thread and a new
    thread keep torch's thread count (2 here): the user's setting stands;
  - directly on synthetic Grams (3 specs, one with a NaN head): the packed
    float64 rows the pool returns equal qk_spectra's, per spec; a spec whose
    Grams are malformed fails alone (that module disabled, the others
    solved), and nothing raises;
  - spectra_on and spectra_threads reject bad values with a clear error.
"""
import os
import sys
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402
import test_python_routes as routes  # noqa: E402  (the trajectory and model)

USER_THREADS = 2


def spectra_threads_alive():
    return [t for t in threading.enumerate() if t.name.startswith("foreshock-spectra")]


def run(torch, foreshock, traj, threads, pool=True):
    """{(step, layer, head, window): values} of one spectrum-route stream."""
    from foreshock.testing import RecordingTransport
    model = routes.build_model(torch, torch.nn)
    tp = RecordingTransport()
    mon = foreshock.Monitor(model, run="host", windows=routes.WINDOWS, every=routes.EVERY,
                            routers=[], transport=tp, route="spectrum", spectra_on="host",
                            spectra_threads=threads)
    if not pool:
        mon._pool = lambda: None   # the sender solves each spec in turn itself
    for t in range(routes.STEPS + 1):
        with torch.no_grad():
            for blk, (q, k) in zip(model.layers, traj[t]):
                blk.self_attn.q_proj.weight.copy_(torch.from_numpy(q))
                blk.self_attn.k_proj.weight.copy_(torch.from_numpy(k))
        mon.step(t, loss=1.0)
    mon.flush(60)
    alive = spectra_threads_alive()
    if pool:
        check(1 <= len(alive) <= threads, f"threads={threads}: {len(alive)} spectra threads "
              "alive: the pool did not solve the spectra")
        worker = mon._spectra_pool.submit(torch.get_num_threads).result()
        check(worker == 1, f"a spectra worker runs {worker} OpenMP threads, expected 1")
    else:
        check(not alive, f"no pool, yet {len(alive)} spectra threads")
    st = mon.close(10)
    check(not spectra_threads_alive(), "close() left spectra threads running")
    sketch_steps = sum(1 for t in range(routes.EVERY, routes.STEPS + 1, routes.EVERY))
    check(st["spectra_on_host"] == sketch_steps and not st["disabled_modules"] and
          st["failures"]["spectrum"] == 0,
          f"threads={threads}: stats {st}")
    out = {}
    for rep in tp.reports:
        for a in rep.attention:
            check(type(a).__name__ == "AttentionSpectrum", f"sent {type(a).__name__}")
            out[(rep.step, a.layer, a.head, a.window)] = np.concatenate(
                [a.d2, a.d1, a.d3, a.w, np.array([a.q_delta_sq, a.q_sq, a.k_sq, a.k_delta_sq,
                                                  np.nan if a.cqk is None else a.cqk])])
    check(len(out) == routes.sketches_expected() * routes.LAYERS * routes.H,
          f"threads={threads}: {len(out)} spectrum sketches")
    return out


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def direct(torch, foreshock):
    """The pool on synthetic Gram triangles against qk_spectra per spec."""
    from foreshock.monitor import Monitor, _FAILED
    from foreshock.testing import RecordingTransport
    model = routes.build_model(torch, torch.nn)
    mon = Monitor(model, run="direct", routers=[], transport=RecordingTransport(),
                  route="spectrum", spectra_threads=3)
    specs = mon.attention
    check(len(specs) == routes.LAYERS, f"{len(specs)} attention specs")
    n = 2 * routes.DH
    iu = torch.triu_indices(n, n)
    gen = torch.Generator().manual_seed(7)

    def tri(heads):
        x = torch.randn(heads, n, 3 * n, generator=gen, dtype=torch.float64)
        g = x @ x.transpose(1, 2)
        return g[:, iu[0], iu[1]].contiguous()

    items = []
    for pos, a in enumerate(specs):
        ga, gb = tri(a.n_heads), tri(a.n_kv_heads)
        if pos == 1:
            ga[2, 5] = float("nan")   # a non-finite head: flagged, not a failure
        items.append((pos, pos, a, ga, gb))
    want = [Monitor._head_spectra(a, ga, gb) for _, _, a, ga, gb in items]
    got = mon._solve_spectra(items, True)
    check([p for p, _ in got] == [0, 1, 2], f"positions {[p for p, _ in got]}")
    for (_, sp), w in zip(got, want):
        check(sp is not _FAILED and torch.equal(torch.nan_to_num(sp, nan=-1.0),
                                                torch.nan_to_num(w, nan=-1.0)),
              "the pool's packed spectra differ from qk_spectra's")
    flags = want[1][:, 6 * routes.DH + 5]
    check(flags[2] != 0 and int((flags != 0).sum()) == 1, f"NaN head flags {flags.tolist()}")
    # A malformed spec fails alone.
    bad = list(items)
    bad[0] = (0, 0, specs[0], items[0][3][:, :7], items[0][4])
    got = mon._solve_spectra(bad, True)
    check(got[0][1] is _FAILED and all(sp is not _FAILED for _, sp in got[1:]),
          "a malformed spec did not fail alone")
    st = mon.close(10)
    check(list(st["disabled_modules"]) == [mon._name(("a", 0))] and
          st["failures"]["spectrum"] == 1, f"after a malformed spec: {st}")
    print(f"  direct: {len(items)} specs, packed float64 rows equal qk_spectra's; "
          "a malformed spec disabled alone", flush=True)

    for kw in ({"spectra_on": "gpu"}, {"spectra_threads": 0}, {"spectra_threads": 1.5}):
        try:
            Monitor(model, run="bad", routers=[], transport=RecordingTransport(), **kw).close(1)
        except ValueError as e:
            check(next(iter(kw)) in str(e), f"{kw}: error {e} does not name the argument")
        else:
            check(False, f"{kw} accepted")


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    import torch
    import foreshock
    torch.set_num_threads(USER_THREADS)
    traj = routes.trajectory()
    ref = run(torch, foreshock, traj, 1, pool=False)
    for threads in (1, 3):
        got = run(torch, foreshock, traj, threads)
        check(same(got, ref), f"spectra_threads={threads} differs from solving in turn")
        print(f"  spectra_threads={threads}: {len(got)} spectrum sketches equal the "
              "in-turn solve", flush=True)
    direct(torch, foreshock)
    seen = {}
    t = threading.Thread(target=lambda: seen.setdefault("n", torch.get_num_threads()))
    t.start()
    t.join()
    check(torch.get_num_threads() == USER_THREADS and seen["n"] == USER_THREADS,
          f"torch threads: trainer {torch.get_num_threads()}, a new thread {seen['n']}, "
          f"expected {USER_THREADS}: the user's setting changed")


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
