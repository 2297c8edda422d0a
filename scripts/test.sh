#!/usr/bin/env bash
# Create (or reuse) .venv, install pt2serve with its test and ray extras, run the test suite.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m slow, ./scripts/test.sh tests/test_runner.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh "[test,ray]"  # ray: the replica tests (tests/test_ray_*.py) run on a local Ray cluster
# Two pytest-xdist workers, a test file each at a time in conftest.py's order (the files with exports of their
# own first); they share the session's exported artifacts (tests/conftest.py). -n 0 runs in one process.
exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
