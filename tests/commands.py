"""`pt2serve` commands run one after another in one fresh interpreter, for commands that refuse bad input:
importing the exporter (torch, Inductor) costs seconds, each refusal almost nothing."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs the `pt2serve` entry point (pt2serve.cli:app) on each argument list it reads and answers with one JSON
# line: [exit code, stdout, stderr]. An exception that escapes is printed and exits 1, as the interpreter would.
SCRIPT = """
import contextlib, io, json, sys, traceback
from pt2serve.cli import app
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app(json.loads(line), prog_name="pt2serve")
            code = 0
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


def run_in_one_interpreter(commands: list[list[str]], env: dict[str, str] | None = None,
                           timeout: float = 180) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each command (`pt2serve`'s arguments), in order."""
    lines = "".join(json.dumps(command) + "\n" for command in commands)
    done = subprocess.run([sys.executable, "-c", SCRIPT], input=lines, capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [tuple(json.loads(line)) for line in done.stdout.splitlines()]
    assert len(answers) == len(commands), done.stdout[-3000:]
    return answers
