"""SQL text has one home per connection (http_sql.c's head says which): a
C string literal that starts an SQL statement appears in daemon/*.c|h only
in the store_* files (the writer's, and store_rw.c, the remote-write
sender's own read-only connection), http_sql.c (the HTTP read connections
and /metrics) and pager_outbox.c (the pager's). The embedded schema
(schema/*.sql) is not C and is not scanned.

Reads files only; no daemon. Every stray literal is listed before it fails.
"""
import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402

# A literal opening a statement: a keyword and a space, or a transaction
# verb alone ("DELETE" alone is an HTTP method, not SQL).
SQL_RE = re.compile(r'"(?:(?:SELECT|INSERT|UPDATE|DELETE FROM|CREATE|PRAGMA|WITH|REPLACE|DROP'
                    r'|ALTER)\s|(?:BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE)\b)')


def is_home(name):
    return name.startswith("store_") or name in ("http_sql.c", "pager_outbox.c")


def main(args, workdir):
    src = os.path.abspath(args.source_dir)
    problems, homed = [], 0
    for path in sorted(glob.glob(os.path.join(src, "daemon", "*.[ch]"))):
        name = os.path.basename(path)
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if not SQL_RE.search(line):
                    continue
                if is_home(name):
                    homed += 1
                else:
                    problems.append(f"daemon/{name}:{no}: SQL outside its home: {line.strip()}")
    fstest.check(homed > 50, f"only {homed} SQL literals found in their homes: the scan is broken")
    fstest.check(not problems, "\n".join(problems))


if __name__ == "__main__":
    fstest.run_main(main)
