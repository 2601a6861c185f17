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
        return {"submitted": n, "acked": n, "dropped": 0, "buffered_reports": 0,
                "connected": 1, "last_error": ""}

    def flush(self, timeout_s=None):
        return 0

    def close(self, timeout_s=0):
        self._closed = True
        return 0

    def by_step(self):
        with self._lock:
            return {r.step: r for r in self.reports}
