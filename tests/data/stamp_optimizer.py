"""Stamps the optimizer's class name into the stored model shape of a
corpus's runs, as a Monitor that knows the optimizer sends it in Hello
(ModelShape.optimizer, stored in runs.model_json).

Corpora recorded before the client sent it hold no optimizer, and the
daemon then judges every run as under an adaptive optimizer (docs/detection.md,
"SGD"). Their training is unchanged by it: the optimizer is a fact of
the recorder's arguments (client/python/experiments/CORPUS.md), not of
the series.

    /usr/bin/python3 tests/data/stamp_optimizer.py tests/data/corpus-holdout5 \
        --arch-contains sgd --optimizer SGD

Every run whose manifest `arch` contains the given text gets
"optimizer": NAME in its model_json (a run without a stored shape gets a
shape holding only it); the corpus.db.xz is rewritten in place, as
build_corpus.py compresses it. Prints how many runs it stamped; exit 1
when none matched.
"""
import argparse
import json
import lzma
import os
import shutil
import sqlite3
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", help="a corpus directory (manifest.json, corpus.db.xz)")
    ap.add_argument("--arch-contains", required=True)
    ap.add_argument("--optimizer", required=True, help="the class name, e.g. SGD")
    a = ap.parse_args()
    if not (0 < len(a.optimizer) <= 64 and a.optimizer.isascii() and a.optimizer.isprintable()):
        sys.exit("--optimizer: 1..64 printable ASCII characters")
    with open(os.path.join(a.corpus, "manifest.json")) as f:
        runs = [r["name"] for r in json.load(f)["runs"] if a.arch_contains in r["arch"]]
    xz_path = os.path.join(a.corpus, "corpus.db.xz")
    with tempfile.TemporaryDirectory() as tmp:
        db_path = os.path.join(tmp, "corpus.db")
        with lzma.open(xz_path, "rb") as src, open(db_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        db = sqlite3.connect(db_path)
        stamped = 0
        for name in runs:
            row = db.execute("SELECT model_json FROM runs WHERE name = ?", (name,)).fetchone()
            if row is None:
                continue
            shape = json.loads(row[0]) if row[0] else {}
            shape["optimizer"] = a.optimizer
            db.execute("UPDATE runs SET model_json = ? WHERE name = ?",
                       (json.dumps(shape, sort_keys=True, separators=(",", ":")), name))
            stamped += 1
        if not stamped:
            print(f"{a.corpus}: no run's arch contains {a.arch_contains!r}", file=sys.stderr)
            return 1
        db.commit()
        db.execute("VACUUM")
        db.close()
        out = os.path.join(tmp, "corpus.db.xz")
        with open(db_path, "rb") as f, lzma.open(out, "wb",
                                                 preset=9 | lzma.PRESET_EXTREME) as g:
            shutil.copyfileobj(f, g)
        shutil.move(out, xz_path)
    print(f"{a.corpus}: stamped {stamped} run(s) with optimizer {a.optimizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
