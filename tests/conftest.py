"""Shared fixtures: each compiled test artifact is exported once per test run; a toy-greedy runner and a
server over it, once per test module; the designed presets (toy-greedy, and toy-recall, whose tokens are
wrong whenever a K/V cell is) for the tests of exact tokens that run on both.

Set PT2SERVE_TEST_ARTIFACTS=DIR to keep the exports in DIR and reuse them across runs (delete the files
after changing model or export code). Under pytest-xdist (./scripts/test.sh runs two workers, a test file
each at a time) the workers share one folder of exports: whichever needs an artifact first exports it while
the other waits for it on a file lock. In-process exports of one run compile each sampling method once per
vocabulary and share it (tests/shared_samplers.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

# Inductor's cache folder is shared by every process of the user and names compiled files after their source,
# so two exports compiling the same method at once (two pytest-xdist workers, or two test runs on one machine:
# the samplers of toy-greedy and toy-recall are the same code) write the same files, and one can package an
# empty library. Each test process compiles in a folder of its own (its export workers and CLI exports inherit
# it); the precompiled headers stay in the shared folder.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pt2serve-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import torch  # noqa: E402

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). The flag is read when Triton
# is imported (by anything: torch's compiler imports it too), so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

from pt2serve.export.exporter import export  # noqa: E402
from pt2serve.export.options import ExportOptions  # noqa: E402
from pt2serve.model.presets import build_preset_model, toy_greedy_continuation, toy_recall_continuation  # noqa: E402
from pt2serve.runtime.engine import open_runner  # noqa: E402
from pt2serve.runtime.executor import ExecutorConfig  # noqa: E402
from pt2serve.runtime.runner import RunnerConfig  # noqa: E402
from shared_samplers import sharing_samplers  # noqa: E402

# Small enough to export quickly on 2 cores, wide enough for every width test (1..65, 96, 97, > max).
TEST_MAX_CONTEXT = 256
TEST_MAX_STEP_TOKENS = 128
TEST_MAX_CELLS = 4096
# toy-recall's export: CPU steps run forward_others, so it has two static widths only (for the tests that
# force static methods).
RECALL_FORWARD_SIZES = (4, 32)
DESIGNED_PRESETS = ("toy-greedy", "toy-recall")
# Test exports compile in process: under pytest-xdist two test processes already share the cores (worker
# interpreters would cost about 20 s of CPU an export on 2 cores), and the samplers shared across a run's
# exports (shared_samplers) live in this process, where spawned workers could not reach them.
IS_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
TEST_EXPORT_JOBS = 1


def export_options_for_tests(preset: str, output: Path) -> ExportOptions:
    return ExportOptions(
        backend="cpu",
        output=output,
        preset=preset,
        dtype="fp32",
        max_context=TEST_MAX_CONTEXT,
        max_step_tokens=TEST_MAX_STEP_TOKENS,
        max_cells=TEST_MAX_CELLS,
        jobs=TEST_EXPORT_JOBS,
    )


def recall_export_options(output: Path) -> ExportOptions:
    return dataclasses.replace(export_options_for_tests("toy-recall", output), forward_sizes=RECALL_FORWARD_SIZES)


def triton_kernels(module: str):
    """The Triton kernel module `module` (imported by name): compiled on a GPU, run in Triton's interpreter on
    the CPU (this file sets TRITON_INTERPRET=1 there); the test is skipped where neither can run."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton was not put in interpreter mode (tests/conftest.py does that)")
    return importlib.import_module(module)


def stop_at_token(deltas: list[str], first: int = 5) -> tuple[int, str, str]:
    """For per-token text deltas: the first token (counting from 1, at least `first`) whose text ends a
    two-character stop string that occurs nowhere earlier; returns (that token's number, the text up to
    and with it, the stop string)."""
    for last in range(first, len(deltas) + 1):
        text = "".join(deltas[:last])
        stop = text[-2:]
        if deltas[last - 1] and len(stop) == 2 and text.find(stop) == len(text) - 2:
            return last, text, stop
    pytest.fail(f"no token ends a fresh stop string in {deltas}")


def artifact_folder(tmp_path_factory) -> Path:
    """PT2SERVE_TEST_ARTIFACTS, else one folder for this run (under pytest-xdist, beside the workers' own)."""
    keep = os.environ.get("PT2SERVE_TEST_ARTIFACTS")
    if keep:
        return Path(keep)
    run_temp = tmp_path_factory.getbasetemp()
    return (run_temp.parent if IS_XDIST_WORKER else run_temp) / "artifacts"


def exported(name: str, options_for: Callable[[Path], ExportOptions], tmp_path_factory) -> Path:
    """The artifact `name`, exported with `options_for(path)` unless the artifact folder already holds it.

    Once per run (and per folder): the lock makes a second process wait for the export the first one started.
    The package appears at its path only when complete (the exporter renames it there).
    """
    folder = artifact_folder(tmp_path_factory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.pt2"
    with FileLock(folder / f"{name}.lock"):
        if not path.exists():
            export(options_for(path), show_progress=False)
    return path


@pytest.fixture(scope="session", autouse=True)
def shared_samplers(tmp_path_factory):
    """Every in-process export of the session compiles each sampling method once per vocabulary
    (tests/shared_samplers.py)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        sharing_samplers(monkeypatch, artifact_folder(tmp_path_factory))
        yield


@pytest.fixture
def fake_tuning_times(monkeypatch):
    """Export-time matmul tuning without a GPU: every graph it would time runs once (kernels in the interpreter)
    and takes the next of the given times; one copy of each weight. Returns the installer, which returns the
    iterator of times (exhausted once every expected timing was taken)."""
    from pt2serve.export import linear_tuning

    def install(times: list[float]):
        fake = iter(times)

        def run_and_time(work, replays) -> float:
            work()
            return next(fake)

        monkeypatch.setattr(linear_tuning, "ROTATION_BYTES", 1)
        monkeypatch.setattr(linear_tuning, "graph_replay_ms", run_and_time)
        return fake

    return install


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> Path:
    return exported("tiny-random", lambda path: export_options_for_tests("tiny-random", path), tmp_path_factory)


# toy-greedy in FP8 throughout: e4m3 linear layers and LM head, e4m3 KV cells; one static width (decodes pad
# into it) and forward_others: on the CPU its layers are the same aten ops at every width.
FP8_EXPORT = dict(quantize="fp8", quantize_lm_head=True, kv_dtype="fp8", forward_sizes=(4,))


@pytest.fixture(scope="session")
def fp8_artifact(tmp_path_factory) -> Path:
    return exported("toy-greedy-fp8", lambda path: dataclasses.replace(
        export_options_for_tests("toy-greedy", path), **FP8_EXPORT), tmp_path_factory)


# tiny-random exported with --deterministic, with the fewest methods its tests need: one-token and eight-token
# static widths (a decode alone, and beside up to 7 others) and forward_others (wider company, prompts).
DETERMINISTIC_FORWARD_SIZES = (1, 8)


@pytest.fixture(scope="session")
def deterministic_artifact(tmp_path_factory) -> Path:
    return exported("tiny-random-deterministic", lambda path: dataclasses.replace(
        export_options_for_tests("tiny-random", path), forward_sizes=DETERMINISTIC_FORWARD_SIZES, deterministic=True),
        tmp_path_factory)


@pytest.fixture(scope="session")
def toy_artifact(tmp_path_factory) -> Path:
    return exported("toy-greedy", lambda path: export_options_for_tests("toy-greedy", path), tmp_path_factory)


@pytest.fixture(scope="session")
def recall_artifact(tmp_path_factory) -> Path:
    return exported("toy-recall", recall_export_options, tmp_path_factory)


@dataclasses.dataclass(frozen=True)
class Designed:
    """A designed preset's test artifact and its greedy tokens: continuation(prompt, count)."""

    name: str
    artifact: Path
    continuation: Callable[[list[int], int], list[int]]


_DESIGNED_FIXTURES = {"toy-greedy": ("toy_artifact", toy_greedy_continuation),
                      "toy-recall": ("recall_artifact", toy_recall_continuation)}


@pytest.fixture(params=DESIGNED_PRESETS)
def designed(request) -> Designed:
    """Each designed preset in turn (a test of exact tokens that takes it runs on both)."""
    fixture, continuation = _DESIGNED_FIXTURES[request.param]
    return Designed(request.param, request.getfixturevalue(fixture), continuation)


@pytest.fixture()
def tiny_server(tiny_artifact):
    """The tiny artifact served (OpenAI API, the runner's defaults) on 127.0.0.1 at a free port: the base URL."""
    runner = open_runner(tiny_artifact, device="cpu")
    thread = served(runner, "tiny")
    yield thread.url
    thread.stop()
    runner.close()


def open_batching_runner(artifact: Path):
    """A runner with a pool of 4,096 cells and 64 tokens a step (toy_runner's)."""
    return open_runner(artifact, executor_config=ExecutorConfig(num_cells=4097),
                       runner_config=RunnerConfig(token_budget=64))


@pytest.fixture(scope="module")
def toy_runner(toy_artifact):
    runner = open_batching_runner(toy_artifact)
    yield runner
    runner.close()


@pytest.fixture(scope="module", params=DESIGNED_PRESETS)
def designed_runner(request):
    """toy_runner, then the same runner over toy-recall: (runner, the preset's continuation)."""
    fixture, continuation = _DESIGNED_FIXTURES[request.param]
    if request.param == "toy-greedy":
        yield request.getfixturevalue("toy_runner"), continuation
        return
    runner = open_batching_runner(request.getfixturevalue(fixture))
    yield runner, continuation
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
    thread = served(chunked_runner, "tiny")
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
    """The tiny-random preset's eager model (the weights its exports hold), in fp32."""
    return build_preset_model("tiny-random", torch.float32).eval()


@pytest.fixture(scope="module")
def toy_server(toy_runner):
    """The URL of a server over `toy_runner`, serving it as TOY_MODEL."""
    from servers import TOY_MODEL

    thread = served(toy_runner, TOY_MODEL)
    yield thread.url
    thread.stop()


class RecordingExecutor:
    """The real executor, with the order of launches and result reads recorded, and each launch's chunks."""

    def __init__(self, executor) -> None:
        self._executor = executor
        self.log: list[tuple[str, int]] = []
        self.chunks: list[list] = []  # by launch index

    def __getattr__(self, name: str):
        return getattr(self._executor, name)

    def launch(self, chunks, *args):
        index = len(self.chunks)
        self.log.append(("launch", index))
        self.chunks.append(list(chunks))
        pending = self._executor.launch(chunks, *args)
        log = self.log

        class Recorded:
            def result(self):
                log.append(("result", index))
                return pending.result()

        return Recorded()


def wait_until_idle(runner, timeout_s: float = 30) -> None:
    """Until every request has finished and the runner's stats show it: the engine refreshes them once a loop,
    after its commands, so stats that show no request waiting or running were taken after the last finish."""
    deadline = time.monotonic() + timeout_s
    while runner.num_active or runner.stats.num_running or runner.stats.num_waiting:
        assert time.monotonic() < deadline, "the runner did not become idle"
        time.sleep(0.01)


def assert_only_the_cache_holds_cells(runner, timeout_s: float = 30) -> None:
    """Once the runner is idle, every KV cell in use is the prefix cache's (nothing leaked); closing the
    runner returns the pool to empty."""
    wait_until_idle(runner, timeout_s)
    stats = runner.stats
    assert stats.cells_used == stats.prefix_cache_cells, stats


def generates_the_designed_tokens(artifact: Path, prompts: list[list[int]], executor_config: ExecutorConfig,
                                  num_tokens: int = 8) -> None:
    """Every prompt, submitted together, continues with toy-greedy's designed tokens."""
    from pt2serve.model.presets import toy_greedy_continuation

    runner = open_runner(artifact, executor_config=executor_config)
    try:
        handles = [runner.submit(p, max_new_tokens=num_tokens, ignore_eos=True) for p in prompts]
        for prompt, handle in zip(prompts, handles):
            assert list(handle.result(timeout=120).token_ids) == toy_greedy_continuation(prompt, num_tokens), prompt
    finally:
        runner.close()


def packed_random_step(artifact, method: str, width: int | None, lengths: tuple[int, ...], rng):
    """A step of fresh sequences of these lengths (random byte tokens, consecutive cells from 1), packed for
    `method` of the loaded artifact: its inputs on the CPU."""
    import numpy as np

    from pt2serve.runtime.sampling import SamplingParams
    from pt2serve.runtime.step import Chunk, pack

    chunks, next_cell = [], 1
    for length in lengths:
        cells = np.arange(next_cell, next_cell + length, dtype=np.int64)
        next_cell += length
        chunks.append(Chunk(cells, tuple(int(t) for t in rng.integers(0, 256, length)), 0, SamplingParams()))
    call = pack(list(enumerate(chunks)), method, width)
    return (call.padded(artifact.metadata.entries_of(width)) if width else call).device_inputs("cpu")


def random_prompts(count: int, seed: int = 0, max_length: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, max_length))] for _ in range(count)]


def sampled_alone_and_in_a_batch(runner, prompt: list[int], max_new_tokens: int, sampling,
                                 others: list[list[int]], others_greedy: bool = False) -> tuple[list[int], list[int]]:
    """A sampled request's tokens run alone, then again submitted among `others` (each sampled with its own
    seed, or greedy), once all have finished."""
    from pt2serve.runtime.sampling import SamplingParams

    alone = runner.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=True)
    handles = [runner.submit(p, max_new_tokens=max_new_tokens, ignore_eos=True,
                             sampling=SamplingParams() if others_greedy else SamplingParams(temperature=1.0, seed=i))
               for i, p in enumerate(others)]
    batched = runner.submit(prompt, max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=True)
    batched_ids = batched.result(timeout=60).token_ids
    for handle in handles:
        handle.result(timeout=60)
    return alone.token_ids, batched_ids


def served(runner, model_name: str):
    """A server over `runner` on 127.0.0.1 (imported here: the GPU machine runs the cuda tests without the server's
    packages)."""
    from pt2serve.serve.app import create_app
    from pt2serve.serve.config import ServerConfig
    from servers import ServerThread

    return ServerThread(create_app(ServerConfig(model_name=model_name), runner)).start()


# Files that export artifacts of their own or run longest, in this order before the others: under pytest-xdist
# (--dist loadfile --no-loadscope-reorder) each worker takes the next file when it is almost done with its
# last, so the two start on the long exports and the short files fill in at the end.
RUN_FIRST = ("test_quant_export.py", "test_hf_served.py", "test_dflash.py", "test_export_flags.py",
             "test_fp8_checkpoint.py", "test_fp8.py", "test_soak.py", "test_quant_kernels.py", "test_cell_attention.py")


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixtures, which keeps each file together
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: RUN_FIRST.index(item.path.name) if item.path.name in RUN_FIRST else len(RUN_FIRST))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
