"""No function in daemon/*.c is longer than FUNCTION_MAX_LINES lines, counted
from the first line of its signature to its closing brace (inclusive).

Files only, no daemon. The daemon's format (tests/check-format.sh, the
repository's .clang-format) puts a function's opening and closing braces
alone in column 0 and indents the continuation lines of a signature, which
is what the scan relies on: a "{" line in column 0 opens a body, the
signature starts at the nearest line above it that is not indented, and the
next "}" line in column 0 closes it.

Run: python3 tests/integration/test_function_length.py [--source-dir DIR]
[FILE.c ...] (no files: every DIR/daemon/*.c; --build-dir, which ctest
passes to every integration test, is accepted and unused). Exits 1 listing each function over the
limit, longest first (KNOWN_OVER below lists the few that may stay over for
now, at most at their present length).
"""
import argparse
import glob
import os
import sys

FUNCTION_MAX_LINES = 120

# Functions still over the limit, each with the length it has today: one may
# shrink (then its row must go) but never grow, and no other may join it.
# None today: every function in daemon/ is within the limit.
KNOWN_OVER = {}

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def functions(path):
    """Yields (name, first_line, length) for each function body in path."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        if lines[i] != "{":
            i += 1
            continue
        start = i - 1
        while start > 0 and lines[start][:1] in (" ", "\t"):
            start -= 1
        end = i + 1
        while end < len(lines) and lines[end] != "}":
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: a body opens and never closes in column 0")
        signature = " ".join(l.strip() for l in lines[start:i])
        name = signature.split("(", 1)[0].split()[-1].lstrip("*") if "(" in signature else "?"
        yield name, start + 1, end - start + 1
        i = end + 1


def check(root, paths):
    over = []
    count = 0
    for path in paths:
        for name, line, length in functions(path):
            count += 1
            rel = os.path.relpath(path, root)
            known = KNOWN_OVER.get((rel, name))
            if known is not None and length <= FUNCTION_MAX_LINES:
                over.append((length, rel, line, name, "now within the limit: drop its KNOWN_OVER row"))
            elif known is not None and length > known:
                over.append((length, rel, line, name, f"grew past its KNOWN_OVER {known}"))
            elif known is None and length > FUNCTION_MAX_LINES:
                over.append((length, rel, line, name, f"limit {FUNCTION_MAX_LINES}"))
    if count == 0:
        raise ValueError("no function found: the scan no longer matches the format")
    over.sort(reverse=True)
    return count, over


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--source-dir", default=ROOT)
    ap.add_argument("--build-dir")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args(argv[1:])
    root = os.path.abspath(args.source_dir)
    paths = args.files or sorted(glob.glob(os.path.join(root, "daemon", "*.c")))
    if not paths:
        print("FAIL: no daemon/*.c found under " + root)
        return 1
    count, over = check(root, paths)
    for length, path, line, name, why in over:
        print(f"FAIL: {path}:{line}: {name}() is {length} lines ({why})")
    if over:
        return 1
    print(f"ok: {count} functions in {len(paths)} files, none over {FUNCTION_MAX_LINES} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
