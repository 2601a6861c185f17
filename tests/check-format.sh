#!/usr/bin/env bash
# Fails when a C source or header under daemon/, client/ or tests/ differs
# from what clang-format (with the repository's .clang-format) would write.
# Fix with: tests/check-format.sh --fix
set -euo pipefail
cd "$(dirname "$0")/.."

CF=${CLANG_FORMAT:-clang-format}
command -v "$CF" >/dev/null || { echo "check-format: $CF not found (deploy/install-deps.sh installs it)" >&2; exit 2; }
# Another major version formats the same file differently: the tree is kept in
# clang-format 14's layout (Debian 12's, which deploy/install-deps.sh installs).
CF_MAJOR_WANT=14
CF_VERSION=$("$CF" --version)
CF_MAJOR=$(sed -n 's/.*clang-format version \([0-9][0-9]*\)\..*/\1/p' <<<"$CF_VERSION")
if [ "$CF_MAJOR" != "$CF_MAJOR_WANT" ]; then
  echo "check-format: $CF is '$CF_VERSION'; the tree is formatted with clang-format $CF_MAJOR_WANT" \
       "(set CLANG_FORMAT=clang-format-$CF_MAJOR_WANT, or install Debian 12's clang-format)" >&2
  exit 2
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- 'daemon/*.[ch]' 'client/*.[ch]' 'tests/*.[ch]')
else # a source tarball: every C file under the three folders
  mapfile -t files < <(find daemon client tests -name '*.[ch]' | sort)
fi
[ "${#files[@]}" -gt 0 ] || { echo "check-format: no C files found" >&2; exit 2; }

if [ "${1:-}" = --fix ]; then
  "$CF" -i "${files[@]}"
  echo "check-format: formatted ${#files[@]} files"
  exit 0
fi
if ! "$CF" --dry-run --Werror "${files[@]}"; then
  echo "check-format: the files above differ from clang-format; run tests/check-format.sh --fix" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files clean"
