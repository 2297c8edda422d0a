"""Export flags the shared test artifacts do not use, in one CLI export of toy-greedy: `--dtype bf16` and
a C++ compiler (CXX) that reports a libstdc++ other than this process's.

The stand-in compiler answers only the libstdc++ question itself and hands every compile to the system
g++, so the methods are sound: the mismatch is recorded and the loader refuses the package, and with the
record cleared the same package loads and runs in bf16.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.model.presets import toy_greedy_continuation, toy_successor
from pt2serve.runtime.artifact import load_artifact, read_metadata
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk
from test_artifact import with_metadata

PT2SERVE = str(Path(sys.executable).with_name("pt2serve"))
FOREIGN_LIBSTDCXX = "/opt/foreign-gcc/lib64/libstdc++.so.6"


@pytest.fixture(scope="module")
def flagged_export(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("export-flags")
    compiler = tmp / "g++-foreign"
    compiler.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-print-file-name=libstdc++.so.6" ]; then echo {FOREIGN_LIBSTDCXX}; exit 0; fi\n'
        'exec /usr/bin/g++ "$@"\n'
    )
    compiler.chmod(compiler.stat().st_mode | stat.S_IXUSR)
    out = tmp / "toy-bf16.pt2"
    proc = subprocess.run(
        [PT2SERVE, "export", "--backend", "cpu", "--use-offgraph-kv-cache", "--preset", "toy-greedy", "--dtype", "bf16",
         "--forward-sizes", "4", "--max-context", "256",  # forward_4: the one static width a test runs
         # Two compile workers, whatever the run's TEST_EXPORT_JOBS: the one test export through the worker pool
         # (spawned workers that rebuild the model), its samplers compiled by them (not shared: the subprocess
         # runs the real entry point), so their compiler notices are checked too.
         "--max-step-tokens", "16", "--max-cells", "1024", "--jobs", "2", "-o", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "CXX": str(compiler), "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="module")
def bf16_artifact(flagged_export, tmp_path_factory) -> Path:
    """The same package with the mismatch record cleared (its methods were in fact built by the system g++)."""
    path = tmp_path_factory.mktemp("bf16") / "toy-bf16.pt2"
    with_metadata(flagged_export[0], path, lambda m: m["built_with"].update(libstdcxx_mismatch=None))
    return path


def test_a_foreign_libstdcxx_is_warned_about_recorded_and_refused(flagged_export):
    path, proc = flagged_export
    assert "warning:" in proc.stderr and "CXX=/usr/bin/g++" in proc.stderr, proc.stderr
    recorded = read_metadata(path).raw["built_with"]["libstdcxx_mismatch"]
    assert recorded is not None and FOREIGN_LIBSTDCXX in recorded
    with pytest.raises(Pt2ServeError, match="re-export with CXX=/usr/bin/g\\+\\+"):
        load_artifact(path)


def test_the_export_prints_no_compiler_notices(flagged_export):
    # torch's own deprecations and Inductor's notes are nothing a user of export can act on.
    _, proc = flagged_export
    assert "Warning:" not in proc.stderr, proc.stderr


def test_bf16_artifact_loads_and_runs(bf16_artifact):
    raw = read_metadata(bf16_artifact).raw
    assert raw["dtype"] == "bf16" and raw["cache"]["dtype"] == "bf16"
    assert {w["dtype"] for w in raw["weights"]} == {"bfloat16", "float32"}  # the rotary table stays fp32
    runner = open_runner(bf16_artifact, runner_config=RunnerConfig(token_budget=16))
    try:
        assert runner.executor.pools[0].dtype == torch.bfloat16
        prompts = [[256, 1, 2, 3], [256, 200], [256] + list(range(40, 70))]
        handles = [runner.submit(p, max_new_tokens=12) for p in prompts]
        for prompt, handle in zip(prompts, handles):
            assert handle.result(timeout=120).token_ids == toy_greedy_continuation(prompt, 12)
    finally:
        runner.close()


def test_a_static_method_takes_any_context(bf16_artifact):
    """forward_4's context index holds 4 x max context entries: four decodes of 10 cells each and four of 200
    (800 entries, past the old default of a fixed capacity shared by all) both run on it and give the designed
    tokens."""
    raw = read_metadata(bf16_artifact).raw
    assert raw["methods"]["forward_4"]["num_entries"] == 4 * 256
    executor = Executor(load_artifact(bf16_artifact), ExecutorConfig(num_cells=1024, use_static_methods=True))
    rng = np.random.default_rng(0)
    for context in (10, 200):
        chunks, prompts = [], []
        for _ in range(4):
            prompt = rng.integers(0, 256, context).tolist()
            cells = executor.allocator.allocate(context)
            executor.step([Chunk(cells, tuple(prompt[:-1]), 0, None)])  # the context, computed earlier
            chunks.append(Chunk(cells, (prompt[-1],), context - 1, SamplingParams()))
            prompts.append(prompt)
        result = executor.step(chunks)
        assert [call.method for call in result.calls] == ["forward_4"]
        assert list(result.tokens) == [toy_successor(p[-1]) for p in prompts]
        for chunk in chunks:
            executor.allocator.free(chunk.cells)