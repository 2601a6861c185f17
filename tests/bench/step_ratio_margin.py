#!/usr/bin/env python3
"""How close each run of a built corpus came to a relative breach of its
per-step update ratio: for every step after --after, step_update_ratio
divided by the median of its previous --history values, and the largest
such ratio with its step (the margin below the step_update_ratio rule's
breach factor). Reads the corpus's corpus.db.xz (tests/data/build_corpus.py
keeps the series); runs without the series are listed as such.

    /usr/bin/python3 tests/bench/step_ratio_margin.py tests/data/corpus-holdout11 \\
        [--runs healthy] [--after 300] [--history 64]

--runs: only runs whose name contains this text. Prints one table row a
run (Markdown): the largest ratio, its step, the value there and the
median it is compared with, and the longest run of consecutive steps at or
above --factor.
"""
import argparse
import lzma
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile


def margins(values, after, history, factor):
    """values: [(step, value)] in step order. Returns (ratio, step, value,
    median, longest streak at or above factor), or None when no step after
    `after` has a full history with a positive median."""
    best, streak, longest = None, 0, 0
    for i in range(history, len(values)):
        step, v = values[i]
        med = statistics.median(x for _, x in values[i - history:i])
        if step <= after or med <= 0:
            streak = 0
            continue
        r = v / med
        streak = streak + 1 if r >= factor else 0
        longest = max(longest, streak)
        if best is None or r > best[0]:
            best = (r, step, v, med)
    return None if best is None else best + (longest,)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", help="a built corpus directory (corpus.db.xz, manifest.json)")
    ap.add_argument("--runs", default="", help="only runs whose name contains this")
    ap.add_argument("--after", type=int, default=300)
    ap.add_argument("--history", type=int, default=64)
    ap.add_argument("--factor", type=float, default=3.0, help="breach factor for the streak")
    a = ap.parse_args()
    src = os.path.join(a.corpus, "corpus.db.xz")
    if not os.path.exists(src):
        sys.exit(f"{src}: no such file")
    with tempfile.TemporaryDirectory(prefix="step-ratio-") as tmp:
        db = os.path.join(tmp, "corpus.db")
        with lzma.open(src) as f, open(db, "wb") as g:
            shutil.copyfileobj(f, g)
        con = sqlite3.connect(db)
        names = [n for (n,) in con.execute("SELECT name FROM runs ORDER BY name")
                 if a.runs in n]
        print(f"| run | max ratio to median of previous {a.history} (after {a.after}) | step "
              f"| value | median | longest streak >= {a.factor:g}x |")
        print("|---|---|---|---|---|---|")
        for name in names:
            pts = con.execute(
                "SELECT p.step, p.value FROM points p JOIN series s ON s.id = p.series_id "
                "JOIN runs r ON r.id = s.run_id WHERE r.name = ? AND s.name = "
                "'step_update_ratio' AND s.rank = 0 AND p.value IS NOT NULL ORDER BY p.step",
                (name,)).fetchall()
            m = margins(pts, a.after, a.history, a.factor) if pts else None
            if m is None:
                print(f"| `{name}` | no series | | | | |")
                continue
            r, step, v, med, longest = m
            print(f"| `{name}` | {r:.2f} | {step} | {v:.3g} | {med:.3g} | {longest} |")
        con.close()


if __name__ == "__main__":
    main()
