"""Shared fixtures: each compiled test artifact is exported once per test run; a toy-greedy runner and a
server over it, once per test module.

Set PT2SERVE_TEST_ARTIFACTS=DIR to keep the exports in DIR and reuse them across runs (delete the files
after changing model or export code).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). The flag is read when Triton
# is imported (by anything: torch's compiler imports it too), so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pt2serve.export.exporter import export  # noqa: E402
from pt2serve.export.options import ExportOptions  # noqa: E402
from pt2serve.model.presets import build_preset_model  # noqa: E402
from pt2serve.runtime.engine import open_runner  # noqa: E402
from pt2serve.runtime.executor import ExecutorConfig  # noqa: E402
from pt2serve.runtime.runner import RunnerConfig  # noqa: E402
from pt2serve.serve.app import create_app  # noqa: E402
from pt2serve.serve.config import ServerConfig  # noqa: E402
from servers import TOY_MODEL, ServerThread  # noqa: E402

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


def exported(preset: str, tmp_path_factory, label: str | None = None, **overrides) -> Path:
    """The preset exported with the test options (and `overrides`), once per run, or once if kept."""
    keep = os.environ.get("PT2SERVE_TEST_ARTIFACTS")
    folder = Path(keep) if keep else tmp_path_factory.mktemp("artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label or preset}.pt2"
    if not path.exists():
        export(dataclasses.replace(export_options_for_tests(preset, path), **overrides), show_progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> Path:
    return exported("tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def toy_artifact(tmp_path_factory) -> Path:
    return exported("toy-greedy", tmp_path_factory)


@pytest.fixture()
def tiny_server(tiny_artifact):
    """The tiny artifact served (OpenAI API, no prefix cache) on 127.0.0.1 at a free port: the base URL."""
    uvicorn = pytest.importorskip("uvicorn")
    from pt2serve.runtime.engine import open_runner
    from pt2serve.runtime.runner import RunnerConfig
    from pt2serve.serve.app import create_app
    from pt2serve.serve.config import ServerConfig

    runner = open_runner(tiny_artifact, device="cpu", runner_config=RunnerConfig(prefix_cache_entries=0))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(ServerConfig(model_name="tiny"), runner), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        runner.close()


@pytest.fixture(scope="module")
def toy_runner(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=ExecutorConfig(num_cells=4097),
                         runner_config=RunnerConfig(token_budget=64))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def chunked_runner(tiny_artifact):
    """The tiny artifact behind a small step budget: prompts prefill in several chunks beside others' decodes."""
    runner = open_runner(tiny_artifact, device="cpu",
                         runner_config=RunnerConfig(token_budget=16, min_prefill_chunk=4))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def chunked_url(chunked_runner):
    """The URL of a server over `chunked_runner`, serving it as "tiny"."""
    thread = ServerThread(create_app(ServerConfig(model_name="tiny"), chunked_runner)).start()
    yield thread.url
    thread.stop()


@pytest.fixture(scope="module")
def chunked_client(chunked_url):
    """The openai client of the server over `chunked_runner`."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{chunked_url}/v1", api_key="x", timeout=60, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny preset's eager model (the weights its exports hold), in fp32."""
    return build_preset_model("tiny", torch.float32).eval()


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
