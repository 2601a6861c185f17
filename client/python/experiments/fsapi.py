"""Reads foreshockd's HTTP API (docs/http-api.md): series, points,
alerts. Standard library only; used by the experiment runner and the
integration tests."""
import json
import urllib.error
import urllib.parse
import urllib.request

PAGE = 10000  # HTTP_MAX_LIMIT


class Api:
    def __init__(self, http, timeout=30.0):
        self.base = "http://" + http
        self.timeout = timeout

    def get(self, path, **params):
        q = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = self.base + path + ("?" + q if q else "")
        with urllib.request.urlopen(url, timeout=self.timeout) as r:
            return json.loads(r.read())

    def pages(self, path, key, **params):
        """Every item of a keyset-paginated list."""
        out, after = [], None
        while True:
            doc = self.get(path, after=after, **params)
            out += doc[key]
            after = doc.get("next")
            if not after:
                return out

    def series(self, run, **filters):
        """[{id, name, labels, points, first_step, last_step}, ...]."""
        return self.pages("/api/v1/series", "series", run=run, limit=PAGE, **filters)

    def points(self, series_id, start=0, end=None):
        """[(step, value or None), ...] in step order."""
        out, frm = [], start
        while frm is not None:
            doc = self.get(f"/api/v1/series/{series_id}/points", **{"from": frm, "to": end,
                                                                     "limit": PAGE})
            out += [(int(s), v) for s, v in doc["points"]]
            frm = doc.get("next_from")
        return out

    def values(self, run, **filters):
        """{(name, layer, head, window, rank): {step: value}} for the run's
        series matching the filters (labels absent in a series are None)."""
        out = {}
        for s in self.series(run, **filters):
            lab = s.get("labels") or {}
            key = (s["name"], lab.get("layer"), lab.get("head"), lab.get("window"),
                   lab.get("rank"))
            out[key] = dict(self.points(s["id"]))
        return out

    def alerts(self, run, **filters):
        return self.pages("/api/v1/alerts", "alerts", run=run, **filters)

    def alert(self, alert_id):
        """One alert with its transition history (oldest first)."""
        return self.get(f"/api/v1/alerts/{alert_id}")

    def firings(self, run):
        """Every transition to firing of the run's alerts, oldest first:
        [{"step", "attribution", "rule", "family", "labels", "alert_id"}].
        An alert that fired, resolved and fired again appears twice (the
        alert row itself only shows its latest incident)."""
        out = []
        for a in self.alerts(run):
            doc = self.alert(a["id"])
            doc = doc.get("alert", doc)  # {"alert": {..., "history": [...]}}
            for ev in doc.get("history") or []:
                if ev.get("to") == "firing" and ev.get("step") is not None:
                    out.append({"step": int(ev["step"]),
                                "attribution": ev.get("attribution") or a["attribution"],
                                "rule": a["rule"], "family": a["family"],
                                "labels": a.get("labels"), "alert_id": a["id"]})
        out.sort(key=lambda f: (f["step"], f["alert_id"]))
        return out

    def run_info(self, run):
        try:
            return self.get("/api/v1/runs/" + urllib.parse.quote(run, safe=""))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise
