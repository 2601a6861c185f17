"""No include circle between modules: module A's .c including (directly or
through other headers) B's .h while B's .c includes A's .h. A module is a
file stem (store_read.c and store_read.h are module store_read). Files that
include one shared *_internal.h are one module split in several files (a
family): circles inside a family are allowed.

Scope: daemon/*.c|h and client/libforeshock/*.c|h, each directory its own
graph. No circle needs the exemption today; the families are store_internal.h,
http_internal.h, ingest_internal.h, pager_internal.h, run_internal.h and
stage_internal.h. Reads files only; no daemon. Every circle is listed
before it fails.
"""
import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402

DIRS = ["daemon", "client/libforeshock"]
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE_RE.findall(f.read())


def closure(d, name, direct, seen):
    """The headers of directory d that file `name` reaches."""
    for h in direct.get(name, []):
        if h not in seen and os.path.exists(os.path.join(d, h)):
            seen.add(h)
            closure(d, h, direct, seen)
    return seen


def circles(d):
    files = [os.path.basename(p) for p in glob.glob(os.path.join(d, "*.[ch]"))]
    direct = {f: includes(os.path.join(d, f)) for f in files}
    stem = lambda f: os.path.splitext(f)[0]  # noqa: E731
    sources = sorted(f for f in files if f.endswith(".c"))
    # family: every file that includes X_internal.h belongs to family X_internal.
    family = {}
    for f in sources:
        for h in direct[f]:
            if h.endswith("_internal.h"):
                family.setdefault(stem(f), set()).add(h)
    deps = {}
    for f in sources:
        reach = closure(d, f, direct, set())
        deps[stem(f)] = {stem(h) for h in reach if stem(h) != stem(f) and stem(h) + ".c" in files}
    found = []
    for a in sorted(deps):
        for b in sorted(deps[a]):
            if a < b and a in deps.get(b, set()):
                if family.get(a, set()) & family.get(b, set()):
                    continue
                found.append(f"{d}: {a}.c reaches {b}.h and {b}.c reaches {a}.h")
    return found, len(sources)


def main(args, workdir):
    src = os.path.abspath(args.source_dir)
    problems, checked = [], 0
    for d in DIRS:
        found, n = circles(os.path.join(src, d))
        problems += found
        checked += n
    fstest.check(checked > 20, f"only {checked} sources found: the scan is broken")
    fstest.check(not problems, "\n".join(problems))


if __name__ == "__main__":
    fstest.run_main(main)
