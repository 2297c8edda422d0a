"""Shared fixtures: each compiled test artifact is exported once per test run; a toy-greedy runner and a
server over it, once per test module.

Set PT2SERVE_TEST_ARTIFACTS=DIR to keep the exports in DIR and reuse them across runs (delete the files
after changing model or export code).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pt2serve.export.exporter import export
from pt2serve.export.options import ExportOptions
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.serve.app import create_app
from pt2serve.serve.config import ServerConfig
from servers import TOY_MODEL, ServerThread

# Small enough to export quickly on 2 cores, wide enough for every width test (1..65, 96, 97, > max).
TEST_MAX_CONTEXT = 256
TEST_MAX_STEP_TOKENS = 128
TEST_MAX_CELLS = 4096


def export_options_for_tests(preset: str, output: Path) -> ExportOptions:
    return ExportOptions(
        backend="cpu",
        output=output,
        preset=preset,
        dtype="fp32",
        max_context=TEST_MAX_CONTEXT,
        max_step_tokens=TEST_MAX_STEP_TOKENS,
        max_cells=TEST_MAX_CELLS,
        jobs=2,
    )


def _exported(preset: str, tmp_path_factory) -> Path:
    keep = os.environ.get("PT2SERVE_TEST_ARTIFACTS")
    folder = Path(keep) if keep else tmp_path_factory.mktemp("artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{preset}.pt2"
    if not path.exists():
        export(export_options_for_tests(preset, path), show_progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> Path:
    return _exported("tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def toy_artifact(tmp_path_factory) -> Path:
    return _exported("toy-greedy", tmp_path_factory)


@pytest.fixture(scope="module")
def toy_runner(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=ExecutorConfig(num_cells=4097),
                         runner_config=RunnerConfig(token_budget=64))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def toy_server(toy_runner):
    """The URL of a server over `toy_runner`, serving it as TOY_MODEL."""
    thread = ServerThread(create_app(ServerConfig(model_name=TOY_MODEL), toy_runner)).start()
    yield thread.url
    thread.stop()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
