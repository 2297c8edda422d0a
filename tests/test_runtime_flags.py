"""The step budget and KV pool flags of serve-artifact and bench: they reach RunnerConfig / ExecutorConfig, a flag
left out keeps the runtime's own default, a bad value is a clear error, and the help says what the defaults are.
"""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from pt2serve.cli import app
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.engine import describe_load, open_runner
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.executor import CPU_POOL_TOKENS, Executor, ExecutorConfig
from pt2serve.runtime.drafter import Speculation
from pt2serve.runtime.runner import DEFAULT_TOKEN_BUDGET, RunnerConfig

BUDGET_FLAGS = ["--token-budget", "40", "--max-decode-sequences", "3", "--min-prefill-chunk", "5"]


class Stop(Pt2ServeError):
    pass


@pytest.fixture()
def captured_configs(monkeypatch):
    """serve-artifact's loader gets the configs and stops there (the server then exits with the message)."""
    seen = {}

    def load(path, device=None, executor_config=ExecutorConfig(), runner_config=RunnerConfig(), **_):
        seen.update(executor=executor_config, runner=runner_config)
        raise Stop("stopped by the test after reading the configs")

    monkeypatch.setattr("pt2serve.runtime.engine.open_runner", load)
    return seen


def serve(artifact, *args: str):
    return CliRunner().invoke(app, ["serve-artifact", str(artifact), "--port", "0", *args])


def test_serve_flags_reach_the_configs(tiny_artifact, captured_configs):
    result = serve(tiny_artifact, *BUDGET_FLAGS, "--num-cells", "900", "--kv-memory-fraction", "0.3",
                   "--max-sessions", "7", "--session-pin-seconds", "30", "--no-prefix-cache")
    assert "stopped by the test" in result.output, result.output
    runner, executor = captured_configs["runner"], captured_configs["executor"]
    assert (runner.token_budget, runner.max_decode_sequences, runner.min_prefill_chunk) == (40, 3, 5)
    assert (runner.max_sessions, runner.session_pin_seconds, runner.prefix_cache) == (7, 30.0, False)
    assert (executor.num_cells, executor.kv_memory_fraction) == (900, 0.3)


def test_serve_flags_left_out_keep_the_runtime_defaults(tiny_artifact, captured_configs):
    serve(tiny_artifact, "--token-budget", "40")
    assert captured_configs["runner"] == RunnerConfig(token_budget=40)
    assert captured_configs["executor"] == ExecutorConfig()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--token-budget", "0"], "--token-budget must be at least 1, got 0"),
        (["--max-decode-sequences", "0"], "--max-decode-sequences must be at least 1, got 0"),
        (["--min-prefill-chunk", "-3"], "--min-prefill-chunk must be at least 1, got -3"),
        (["--num-cells", "1"], "--num-cells must be at least 2"),
        (["--kv-memory-fraction", "1.5"], "kv_memory_fraction must be in (0, 0.95]"),
        (["--kv-memory-fraction", "0"], "kv_memory_fraction must be in (0, 0.95]"),
        (["--session-pin-seconds", "-1"], "--session-pin-seconds must be a number of seconds >= 0, got -1.0"),
        (["--speculate", "eagle"], "--speculate must be one of none, ngram, dflash, got 'eagle'"),
        (["--num-draft-tokens", "3"], "--num-draft-tokens applies with --speculate ngram or dflash only"),
        (["--speculate", "ngram", "--num-draft-tokens", "0"], "--num-draft-tokens must be at least 1, got 0"),
    ],
)
def test_serve_bad_values_are_clear_errors(tiny_artifact, captured_configs, args, message):
    result = serve(tiny_artifact, *args)
    assert result.exit_code != 0
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output and not captured_configs  # refused before loading


def bench(artifact, tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", str(artifact), "--mode", "requests", "--requests", "3",
                                      "--prompt-tokens", "12", "--max-new-tokens", "3", "--json", str(out), *args])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_bench_flags_reach_the_scheduler_and_the_pool(tiny_artifact, tmp_path):
    doc = bench(tiny_artifact, tmp_path, *BUDGET_FLAGS, "--num-cells", "900")
    assert doc["step_budget"] == {"token_budget": 40, "max_decode_sequences": 3, "min_prefill_chunk": 5}
    assert doc["num_cells"] == 900
    assert doc["num_steps"] > 0 and doc["mean_step_width"] <= 40


def test_speculation_flags_reach_the_runner(tiny_artifact, captured_configs):
    serve(tiny_artifact, "--speculate", "ngram", "--num-draft-tokens", "6")
    assert captured_configs["runner"] == RunnerConfig(speculate=Speculation.NGRAM, num_draft_tokens=6)
    serve(tiny_artifact, "--speculate", "none")
    assert captured_configs["runner"] == RunnerConfig()


def test_bench_reports_speculation(toy_artifact, tmp_path):
    doc = bench(toy_artifact, tmp_path, "--speculate", "ngram", "--num-draft-tokens", "2")
    speculation = doc["speculation"]
    assert set(speculation) == {"draft_tokens", "accepted_tokens", "verify_steps", "acceptance_rate",
                                "accepted_per_step"}
    assert bench(toy_artifact, tmp_path)["speculation"] is None
    result = CliRunner().invoke(app, ["bench", str(toy_artifact), "--num-draft-tokens", "63", "--speculate", "ngram",
                                      "--mode", "requests", "--requests", "1", "--prompt-tokens", "4",
                                      "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["bench", str(toy_artifact), "--mode", "requests", "--speculate", "ngram",
                                      "--num-draft-tokens", "64"])
    assert result.exit_code != 0 and "widest static width (64)" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_bench_flags_reach_the_configs(tiny_artifact, captured_configs):
    result = CliRunner().invoke(app, ["bench", str(tiny_artifact), "--mode", "requests", *BUDGET_FLAGS,
                                      "--num-cells", "900", "--kv-memory-fraction", "0.3", "--no-prefix-cache"])
    assert "stopped by the test" in result.output, result.output
    runner, executor = captured_configs["runner"], captured_configs["executor"]
    assert (runner.token_budget, runner.max_decode_sequences, runner.min_prefill_chunk) == (40, 3, 5)
    assert runner.prefix_cache is False
    assert (executor.num_cells, executor.kv_memory_fraction) == (900, 0.3)


def test_bench_defaults_are_the_runners(tiny_artifact, tmp_path):
    doc = bench(tiny_artifact, tmp_path)
    runner = open_runner(tiny_artifact, device="cpu")  # RunnerConfig() and ExecutorConfig() as they are
    try:
        budget = runner.scheduler.config
        assert doc["step_budget"] == {"token_budget": budget.token_budget,
                                      "max_decode_sequences": budget.max_decode_sequences,
                                      "min_prefill_chunk": budget.min_prefill_chunk}
        assert doc["num_cells"] == runner.executor.memory.num_cells
    finally:
        runner.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--token-budget", "0"], "--token-budget must be at least 1, got 0"),
        (["--kv-memory-fraction", "2"], "kv_memory_fraction must be in (0, 0.95]"),
    ],
)
def test_bench_bad_values_are_clear_errors(tiny_artifact, captured_configs, args, message):
    result = CliRunner().invoke(app, ["bench", str(tiny_artifact), "--mode", "requests", *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and not captured_configs


def test_load_line_states_the_step_budget(tiny_artifact):
    runner = open_runner(tiny_artifact, device="cpu", executor_config=ExecutorConfig(num_cells=900),
                         runner_config=RunnerConfig(token_budget=40, max_decode_sequences=3, min_prefill_chunk=5))
    try:
        line = describe_load(runner)
    finally:
        runner.close()
    assert "KV pool 0.5 MB for 899 tokens (as asked)" in line
    assert "steps of up to 40 tokens with up to 3 decodes, prefill chunks of 5 tokens or more" in line


@pytest.mark.parametrize("command", ["bench", "serve-artifact"])
def test_help_says_the_runner_defaults(command):
    params = {p.name: p for p in typer.main.get_command(app).commands[command].params}
    for name in ("token_budget", "max_decode_sequences", "min_prefill_chunk"):
        assert params[name].default is None  # the runner's default applies, none of the CLI's own
    helps = {name: " ".join(params[name].help.split()) for name in params}
    assert f"{DEFAULT_TOKEN_BUDGET:,}" in helps["token_budget"]
    assert "the token budget" in helps["max_decode_sequences"]
    assert "the artifact's" in helps["min_prefill_chunk"]
    assert params["num_cells"].default is None
    assert f"{CPU_POOL_TOKENS:,} tokens" in helps["num_cells"]
    assert f"share, {ExecutorConfig.kv_memory_fraction:g};" in helps["kv_memory_fraction"]


# -- the pool's size ------------------------------------------------------------------------------------------

CELL_BYTES = 2 * 2 * 2 * 16 * 4  # tiny-random: 2 layers x (K, V) x 2 kv heads x head dim 16 x fp32


def executor_finding(tiny_artifact, monkeypatch, free_bytes: int, max_cells: int | None = None, **config):
    """An executor over the tiny artifact on a machine that reports `free_bytes` of free memory."""
    monkeypatch.setattr("pt2serve.runtime.executor.available_memory_bytes", lambda device: free_bytes)
    artifact = load_artifact(tiny_artifact, device="cpu")
    if max_cells is not None:  # as if exported with this --max-cells (no step runs: only the pool is sized)
        artifact.metadata.raw["max_cells"] = max_cells
    return Executor(artifact, ExecutorConfig(**config))


def test_the_pool_takes_its_share_of_the_free_memory(tiny_artifact, monkeypatch):
    executor = executor_finding(tiny_artifact, monkeypatch, 1000 * CELL_BYTES, kv_memory_fraction=0.5)
    memory = executor.memory
    assert memory.num_cells == executor.allocator.num_cells == 500
    assert memory.pool_bytes == 500 * CELL_BYTES
    assert memory.pool_sized_by == "50% of the host memory available"


def test_the_artifacts_max_cells_and_the_cpu_default_bound_the_pool(tiny_artifact, monkeypatch):
    plenty = 10**6 * CELL_BYTES
    bounded = executor_finding(tiny_artifact, monkeypatch, plenty).memory
    assert (bounded.num_cells, bounded.pool_sized_by) == (4097, "the artifact's max_cells")
    unbounded = executor_finding(tiny_artifact, monkeypatch, plenty, max_cells=2**40).memory
    assert (unbounded.num_cells, unbounded.pool_sized_by) == (CPU_POOL_TOKENS + 1, "the CPU default")
    asked = executor_finding(tiny_artifact, monkeypatch, plenty, max_cells=2**40, num_cells=CPU_POOL_TOKENS * 2)
    assert asked.memory.num_cells == CPU_POOL_TOKENS * 2  # --num-cells is bounded by max_cells alone


def test_too_little_memory_for_one_sequence_is_a_clear_error(tiny_artifact, monkeypatch):
    with pytest.raises(Pt2ServeError, match=r"only 200 KV cells fit in 50% of the host memory available, fewer "
                                            r"than one max-context sequence needs \(257\)"):
        executor_finding(tiny_artifact, monkeypatch, 400 * CELL_BYTES, kv_memory_fraction=0.5)
