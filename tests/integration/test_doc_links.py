"""The documentation's links cannot rot: every markdown link or image to a
local path in README.md, docs/*.md, tests/README.md and
client/python/README.md names a file or directory that exists, and a link
with a #fragment names a heading of its target page (GitHub's anchor of
that heading). The README stays the front door: at most 300 lines, and
every page under docs/ is listed in it.

Reads files only; no daemon. All problems are listed before it fails.
"""
import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402

README_MAX_LINES = 300

# [text](target) and ![alt](target); the target ends at the first space or ')'.
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages(src):
    names = ["README.md", "tests/README.md", "client/python/README.md"]
    names += sorted(os.path.relpath(p, src) for p in glob.glob(os.path.join(src, "docs", "*.md")))
    return names


def prose_lines(text):
    """The lines outside fenced and indented code blocks."""
    fence = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
            continue
        if fence or line.startswith("    ") or line.startswith("\t"):
            continue
        yield line


def anchor(heading):
    """GitHub's anchor of a heading: lower case, markup and punctuation
    other than '-' and '_' dropped, spaces to '-'."""
    s = heading.strip().lower()
    s = re.sub(r"[`*]", "", s)
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    seen = {}
    out = set()
    with open(path, encoding="utf-8") as f:
        for line in prose_lines(f.read()):
            m = HEADING_RE.match(line)
            if not m:
                continue
            a = anchor(m.group(2))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def main(args, workdir):
    src = os.path.abspath(args.source_dir)
    problems = []
    checked = 0
    for page in pages(src):
        path = os.path.join(src, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for line in prose_lines(text):
            for target in LINK_RE.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                checked += 1
                file_part, _, frag = target.partition("#")
                dest = path if not file_part else os.path.normpath(
                    os.path.join(os.path.dirname(path), file_part))
                if not os.path.exists(dest):
                    problems.append(f"{page}: link to {target}: {os.path.relpath(dest, src)} does not exist")
                    continue
                if frag and dest.endswith(".md") and frag not in anchors(dest):
                    problems.append(f"{page}: link to {target}: no heading with anchor #{frag} "
                                    f"in {os.path.relpath(dest, src)}")
    print(f"checked {checked} local links in {len(pages(src))} pages", flush=True)

    with open(os.path.join(src, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    n = readme.count("\n")
    if n > README_MAX_LINES:
        problems.append(f"README.md has {n} lines, more than {README_MAX_LINES}: move reference text to docs/")
    for page in pages(src):
        if page.startswith("docs/") and f"]({page})" not in readme:
            problems.append(f"README.md's documentation index does not link {page}")

    fstest.check(checked > 0, "no local links found: the link pattern is broken")
    fstest.check(not problems, "\n".join(problems))


if __name__ == "__main__":
    fstest.run_main(main)
