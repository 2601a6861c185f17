#!/usr/bin/env bash
# Installs every dependency, checks the C sources against .clang-format,
# builds, and runs the whole test suite twice:
# a normal build and an AddressSanitizer + UndefinedBehaviorSanitizer build,
# then runs the libFuzzer targets (frame decoder, HTTP parameters, silences,
# configuration, recordings) for a bounded time each.
#
#   tests/run-all.sh            everything (what CI runs)
#   FUZZ_SECONDS=0 tests/run-all.sh    skip the fuzzers
set -euo pipefail
cd "$(dirname "$0")/.."

JOBS=$(nproc)
FUZZ_SECONDS=${FUZZ_SECONDS:-60}

deploy/install-deps.sh

echo "== torch 2.x venv (tests/python-venv.sh) =="
# The Python client is tested under Debian's torch 1.13 and under this venv
# (pinned torch, transformers, lightning from PyPI): test_torch2_*.py and
# FORESHOCK_TORCH2_TESTS (tests/CMakeLists.txt).
VENV_PYTHON=$(tests/python-venv.sh | tail -n 1)

echo "== format (clang-format, .clang-format) =="
tests/check-format.sh

echo "== build (RelWithDebInfo) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFORESHOCK_VENV_PYTHON="$VENV_PYTHON" >/dev/null
cmake --build build -j"$JOBS"
echo "== tests =="
ctest --test-dir build --output-on-failure -j"$JOBS"

echo "== build (ASan + UBSan) =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DFORESHOCK_SANITIZE=ON \
  -DFORESHOCK_VENV_PYTHON="$VENV_PYTHON" >/dev/null
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
  echo "== fuzz every parser: the frame decoder ${FUZZ_SECONDS}s, the others $((FUZZ_SECONDS / 2))s each =="
  CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DFORESHOCK_FUZZ=ON \
    -DFORESHOCK_SANITIZE=ON -DFORESHOCK_WERROR=OFF >/dev/null
  cmake --build build-fuzz -j"$JOBS" --target fuzz_decode fuzz_http_params fuzz_silence fuzz_config \
    fuzz_spool fuzz_recording
  seeds=$(mktemp -d)
  mkdir -p "$seeds"/decode "$seeds"/http "$seeds"/silence "$seeds"/config "$seeds"/spool \
    "$seeds"/recording
  /usr/bin/python3 tests/fuzz/make_corpus.py . "$seeds"/decode "$seeds"/recording
  printf '\001%s' '1h30m' > "$seeds"/http/duration
  printf '\002%s' '2026-01-02T03:04:05.25+02:00' > "$seeds"/http/time
  printf '\000%s' 'Bearer abc' > "$seeds"/http/bearer
  printf '\004%s' '{"matchers":[{"name":"run","value":"r.*","isRegex":true}],"duration":"2h","createdBy":"ci"}' \
    > "$seeds"/http/silence
  printf '%s' '[{"name":"alertname","value":"qk\\..*","isRegex":true},{"name":"run","value":"a"}]' \
    > "$seeds"/silence/one
  cp deploy/foreshockd.conf.example "$seeds"/config/example
  # fuzz_spool: odd first byte = records appended, then the flips that follow
  printf '\001\010abcdefgh\004wxyz\020%s\003\177' 'sixteen bytes...' > "$seeds"/spool/appended
  printf '\000FSR2%s' 'not a header' > "$seeds"/spool/raw
  printf '\357\273\277[run "team-a-*"]\ntoken = a\n[run "team-b-?"]\ntoken = b\n[advice]\n' \
    > "$seeds"/config/sections
  for t in decode http_params silence config spool recording; do
    secs=$((FUZZ_SECONDS / 2)); dir="$seeds/$t"
    [ "$t" = decode ] && secs=$FUZZ_SECONDS
    [ "$t" = http_params ] && dir="$seeds/http"
    echo "-- fuzz_$t ${secs}s"
    build-fuzz/fuzz_$t -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 "$dir" 2>&1 | tail -n 6
  done
  rm -rf "$seeds"
fi
echo "run-all: every test passed"
