#!/usr/bin/env bash
# Create (or reuse) .venv, install pt2serve with its test extras, run the test suite.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m slow, ./scripts/test.sh tests/test_runner.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh "[test]"
exec "$VENV/bin/python" -m pytest -q "$@"
