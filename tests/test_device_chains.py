"""scripts/device/run.py and chains.toml, on the CPU: every chain names known steps, every step's script (the
preamble, then its command) is valid bash, --dry-run prints each step it would run, and a chain of stand-in steps
runs in the foreground with its states, the skip of a present artifact, SKIP, and the table at its end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_PY = ROOT / "scripts" / "device" / "run.py"


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("device_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_run"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_every_step_is_valid_bash(driver):
    preamble, steps, chains = driver.load()
    expected = {"8b", "fp8", "quant", "soak", "speculate", "cuda-tests", "prefix-reuse", "http-overhead", "long"}
    assert expected <= set(chains)
    for step in steps.values():
        checked = subprocess.run(["bash", "-n"], input=driver.script(preamble, step), text=True, capture_output=True)
        assert checked.returncode == 0, (step.name, checked.stderr)


def test_every_step_is_in_a_chain(driver):
    _, steps, chains = driver.load()
    used = {step for chain in chains.values() for entry in chain["steps"]
            for step in (entry if isinstance(entry, list) else [entry])}
    assert used == set(steps)


def test_the_long_chain_runs_the_long_context_benchmarks(driver):
    _, steps, chains = driver.load()
    plan = driver.plan(["long"], steps, chains)
    assert [p.step.name for p in plan.steps] == ["export", "long-host", "long-sweep", "long-prefill"]
    # The default max context: the export names no --max-context.
    assert plan.steps[0].env == {"ART": "/tmp/long.pt2", "PRESET": "llama-3.1-8b", "FORWARD_SIZES": "1,32,64"}
    assert "--mode sweep --tokens 1,32,64 --context 512,4000" in plan.steps[2].step.run
    assert "--prompt-tokens 8192" in plan.steps[3].step.run and "--prompt-tokens 32000" in plan.steps[3].step.run


def test_dry_run_prints_every_step_and_runs_nothing(tmp_path):
    env = {**os.environ, "CHAIN_DIR": str(tmp_path / "chain"), "SKIP": "profile", "FORWARD_SIZES": "1,32"}
    done = subprocess.run([sys.executable, str(RUN_PY), "start", "--dry-run", "8b", "soak"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for step_id in ("8b.export", "8b.sweep", "8b.matmuls", "8b.serving", "8b.startup", "soak.export", "soak.soak"):
        assert f": {step_id}" in done.stdout, step_id
    assert "8b.profile SKIPPED (SKIP)" in done.stdout
    assert "skipped while $ART exists" in done.stdout and "ART=/tmp/model.pt2" in done.stdout
    assert "FORWARD_SIZES" not in done.stdout.split("8b.export", 1)[1].split("\n")[1]  # not a chain env of 8b
    assert not (tmp_path / "chain").exists()
    unknown = subprocess.run([sys.executable, str(RUN_PY), "start", "nope"], env=env, capture_output=True, text=True)
    assert unknown.returncode != 0 and "unknown: nope" in unknown.stderr


CHAINS = '''
preamble = """
say() { echo "said: $*"; }
"""

[steps.make]
about = "writes ART"
creates = "$ART"
run = """
say making; echo made > "$ART"
"""

[steps.measure]
about = "a bench-like JSON in OUT"
timeout = 30
run = """
test "$CXX" = /usr/bin/g++
python3 -c 'import json, os; json.dump({"mode": "startup", "runs": [{"ready_seconds": 1.5}]}, \\
open(os.environ["OUT"] + "/startup.json", "w"))'
"""

[steps.fails]
about = "exits 3"
run = "say failing; exit 3"

[steps.slow]
about = "runs past its timeout"
timeout = 2
run = "sleep 60"

[steps.skipped]
about = "left out by SKIP"
run = "exit 1"

[chains.demo]
env = { ART = "ART_PATH" }
steps = ["make", ["measure", "fails", "slow"], "skipped"]

[chains.broken]
env = { ART = "/nonexistent/dir/x" }
steps = ["make", "measure"]
'''


def test_a_chain_runs_in_the_foreground_and_polls(driver, tmp_path, monkeypatch, capsys):
    chains = tmp_path / "chains.toml"
    art = tmp_path / "art.txt"
    chains.write_text(CHAINS.replace("ART_PATH", str(art)))
    folder = tmp_path / "chain"
    folder.mkdir()
    monkeypatch.setenv("SKIP", "skipped")
    monkeypatch.setattr(driver, "SITE", tmp_path / "no-site")
    monkeypatch.setattr(driver, "install_wheels", lambda repo: None)  # a checkout's .whl/ is the GPU machine's
    preamble, steps, defined = driver.load(chains)
    code = driver.execute(driver.plan(["demo", "broken"], steps, defined), preamble, ROOT, folder)
    assert code == 1  # a step failed
    state = driver.State(folder)
    assert state.get("demo.make").startswith("exit 0") and art.read_text() == "made\n"
    assert "said: making" in state.log("demo.make").read_text()
    assert state.get("demo.measure").startswith("exit 0")
    assert state.get("demo.fails").startswith("exit 3")
    assert state.get("demo.slow").startswith("timed out after")
    assert state.get("demo.skipped") == "skipped (SKIP)"
    assert state.get("broken.make").startswith("exit 1") and "missing" in state.get("broken.make")
    assert state.get("broken.measure").startswith("not run: make did not write")
    printed = capsys.readouterr().out
    assert "== chain demo done" in printed and "| demo.measure | exit 0" in printed
    assert "startup: launch to 200: 1.5 s" in printed
    assert json.loads((folder / "plan.json").read_text())[1] == ["demo.measure", "demo.fails", "demo.slow"]

    # A second run reuses what the first one made.
    driver.execute(driver.plan(["demo"], steps, defined), preamble, ROOT, folder)
    assert state.get("demo.make") == f"reused {art}"

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    driver.poll(folder)
    polled = capsys.readouterr().out
    assert "== demo.fails: exit 3" in polled and "said: failing" in polled and "chain finished at" in polled
    assert (out / "chain.tar.gz").stat().st_size > 0
