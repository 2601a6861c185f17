#!/usr/bin/env bash
# The torch 2.x environment the Python client is also tested in: a venv of
# Debian's /usr/bin/python3 (python3-venv, deploy/install-deps.sh) with the
# pinned releases below from PyPI. Debian's python3-torch (1.13) stays the
# default interpreter of the integration tests; this one runs
# tests/integration/test_torch2_*.py and the FORESHOCK_TORCH2_TESTS of
# tests/CMakeLists.txt (cmake -DFORESHOCK_VENV_PYTHON=...).
#
#   tests/python-venv.sh [DIR]     default DIR: build-venv (gitignored)
#
# Idempotent: a DIR whose interpreter already has exactly these versions is
# reused as it is; anything else there is removed and built again. Prints
# the venv's python path as the last line of stdout (pip's output goes to
# stderr). PyPI's torch wheel for Linux is the CUDA build: about 2.5 GB of
# wheels, 5-6 GB installed; the tests use its CPU side only.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-build-venv}
BASE_PYTHON=${FORESHOCK_VENV_BASE_PYTHON:-/usr/bin/python3}
PINS=(
  torch==2.15.0
  numpy==2.4.6
  transformers==5.25.0
  accelerate==1.16.0
  lightning==2.6.6
  # LoRA / DoRA adapters as users fine-tune with them (test_torch2_peft.py).
  peft==0.21.2
  # What the client and the tests import beyond torch and numpy: fstest's
  # proto_module (python protobuf); the client itself needs only ctypes.
  protobuf==7.36.2
)

# Exit 0 when every pin is installed at its exact version.
have_pins() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - "${PINS[@]}" <<'EOF'
import sys
from importlib import metadata
for pin in sys.argv[1:]:
    name, _, want = pin.partition("==")
    try:
        got = metadata.version(name)
    except metadata.PackageNotFoundError:
        got = None
    if got != want:
        print(f"python-venv: {name} is {got or 'missing'}, want {want}", file=sys.stderr)
        sys.exit(1)
EOF
}

if have_pins; then
  echo "python-venv: $VENV has the pinned set, reused" >&2
else
  [ -x "$BASE_PYTHON" ] || { echo "python-venv: $BASE_PYTHON not found" \
    "(deploy/install-deps.sh installs python3 and python3-venv)" >&2; exit 1; }
  echo "python-venv: building $VENV from $BASE_PYTHON (${PINS[*]})" >&2
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
    "${PINS[@]}" >&2
  have_pins || { echo "python-venv: pip did not install the pinned set" >&2; exit 1; }
  "$VENV/bin/python" -c 'import torch, transformers, lightning, accelerate, peft, numpy' >&2
fi
echo "$(cd "$VENV" && pwd)/bin/python"
