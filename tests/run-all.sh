#!/usr/bin/env bash
# Installs every dependency, builds, and runs the whole test suite twice:
# a normal build and an AddressSanitizer + UndefinedBehaviorSanitizer build,
# then runs the frame-decoder fuzzer for a bounded time.
#
#   tests/run-all.sh            everything (what CI runs)
#   FUZZ_SECONDS=0 tests/run-all.sh    skip the fuzzer
set -euo pipefail
cd "$(dirname "$0")/.."

JOBS=$(nproc)
FUZZ_SECONDS=${FUZZ_SECONDS:-60}

deploy/install-deps.sh

echo "== build (RelWithDebInfo) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$JOBS"
echo "== tests =="
ctest --test-dir build --output-on-failure -j"$JOBS"

echo "== build (ASan + UBSan) =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DFORESHOCK_SANITIZE=ON >/dev/null
cmake --build build-asan -j"$JOBS"
echo "== tests under ASan + UBSan =="
# Criterion runs each test in a forked worker and does not turn a sanitizer
# report at worker exit (a leak, say) into a failure, so every report goes
# to a log file and any such file fails the run.
sanlogs=$(mktemp -d)
set +e
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:log_path=$sanlogs/asan" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$sanlogs/ubsan" \
  ctest --test-dir build-asan --output-on-failure -j"$JOBS"
rc=$?
set -e
if compgen -G "$sanlogs/*" >/dev/null; then
  echo "sanitizer reports:"
  cat "$sanlogs"/*
  rc=1
fi
rm -rf "$sanlogs"
[ "$rc" -eq 0 ] || { echo "run-all: sanitizer tests failed"; exit "$rc"; }

if [ "$FUZZ_SECONDS" -gt 0 ]; then
  echo "== fuzz the frame decoder for ${FUZZ_SECONDS}s =="
  CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DFORESHOCK_FUZZ=ON \
    -DFORESHOCK_SANITIZE=ON -DFORESHOCK_WERROR=OFF >/dev/null
  cmake --build build-fuzz -j"$JOBS" --target fuzz_decode
  corpus=$(mktemp -d)
  /usr/bin/python3 tests/fuzz/make_corpus.py . "$corpus"
  build-fuzz/fuzz_decode -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 "$corpus" 2>&1 | tail -n 15
  rm -rf "$corpus"
fi
echo "run-all: every test passed"
