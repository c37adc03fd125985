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
# pip would byte-compile the ~20,000 installed modules on one core; compileall does it on all of
# them (a few files written for Python 2 in some packages do not compile: pip skips them too)
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile "$@"; }
pip_install "torch==2.13.0"
extras="[all]"
if [ "${1:-}" = "test" ]; then extras="[test]"; fi
pip_install -e ".${extras}"
.venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
