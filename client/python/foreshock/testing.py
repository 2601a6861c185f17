"""Helpers for testing code that uses foreshock.Monitor without a daemon."""
import threading


class RecordingTransport:
    """A transport that keeps every report it is given (Monitor(...,
    transport=RecordingTransport())). Thread-safe; reports are
    foreshock.report.Report objects in submission order."""

    def __init__(self, fail_with=0):
        self.reports = []
        self.fail_with = fail_with  # return this from submit (e.g. -ENOBUFS)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, rep):
        with self._lock:
            if self.fail_with:
                return self.fail_with
            self.reports.append(rep)
            return 0

    def stats(self):
        with self._lock:
            n = len(self.reports)
        return {"submitted": n, "acked": n, "dropped": 0, "daemon_refused": 0,
                "buffered_reports": 0,
                "connected": 1, "last_error": ""}

    def flush(self, timeout_s=None):
        return 0

    def close(self, timeout_s=0):
        self._closed = True
        return 0

    def by_step(self):
        with self._lock:
            return {r.step: r for r in self.reports}


def _sanitizer_runtimes(lib_path):
    """Sanitizer runtime libraries libforeshock at lib_path links, per ldd."""
    import subprocess
    try:
        out = subprocess.run(["ldd", lib_path], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    libs = []
    for line in out.splitlines():
        parts = line.split("=>")
        name = parts[0].strip()
        if len(parts) == 2 and (name.startswith("libasan") or name.startswith("libubsan")):
            path = parts[1].split("(")[0].strip()
            if path:
                libs.append(path)
    # ASan's runtime must come first.
    return sorted(libs, key=lambda p: "libasan" not in p)


def preload_sanitizers(lib_path, argv=None):
    """A Python process cannot dlopen an ASan-instrumented libforeshock (the
    runtime must be loaded first). When lib_path is such a build (the
    -DFORESHOCK_SANITIZE=ON tree) and the runtimes are not preloaded yet,
    re-executes this interpreter with them in LD_PRELOAD and leak detection
    off (CPython and torch do not free everything at exit); every other
    sanitizer option, log_path included, is kept, so a real report in the
    library still fails the run. Returns when nothing needs doing."""
    import os
    import sys
    if not os.path.exists(lib_path):
        return
    libs = _sanitizer_runtimes(lib_path)
    pre = os.environ.get("LD_PRELOAD", "")
    if not libs or all(lib in pre.split() or lib in pre.split(":") for lib in libs):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(libs + ([pre] if pre else []))
    opts = env.get("ASAN_OPTIONS", "")
    env["ASAN_OPTIONS"] = (opts + ":" if opts else "") + "detect_leaks=0"
    argv = list(sys.argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + argv, env)
