"""The Debian packages (deploy/debian/package.cmake), built by cpack from
this build tree, installed into this machine with dpkg, used, and purged:

- cpack gives foreshockd, foreshock, libforeshock0 and libforeshock-dev;
  their dependencies come from dpkg-shlibdeps (libc6 with a version, every
  library the binaries link), libforeshock-dev depends on its exact
  libforeshock0, and foreshockd marks /etc/foreshock/foreshockd.conf as
  a conffile;
- `dpkg -i` of the four: the postinst creates the system user 'foreshock',
  gives the configuration to its group (0640, directory 0750), does not
  enable or start the service; the unit's ExecStart is the installed
  binary and `systemd-analyze verify` accepts it; ldconfig and pkg-config
  find the library;
- the installed daemon, run as that user (setpriv, so its PID is the
  daemon's) with the installed configuration, ephemeral loopback ports and
  a database in a directory that user owns, stores a run the installed CLI
  streams, served back over HTTP;
- conffile handling: an edited configuration survives `dpkg --remove` and
  a reinstall;
- `dpkg --purge`: the files, /etc/foreshock and /var/lib/foreshock are
  gone; the user stays (Debian's practice, deploy/debian/foreshockd/postrm).

This changes the machine's package state, so it needs root (else it is
skipped, exit 77), refuses to run (skipped) when any of these packages, the
configuration or the state directory are already there (they would be an
operator's, and purging would take them), runs alone (RUN_SERIAL), and its
cleanup always runs: the daemon stopped by PID, every package of ours still
known to dpkg purged, the user and group deleted if this test created
them, its directories removed.
"""
import glob
import grp
import os
import pwd
import shutil
import stat
import subprocess
import tempfile

from fstest import (Daemon, Failure, Skip, check, project_version, run_main,
                    simulate_and_read_back)

PACKAGES = ["foreshockd", "foreshock", "libforeshock0", "libforeshock-dev"]
USER = "foreshock"
CONF_DIR = "/etc/foreshock"
CONF = "/etc/foreshock/foreshockd.conf"
STATE_DIR = "/var/lib/foreshock"
UNIT = "/usr/lib/systemd/system/foreshockd.service"
PACKAGED_FILES = ["/usr/bin/foreshockd", "/usr/bin/foreshock", UNIT,
                  "/usr/lib/sysusers.d/foreshock.conf", "/usr/include/foreshock.h", CONF]
TOOL_TIMEOUT_S = 300
ENABLE_LINK = "/etc/systemd/system/multi-user.target.wants/foreshockd.service"


def run(cmd, **kw):
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TOOL_TIMEOUT_S, env=env, **kw)
    check(p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}:\n{p.stdout[-4000:]}")
    return p.stdout


def status(pkg):
    """dpkg's state of pkg: installed, config-files, not-installed, ..."""
    p = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status}", pkg],
                       capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else "not-installed"


def user_exists(name):
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def group_exists(name):
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def processes_of(binary):
    """PIDs whose executable is binary (read from /proc; nothing is signalled)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.readlink(f"/proc/{d}/exe") == binary:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def preconditions():
    if os.geteuid() != 0:
        raise Skip("needs root: it installs and purges the packages with dpkg "
                   "(CI runs it as root)")
    for tool in ("cpack", "dpkg", "dpkg-deb", "dpkg-shlibdeps", "setpriv"):
        if not shutil.which(tool):
            raise Skip(f"{tool} not found (deploy/install-deps.sh installs dpkg-dev and "
                       "util-linux)")
    there = [p for p in PACKAGES if status(p) != "not-installed"]
    if there:
        raise Skip(f"{there} already known to dpkg on this machine: they are not this "
                   "test's to purge")
    for path in (CONF_DIR, STATE_DIR):
        if os.path.exists(path):
            raise Skip(f"{path} exists: an operator's configuration or data that purging "
                       "the package would remove")
    return {"user": user_exists(USER), "group": group_exists(USER)}


def build_debs(build_dir, outdir):
    out = run(["cpack", "--config", os.path.join(build_dir, "CPackConfig.cmake"), "-B", outdir])
    debs = {}
    for pkg in PACKAGES:
        found = glob.glob(os.path.join(outdir, f"{pkg}_*.deb"))
        check(len(found) == 1, f"cpack made {found} for {pkg}:\n{out[-3000:]}")
        debs[pkg] = found[0]
    return debs


def control(deb, field):
    return run(["dpkg-deb", "-f", deb, field]).strip()


def check_control(debs, version):
    deb_version = control(debs["foreshockd"], "Version")
    check(deb_version.startswith(version + "-"), f"package version {deb_version}")
    for pkg in ("foreshockd", "foreshock", "libforeshock0"):
        dep = control(debs[pkg], "Depends")
        # Only dpkg-shlibdeps writes these: the binaries link libc and the
        # libraries of deploy/install-deps.sh.
        check("libc6 (>=" in dep, f"{pkg}: Depends not from dpkg-shlibdeps: {dep!r}")
        for lib in ("libopenblas0", "libprotobuf-c1"):
            check(lib in dep, f"{pkg}: Depends lacks {lib}: {dep!r}")
    dep = control(debs["foreshockd"], "Depends")
    for lib in ("libmicrohttpd12", "libsqlite3-0", "libuv1", "libcurl4"):
        check(lib in dep, f"foreshockd: Depends lacks {lib}: {dep!r}")
    check(f"libforeshock0 (= {deb_version})" in control(debs["libforeshock-dev"], "Depends"),
          "libforeshock-dev must depend on its exact libforeshock0")
    ctl = os.path.join(os.path.dirname(debs["foreshockd"]), "foreshockd-control")
    run(["dpkg-deb", "-e", debs["foreshockd"], ctl])
    conffiles = open(os.path.join(ctl, "conffiles")).read().split()
    check(conffiles == [CONF], f"foreshockd conffiles: {conffiles}")
    for script in ("postinst", "prerm", "postrm"):
        mode = os.stat(os.path.join(ctl, script)).st_mode
        check(mode & stat.S_IXUSR, f"foreshockd {script} is not executable")
    shlibs = os.path.join(os.path.dirname(debs["foreshockd"]), "lib-control")
    run(["dpkg-deb", "-e", debs["libforeshock0"], shlibs])
    check(open(os.path.join(shlibs, "shlibs")).read().startswith("libforeshock 0 libforeshock0"),
          "libforeshock0 ships no shlibs file for packages built against it")


def check_installed(version):
    for pkg in PACKAGES:
        check(status(pkg) == "installed", f"{pkg}: dpkg state {status(pkg)}")
    for path in PACKAGED_FILES:
        check(os.path.exists(path), f"{path} not installed")
    pw = pwd.getpwnam(USER)
    check(pw.pw_uid < 1000 and pw.pw_dir == STATE_DIR,
          f"user {USER}: uid {pw.pw_uid}, home {pw.pw_dir}: want a system user at {STATE_DIR}")
    gid = grp.getgrnam(USER).gr_gid
    for path, mode in ((CONF_DIR, 0o750), (CONF, 0o640)):
        st = os.stat(path)
        check(st.st_uid == 0 and st.st_gid == gid and stat.S_IMODE(st.st_mode) == mode,
              f"{path}: uid {st.st_uid} gid {st.st_gid} mode {oct(st.st_mode)}, want "
              f"root:{USER} {oct(mode)}")
    st = os.stat(STATE_DIR)
    check(st.st_uid == pw.pw_uid, f"{STATE_DIR} is not owned by {USER}")
    # Installed, not started: the configuration is the defaults.
    check(not os.path.exists(ENABLE_LINK), "the postinst enabled the service")
    check(not processes_of("/usr/bin/foreshockd"), "a foreshockd runs right after installing")
    unit = open(UNIT).read()
    check("ExecStart=/usr/bin/foreshockd --config /etc/foreshock/foreshockd.conf\n" in unit,
          "the installed unit's ExecStart is not the installed binary and conffile")
    if shutil.which("systemd-analyze"):
        p = subprocess.run(["systemd-analyze", "verify", UNIT], capture_output=True, text=True,
                           timeout=TOOL_TIMEOUT_S)
        out = p.stdout + p.stderr
        check(p.returncode == 0 and not out.strip(), f"systemd-analyze verify {UNIT}:\n{out}")
    else:
        print("note: systemd-analyze not installed: the installed unit is not verified")
    check("libforeshock.so.0 " in run(["ldconfig", "-p"]), "ldconfig does not list libforeshock.so.0")
    check(run(["pkg-config", "--modversion", "foreshock"]).strip() == version, "pkg-config")


def run_as_user(rundir, cleanup):
    """The installed daemon as the package's user; the installed CLI streams
    a run that is read back over HTTP. Returns nothing; raises Failure."""
    pw = pwd.getpwnam(USER)
    os.chown(rundir, pw.pw_uid, pw.pw_gid)
    wrapper = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", "--"]
    # The installed configuration as is: readable by the user through its
    # group, as systemd would start it.
    d = Daemon(None, rundir, binary="/usr/bin/foreshockd", wrapper=wrapper, config=CONF)
    cleanup.daemon = d
    status_text = open(f"/proc/{d.pid}/status").read()
    uid_line = [ln for ln in status_text.splitlines() if ln.startswith("Uid:")][0]
    check(uid_line.split()[1:] == [str(pw.pw_uid)] * 4, f"the daemon runs as {uid_line}")
    simulate_and_read_back("/usr/bin/foreshock", d, "deb-installed", cwd=rundir)
    rc = d.stop()
    check(rc == 0, f"installed foreshockd exited {rc}:\n{d.log_text()[-2000:]}")
    check(os.stat(d.db).st_uid == pw.pw_uid, f"{d.db} is not owned by {USER}")


def check_conffile_kept(debs):
    edit = "\n# edited by the operator (test_package_deb)\nlog_level = info\n"
    with open(CONF, "a") as f:
        f.write(edit)
    run(["dpkg", "--remove", "foreshockd"])
    check(status("foreshockd") == "config-files", f"after remove: {status('foreshockd')}")
    check(not os.path.exists("/usr/bin/foreshockd"), "remove left /usr/bin/foreshockd")
    check(os.path.exists(CONF) and open(CONF).read().endswith(edit),
          "remove did not keep the edited conffile")
    run(["dpkg", "-i", "--force-confold", debs["foreshockd"]])
    check(status("foreshockd") == "installed", "reinstall")
    check(open(CONF).read().endswith(edit), "reinstalling lost the operator's edit")


def check_purged():
    run(["dpkg", "--purge"] + PACKAGES)
    for pkg in PACKAGES:
        check(status(pkg) == "not-installed", f"{pkg}: after purge {status(pkg)}")
    for path in PACKAGED_FILES + [CONF_DIR, STATE_DIR, "/usr/lib/libforeshock.so.0"]:
        check(not os.path.lexists(path), f"{path} left after purge")
    check("libforeshock.so.0 " not in run(["ldconfig", "-p"]), "ldconfig still lists the library")
    check(user_exists(USER), "purge removed the system user (postrm keeps it, see there)")


class Cleanup:
    """Undoes what the test did to the machine, whatever happened."""

    def __init__(self, before):
        self.before = before
        self.daemon = None
        self.rundir = None

    def __call__(self):
        problems = []
        if self.daemon is not None and self.daemon.proc.poll() is None:
            try:
                self.daemon.kill()
            except OSError as e:
                problems.append(f"stopping the daemon: {e}")
        left = [p for p in PACKAGES if status(p) != "not-installed"]
        if left:
            p = subprocess.run(["dpkg", "--purge"] + left, capture_output=True, text=True,
                               timeout=TOOL_TIMEOUT_S)
            if p.returncode != 0:
                problems.append(f"dpkg --purge {left}: {p.stdout}{p.stderr}")
        if not self.before["user"] and user_exists(USER):
            subprocess.run(["userdel", USER], timeout=TOOL_TIMEOUT_S)
        if not self.before["group"] and group_exists(USER):
            subprocess.run(["groupdel", USER], timeout=TOOL_TIMEOUT_S)
        for path in (CONF_DIR, STATE_DIR, self.rundir):
            if path and os.path.exists(path):
                shutil.rmtree(path, ignore_errors=True)
        if user_exists(USER) and not self.before["user"]:
            problems.append(f"user {USER} could not be deleted")
        return problems


def test(args, workdir):
    before = preconditions()
    version = project_version(args.source_dir)
    debs = build_debs(os.path.abspath(args.build_dir), os.path.join(workdir, "debs"))
    check_control(debs, version)

    cleanup = Cleanup(before)
    failed = False
    try:
        # The daemon's user must reach its directory: not under workdir (0700).
        cleanup.rundir = tempfile.mkdtemp(prefix="foreshock-deb-run-")
        run(["dpkg", "-i"] + [debs[p] for p in PACKAGES])
        check_installed(version)
        run_as_user(cleanup.rundir, cleanup)
        check_conffile_kept(debs)
        check_purged()
    except BaseException:
        failed = True
        raise
    finally:
        problems = cleanup()
        if problems:
            print("cleanup: " + "; ".join(problems), flush=True)
            if not failed:
                raise Failure("cleanup failed: " + "; ".join(problems))


if __name__ == "__main__":
    run_main(test)
