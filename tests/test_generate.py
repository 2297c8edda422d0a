"""`pt2serve generate` streams a completion; `--no-cuda-graphs` of generate and serve-artifact reaches the
executor (its effect on a GPU: tests/test_cuda.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pt2serve.cli import app
from pt2serve.errors import Pt2ServeError
from pt2serve.model.presets import toy_greedy_continuation
from pt2serve.runtime import engine

# toy-greedy continues 237 with 126, 117, 54, 125, 110: "~u6}n", all printable.
PROMPT = [256, 237]
DESIGNED_TEXT = bytes(toy_greedy_continuation(PROMPT, 5)).decode()


@pytest.fixture
def executor_configs(monkeypatch) -> list:
    """The ExecutorConfig of every runner the command opens (the runner itself is the real one)."""
    seen = []
    real = engine.open_runner

    def spy(path, device=None, executor_config=engine.ExecutorConfig(), *args, **kwargs):
        seen.append(executor_config)
        return real(path, device, executor_config, *args, **kwargs)

    monkeypatch.setattr(engine, "open_runner", spy)
    return seen


def generate(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


def test_generate_streams_the_designed_tokens(toy_artifact, executor_configs):
    result = generate(str(toy_artifact), "--token-ids", "--prompt", ",".join(map(str, PROMPT)),
                      "--max-new-tokens", "5")
    assert result.exit_code == 0, result.output
    # The load report (wrapped to the console's width), the streamed text, then the summary.
    assert result.output.startswith("loaded in ") and "KV pool" in result.output
    assert result.output.endswith(f"\n{DESIGNED_TEXT}\n2 prompt tokens, 5 generated, finish: length\n")
    assert [config.use_cuda_graphs for config in executor_configs] == [True]


def test_generate_from_text_equals_the_runner(tiny_artifact):
    result = generate(str(tiny_artifact), "--prompt", "Hello", "--max-new-tokens", "6", "--temperature", "0.8",
                      "--seed", "5")
    assert result.exit_code == 0, result.output
    runner = engine.open_runner(tiny_artifact)
    try:
        from pt2serve.runtime.sampling import SamplingParams

        expected = runner.generate("Hello", max_new_tokens=6, sampling=SamplingParams(temperature=0.8, seed=5))
    finally:
        runner.close()
    summary = (f"6 prompt tokens, {expected.stats.completion_tokens} generated, "
               f"finish: {expected.finish_reason.value}")
    assert result.output.endswith(f"\n{expected.text}\n{summary}\n")


@pytest.mark.parametrize("args, message", [
    (["--token-ids", "--prompt", "1,x"], "expected comma-separated integers"),
    (["--token-ids", "--prompt", "1,999"], "outside the vocabulary"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
])
def test_generate_refuses_bad_input_without_traceback(toy_artifact, args, message):
    result = generate(str(toy_artifact), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_generate_without_cuda_graphs(toy_artifact, executor_configs):
    result = generate(str(toy_artifact), "--token-ids", "--prompt", "256,237", "--max-new-tokens", "5",
                      "--no-cuda-graphs")
    assert result.exit_code == 0, result.output
    assert result.output.endswith(f"\n{DESIGNED_TEXT}\n2 prompt tokens, 5 generated, finish: length\n")
    assert [config.use_cuda_graphs for config in executor_configs] == [False]


@pytest.mark.parametrize("flags, graphs", [([], True), (["--no-cuda-graphs"], False)])
def test_serve_passes_no_cuda_graphs_to_the_executor(tiny_artifact, monkeypatch, flags, graphs):
    """serve-artifact loads in the background; here loading stops right after the config is seen, and the
    server, bound to a free port of 127.0.0.1, exits with that error."""
    seen = []

    def stop_after_seeing(path, device=None, executor_config=None, runner_config=None, **kwargs):
        seen.append(executor_config)
        raise Pt2ServeError("stopped by the test")

    monkeypatch.setattr(engine, "open_runner", stop_after_seeing)
    result = CliRunner().invoke(app, ["serve-artifact", str(tiny_artifact), "--port", "0", *flags])
    assert result.exit_code == 2 and "stopped by the test" in result.output, result.output
    assert [config.use_cuda_graphs for config in seen] == [graphs]
