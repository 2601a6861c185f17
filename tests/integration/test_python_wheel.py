"""The Python wheel carries libforeshock, and a fresh venv needs nothing else:

- client/python/build_wheel.py builds it from this build tree (pip wheel,
  no index, no build isolation: setuptools and wheel from Debian);
- it is tagged for the platform (py3-none-linux_*, not -any) and holds
  foreshock/_native/libforeshock.so.0 as installed (soname, no RUNPATH);
- a fresh venv (--system-site-packages: torch and numpy from Debian) gets
  it with `pip install --no-index`, with no other package source;
- from a temporary directory outside the checkout, with no FORESHOCK_LIB
  and no PYTHONPATH, the venv's Python imports foreshock from the venv,
  loads the bundled library, and a Monitor on a small model with two
  nn.MultiheadAttention layers streams a short training run to a real
  daemon: every report acknowledged, the run stored (its reports, a loss
  point per step, attention sketches of both layers) and read back over
  HTTP.
"""
import json
import os
import subprocess
import sys
import time
import zipfile

from fstest import Daemon, check, kill_started, run_all_pages, run_main

STEPS = 12
TOOL_TIMEOUT_S = 600
SKETCH_DEADLINE_S = 120

TRAIN = r"""
import json, os, sys
import torch
import foreshock
from foreshock import _lib

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.att = torch.nn.ModuleList(
            torch.nn.MultiheadAttention(16, 2, batch_first=True) for _ in range(2))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        for a in self.att:
            x = x + a(x, x, x, need_weights=False)[0]
        return self.out(x).mean()

torch.manual_seed(1)
model = Tiny()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
lib = _lib.load()
mon = foreshock.Monitor(model, endpoint=sys.argv[1], run="wheel", windows=(2,), every=2)
for step in range(1, int(sys.argv[2]) + 1):
    loss = model(torch.randn(4, 8, 16)) ** 2
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    mon.step(step, loss=loss.item(), grad_norm=float(gn), lr=0.01)
mon.close()
print(json.dumps({"package": foreshock.__file__, "lib": lib._name,
                  "attention_layers": len(mon.discovery.attention), "stats": mon.stats()}))
"""


def run(cmd, **kw):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TOOL_TIMEOUT_S, **kw)
    check(p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}:\n{p.stdout[-4000:]}")
    return p.stdout


def clean_env():
    """No route to the checkout's package or library, and no package source
    but the wheel (PIP_FIND_LINKS and friends dropped)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORESHOCK_LIB", "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH",
                        "LD_PRELOAD", "VIRTUAL_ENV")
           and not (k.startswith("PIP_") and k.endswith(("FIND_LINKS", "INDEX_URL")))}
    return env


def check_wheel(whl, workdir):
    name = os.path.basename(whl)
    check(name.startswith("foreshock-") and "-none-any" not in name and "linux" in name,
          f"wheel {name}: want a platform tag (it carries a shared object)")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        check("foreshock/_native/libforeshock.so.0" in names,
              f"the wheel does not carry the library: {names}")
        meta = [n for n in names if n.endswith(".dist-info/WHEEL")]
        check(meta and "Root-Is-Purelib: false" in z.read(meta[0]).decode(),
              "the wheel installs to purelib")
        lib = z.extract("foreshock/_native/libforeshock.so.0", os.path.join(workdir, "whl"))
    elf = run(["readelf", "-d", lib])
    check("Library soname: [libforeshock.so.0]" in elf and "RUNPATH" not in elf,
          f"bundled library is not the installed one:\n{elf}")


def test(args, workdir):
    build_dir = os.path.abspath(args.build_dir)
    env = clean_env()
    out = run([sys.executable, os.path.join(args.source_dir, "client", "python", "build_wheel.py"),
               "--build-dir", build_dir, "--out", os.path.join(workdir, "dist")], env=env)
    whl = out.strip().splitlines()[-1]
    check(os.path.isfile(whl), f"build_wheel.py did not make a wheel:\n{out}")
    check_wheel(whl, workdir)

    venv = os.path.join(workdir, "venv")
    run([sys.executable, "-m", "venv", "--system-site-packages", venv], env=env)
    py = os.path.join(venv, "bin", "python")
    run([py, "-m", "pip", "install", "--no-index", whl], env=env)

    outside = os.path.join(workdir, "outside")
    os.makedirs(outside)
    script = os.path.join(outside, "train.py")
    with open(script, "w") as f:
        f.write(TRAIN)
    d = Daemon(build_dir, workdir)
    try:
        out = run([py, script, d.endpoint, str(STEPS)], cwd=outside, env=env)
        res = json.loads(out.strip().splitlines()[-1])
        site = os.path.realpath(venv)
        check(os.path.realpath(res["package"]).startswith(site + os.sep),
              f"foreshock imported from {res['package']}, not the venv")
        check(os.path.realpath(res["lib"]) == os.path.join(
                  os.path.dirname(os.path.realpath(res["package"])), "_native",
                  "libforeshock.so.0"), f"loaded {res['lib']}, not the bundled library")
        check(res["attention_layers"] == 2, f"discovered {res['attention_layers']} attention layers")
        st = res["stats"]
        check(st["submitted"] == st["acked"] == STEPS and st["dropped"] == 0, f"client stats: {st}")

        runs = run_all_pages(d, "/api/v1/runs", "runs")
        check([(r["id"], r["reports"]) for r in runs] == [("wheel", STEPS)], f"runs: {runs}")
        (loss,) = run_all_pages(d, "/api/v1/series?run=wheel&name=loss", "series")
        pts = d.get(f"/api/v1/series/{loss['id']}/points?from=0&limit=100")["points"]
        check([p[0] for p in pts] == list(range(1, STEPS + 1)), f"loss points: {pts}")
        # The attention sketches reach the monitor stage (asynchronous).
        deadline = time.monotonic() + SKETCH_DEADLINE_S
        while True:
            series = run_all_pages(d, "/api/v1/series?run=wheel&prefix=qk.", "series")
            layers = sorted({s["labels"].get("layer") for s in series})
            if layers == [0, 1] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        check(layers == [0, 1], f"qk.* series for layers {layers}: {series[:5]}")
        rc = d.stop()
        check(rc == 0, f"foreshockd exited {rc}")
    finally:
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
