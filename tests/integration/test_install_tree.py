"""`cmake --install build --prefix P` gives a tree that works from P, with
nothing of the build tree or the checkout in use (deploy/install.cmake):

- every component's files are where the install rules say: the daemon and
  CLI in P/bin, libforeshock.so.0 as its soname names it (a link to the
  versioned file) and the unversioned link, the header, the pkg-config
  file, the unit and sysusers file, the configuration;
- the unit's ExecStart is P/bin/foreshockd --config
  P/etc/foreshock/foreshockd.conf, both exist, and `systemd-analyze verify`
  accepts the unit as installed;
- P/bin/foreshockd starts with the installed configuration (ephemeral
  loopback ports and a temporary database on the command line), from a
  temporary working directory; P/bin/foreshock simulate streams a run into
  it and the run is read back over HTTP, as is the dashboard page (its
  assets are embedded in the binary, nothing is installed for them);
- a C program compiled with `pkg-config --cflags --libs foreshock` against
  P links P's libforeshock and runs (fsc_version is the project's);
- a relative --prefix gives the same absolute ExecStart;
- installing again keeps a configuration the operator edited.
"""
import glob
import os
import re
import shutil
import subprocess
import urllib.request

from fstest import (Daemon, check, cmake_install, kill_started, project_version, run_main,
                    simulate_and_read_back)

TOOL_TIMEOUT_S = 120

C_PROGRAM = r"""
#include <foreshock.h>
#include <stdio.h>
int main(void) { puts(fsc_version()); return 0; }
"""


def run(cmd, **kw):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TOOL_TIMEOUT_S, **kw)
    check(p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}:\n{p.stdout[-3000:]}")
    return p.stdout


def one_file(prefix, pattern):
    found = glob.glob(os.path.join(prefix, pattern), recursive=True)
    check(len(found) == 1, f"{pattern} under {prefix}: {found}")
    return found[0]


def check_layout(prefix, version):
    for rel in ("bin/foreshockd", "bin/foreshock"):
        path = os.path.join(prefix, rel)
        check(os.path.isfile(path) and os.access(path, os.X_OK), f"{rel} not installed")
    soname = one_file(prefix, "lib*/**/libforeshock.so.0")
    libdir = os.path.dirname(soname)
    check(os.path.islink(soname) and os.readlink(soname) == f"libforeshock.so.{version}",
          f"libforeshock.so.0 should link to libforeshock.so.{version}")
    check(os.path.isfile(os.path.join(libdir, f"libforeshock.so.{version}")), "versioned lib")
    check(os.path.islink(os.path.join(libdir, "libforeshock.so")), "libforeshock.so link")
    readelf = run(["readelf", "-d", soname])
    check("Library soname: [libforeshock.so.0]" in readelf, f"soname:\n{readelf}")
    check("RUNPATH" not in readelf and "RPATH" not in readelf,
          f"the installed library keeps a build-tree RUNPATH:\n{readelf}")
    for rel in ("include/foreshock.h", "lib/systemd/system/foreshockd.service",
                "lib/sysusers.d/foreshock.conf", "etc/foreshock/foreshockd.conf"):
        check(os.path.isfile(os.path.join(prefix, rel)), f"{rel} not installed")
    check(os.path.isfile(os.path.join(libdir, "pkgconfig", "foreshock.pc")), "foreshock.pc")
    return libdir


def check_unit(prefix, workdir):
    unit = os.path.join(prefix, "lib", "systemd", "system", "foreshockd.service")
    text = open(unit).read()
    m = re.search(r"^ExecStart=(.*)$", text, re.M)
    check(m is not None, "the installed unit has no ExecStart")
    want = [f"{prefix}/bin/foreshockd", "--config", f"{prefix}/etc/foreshock/foreshockd.conf"]
    check(m.group(1).split() == want, f"ExecStart={m.group(1)}, want {' '.join(want)}")
    left = re.findall(r"@[A-Z_]+@", text)
    check(not left, f"template placeholders left in the installed unit: {left}")
    if not shutil.which("systemd-analyze"):
        print("note: systemd-analyze not installed: the unit is checked by the parse above only")
        return
    p = subprocess.run(["systemd-analyze", "verify", unit], capture_output=True, text=True,
                       timeout=TOOL_TIMEOUT_S, cwd=workdir)
    out = p.stdout + p.stderr
    check(p.returncode == 0 and not out.strip(), f"systemd-analyze verify: exit {p.returncode}:\n{out}")


def check_pkg_config(prefix, libdir, version, workdir):
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(libdir, "pkgconfig"))
    check(run(["pkg-config", "--modversion", "foreshock"], env=env).strip() == version,
          "pkg-config --modversion foreshock")
    flags = run(["pkg-config", "--cflags", "--libs", "foreshock"], env=env).split()
    src = os.path.join(workdir, "version.c")
    exe = os.path.join(workdir, "version")
    with open(src, "w") as f:
        f.write(C_PROGRAM)
    run(["cc", "-o", exe, src] + flags, cwd=workdir)
    ldd = run(["ldd", exe], env=dict(env, LD_LIBRARY_PATH=libdir))
    check(os.path.join(libdir, "libforeshock.so.0") in ldd, f"not linked to P's library:\n{ldd}")
    out = run([exe], env=dict(env, LD_LIBRARY_PATH=libdir), cwd=workdir)
    check(out.strip() == version, f"fsc_version() = {out.strip()!r}, want {version}")


def test(args, workdir):
    version = project_version(args.source_dir)
    prefix = os.path.join(workdir, "prefix")
    cmake_install(os.path.abspath(args.build_dir), prefix)
    libdir = check_layout(prefix, version)
    check_unit(prefix, workdir)
    check_pkg_config(prefix, libdir, version, workdir)

    # Daemon and CLI from P, run from a directory outside the checkout.
    rundir = os.path.join(workdir, "run")
    os.makedirs(rundir)
    conf = os.path.join(prefix, "etc", "foreshock", "foreshockd.conf")
    d = Daemon(None, rundir, binary=os.path.join(prefix, "bin", "foreshockd"), config=conf)
    try:
        simulate_and_read_back(os.path.join(prefix, "bin", "foreshock"), d, "installed-tree",
                               cwd=rundir)
        with urllib.request.urlopen(d.url("/"), timeout=30) as r:
            page = r.read().decode(errors="replace")
        check(r.status == 200 and "<html" in page.lower(), f"GET /: {r.status} {page[:200]!r}")
        rc = d.stop()
        check(rc == 0, f"installed foreshockd exited {rc}:\n{d.log_text()[-2000:]}")
    finally:
        kill_started(d)

    # A relative prefix is where `cmake --install` runs; the unit names it
    # absolutely all the same.
    cmake_install(os.path.abspath(args.build_dir), "rel", component="foreshockd", cwd=workdir)
    check_unit(os.path.join(workdir, "rel"), workdir)

    # Installing again must not undo the operator's edits.
    with open(conf, "a") as f:
        f.write("\n# edited by the operator\nlog_level = debug\n")
    edited = open(conf).read()
    out = cmake_install(os.path.abspath(args.build_dir), prefix)
    check(open(conf).read() == edited, "a second install overwrote the edited configuration")
    check("Keeping:" in out, f"the second install does not say it kept the config:\n{out}")


if __name__ == "__main__":
    run_main(test)
