#!/usr/bin/env bash
# Create (or reuse) .venv, install pt2serve with its test extras, run the test suite.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m slow, ./scripts/test.sh tests/test_runner.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# torch 2.13.0 is the CPU build available locally; other versions download several GB.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
exec "$VENV/bin/python" -m pytest -q "$@"
