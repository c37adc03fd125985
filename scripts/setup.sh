#!/usr/bin/env bash
# Create .venv and install recspec into it. `scripts/setup.sh test` adds the test tools.
# torch is pinned to 2.13.0: on this kind of machine pip takes the CPU build from local disk,
# while a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
extras=""
if [ "${1:-}" = "test" ]; then extras="[test]"; fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}"
