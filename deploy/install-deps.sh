#!/usr/bin/env bash
# Installs every Debian package Foreshock needs to build, run and test.
# Idempotent and quiet: packages already present are left alone.
# Usage: deploy/install-deps.sh            (build + runtime + test packages)
set -euo pipefail

PKGS=(
  # build
  build-essential cmake pkg-config clang
  # the house format, checked by tests/check-format.sh (its version is the one
  # .clang-format was written for: Debian 12's clang-format 14)
  clang-format
  # daemon and client libraries
  libuv1-dev libprotobuf-c-dev protobuf-c-compiler libsqlite3-dev
  libopenblas-dev liblapacke-dev libmicrohttpd-dev libcurl4-openssl-dev
  libjansson-dev
  # silence regexes: PCRE2, whose compile, match, depth and heap limits
  # bound what a hostile matcher costs (glibc regcomp took 8 GB for one)
  libpcre2-dev
  # remote write: snappy block compression (the protocol mandates it)
  libsnappy-dev
  # tests: Criterion, sanitizer/fuzzer runtimes, sqlite3 shell, curl
  libcriterion-dev libclang-rt-14-dev sqlite3 curl procps
  # Python side: protobuf runtime + protoc for the generated module, numpy
  python3 python3-numpy python3-protobuf protobuf-compiler
  # bench_monitor's numpy reference calls BLAS dtrmm, as the C module does
  python3-scipy
  # paging: HMAC-SHA256 for signed webhooks (OpenSSL libcrypto, already
  # pulled in by libcurl4-openssl-dev); TLS on ingest and in libforeshock
  # (libssl); the openssl CLI makes the TLS tests' throwaway CA
  libssl-dev openssl
  # dashboard: the plotting library, served by the daemon from its binary
  libjs-dygraphs
  # real peers for the integration tests: Alertmanager (+ amtool), promtool,
  # headless Chromium for the dashboard
  prometheus-alertmanager prometheus chromium
  # remote write is tested against VictoriaMetrics as well as Prometheus
  victoria-metrics
  # the deploy-file checks parse the Kubernetes example
  python3-yaml
  # the unit and sysusers checks (systemd-analyze, systemd-sysusers; the
  # package, not a running systemd)
  systemd
  # the Debian packages: cpack's DEB generator takes dependencies from
  # dpkg-shlibdeps (dpkg-dev), which it runs only where file(1) is
  dpkg-dev file
  # the Python wheel, built and installed into a venv without an index:
  # setuptools and bdist_wheel from Debian, venv with its bundled pip
  python3-setuptools python3-wheel python3-venv python3-pip
  # PyTorch client tests and the fault-injection experiments (plots)
  python3-torch python3-matplotlib
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
echo "install-deps: installing ${#missing[@]} package(s): ${missing[*]}"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
