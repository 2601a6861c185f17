"""Builds the foreshock wheel with libforeshock inside it.

The package's metadata is in pyproject.toml; this file only adds the
library: build_py copies it to foreshock/_native/libforeshock.so.0 (the
first place foreshock._lib looks after an explicit path or
$FORESHOCK_LIB), and the wheel is tagged for this platform (py3-none-
linux_x86_64, say), not py3-none-any, because it carries a shared object.
The library is loaded through ctypes, so one wheel serves every CPython 3.

Which library: $FORESHOCK_WHEEL_LIB, else the checkout's build tree
(../../build/libforeshock.so.0). `cmake --build build --target
python-wheel` passes the one `cmake --install` gives (no build-tree
RUNPATH). Its own dependencies (libopenblas0, libprotobuf-c1) come from the
system: on Debian, `apt-get install libopenblas0 libprotobuf-c1`.

    FORESHOCK_WHEEL_LIB=/path/libforeshock.so.0 /usr/bin/python3 -m pip wheel \\
        --no-index --no-build-isolation --no-deps client/python
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:  # setuptools >= 70.1 has its own; Debian 12 has the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        raise SystemExit("foreshock wheel: needs the wheel package (Debian: python3-wheel) "
                         "or setuptools >= 70.1") from None

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED = os.path.join("foreshock", "_native", "libforeshock.so.0")


def library():
    path = os.environ.get("FORESHOCK_WHEEL_LIB")
    origin = "$FORESHOCK_WHEEL_LIB"
    if not path:
        path = os.path.join(HERE, "..", "..", "build", "libforeshock.so.0")
        origin = "the checkout's build tree"
    if not os.path.isfile(path):
        raise SystemExit(
            f"foreshock wheel: no libforeshock at {path} ({origin}). Build it first "
            "(cmake -S . -B build && cmake --build build), or set FORESHOCK_WHEEL_LIB "
            "to the libforeshock.so.0 to bundle. A wheel without it would install and "
            "then fail at the first Monitor().")
    return path


class BuildPy(build_py):
    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, BUNDLED)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(library(), dst)  # the file a symlink names, not the link


class BinaryDistribution(Distribution):
    """Not pure: installed to platlib and tagged for the platform."""

    def has_ext_modules(self):
        return True


class BdistWheel(bdist_wheel):
    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat  # ctypes: no CPython ABI involved


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
