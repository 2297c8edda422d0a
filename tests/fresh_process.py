"""Running a Python script in a fresh process without Triton's interpreter. Tests that torch.export a Triton
operator need one: under the interpreter (which conftest.py sets for the test process when there is no GPU),
export hands the operator's fake tensors to the kernels and traces into them instead of keeping the operator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_without_interpreter(script: str, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python -c script args...` from the checkout's root (its pt2serve first on the path); fails the test
    with the end of stderr unless it exits 0."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
