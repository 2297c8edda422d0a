# Sourced by quickstart.sh and test.sh: create (or reuse) the venv in $VENV and install pt2serve into it.
# Usage: source scripts/venv.sh [pip extras, e.g. "[test]"]
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# torch 2.13.0 is the CPU build available locally; other versions download several GB. --no-compile: Python
# compiles the modules it imports when it first imports them; compiling every installed file up front
# (torch, ray) took about a third of a fresh install (98 -> 65 s for the test extras on 2 cores).
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile -e ".${1:-}"
