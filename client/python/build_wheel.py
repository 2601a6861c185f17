"""Builds the foreshock wheel, carrying libforeshock, from a CMake build tree
without writing into the checkout:

    /usr/bin/python3 client/python/build_wheel.py --build-dir build --out build/dist
    (or: cmake --build build --target python-wheel)

1. `cmake --install BUILD --component libforeshock --strip` into a temporary
   prefix: the library as installed (soname file, no build-tree RUNPATH);
2. copies this directory to a temporary one (setuptools writes build/ and
   *.egg-info next to the sources);
3. `pip wheel --no-index --no-build-isolation --no-deps` there with
   FORESHOCK_WHEEL_LIB naming the library (setup.py bundles it).

Prints the wheel's path on its last line. Everything comes from Debian
(python3-setuptools, python3-wheel, python3-pip); no index is consulted.
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL_TIMEOUT_S = 600


def run(cmd, **kw):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TOOL_TIMEOUT_S, **kw)
    if p.returncode != 0:
        sys.exit(f"build_wheel: {' '.join(cmd)}: exit {p.returncode}\n{p.stdout}")
    return p.stdout


def build(build_dir, out_dir, python=sys.executable):
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="foreshock-wheel-") as tmp:
        stage = os.path.join(tmp, "stage")
        run(["cmake", "--install", build_dir, "--component", "libforeshock", "--strip",
             "--prefix", stage])
        libs = glob.glob(os.path.join(stage, "**", "libforeshock.so.0"), recursive=True)
        if len(libs) != 1:
            sys.exit(f"build_wheel: cmake --install gave {libs or 'no libforeshock.so.0'} "
                     f"under {stage}")
        src = os.path.join(tmp, "src")
        shutil.copytree(HERE, src, ignore=shutil.ignore_patterns(
            "build", "dist", "*.egg-info", "__pycache__", "experiments"))
        dist = os.path.join(tmp, "dist")
        run([python, "-m", "pip", "wheel", "--no-index", "--no-build-isolation", "--no-deps",
             "--wheel-dir", dist, src], env=dict(os.environ, FORESHOCK_WHEEL_LIB=libs[0]),
            cwd=tmp)
        (whl,) = glob.glob(os.path.join(dist, "*.whl"))
        dst = os.path.join(out_dir, os.path.basename(whl))
        shutil.copyfile(whl, dst)
        return dst


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", required=True, help="CMake build tree with libforeshock built")
    p.add_argument("--out", required=True, help="directory the wheel is written to")
    a = p.parse_args()
    print(build(os.path.abspath(a.build_dir), os.path.abspath(a.out)))


if __name__ == "__main__":
    main()
