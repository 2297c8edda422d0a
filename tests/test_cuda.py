"""The GPU path, on a toy-greedy artifact exported for CUDA: captured graphs replay exactly what the methods
compute, the runner serves the designed tokens through them in fp32 and bf16 (and without them with
--no-cuda-graphs), the KV pool is sized from free GPU memory, and an artifact built for another GPU
architecture is refused.

Every test here is marked `cuda`: skipped without a GPU, run on the GPU machine by the cuda-tests chain
(`scripts/device/run.py start cuda-tests`; see scripts/device/chains.toml).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TEST_MAX_CONTEXT, TEST_MAX_STEP_TOKENS, exported
from pt2serve.errors import Pt2ServeError
from pt2serve.export.options import ExportOptions
from pt2serve.model.presets import build_preset_model, toy_greedy_continuation, toy_successor
from pt2serve.runtime.artifact import load_artifact, read_metadata
from pt2serve.runtime.cells import allocate_kv_pools, cells_that_fit
from pt2serve.runtime.engine import describe_load, open_runner
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.graphs import capture_all
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.runtime.step import pack, with_entries
from test_artifact import with_metadata
from test_export import random_chunks, split_width
from test_fp8_checkpoint import hf_tensors, write_checkpoint

pytestmark = pytest.mark.cuda

FORWARD_SIZES = (1, 4, 16, 64)
MAX_CELLS = 1 << 22  # large enough that the pool is sized by free memory, not by the artifact
POOL_CELLS = 1024


_EXPORTED: dict[str, Path] = {}  # dtype -> path: one export per test run, shared with tests/test_cuda_*.py


def toy_greedy_for_cuda(dtype: str, tmp_path_factory):
    def options(path):
        return ExportOptions(backend="cuda", output=path, preset="toy-greedy", dtype=dtype, forward_sizes=FORWARD_SIZES,
                             max_context=TEST_MAX_CONTEXT, max_step_tokens=TEST_MAX_STEP_TOKENS, max_cells=MAX_CELLS)

    if dtype not in _EXPORTED:
        _EXPORTED[dtype] = exported(f"toy-greedy-cuda-{dtype}", options, tmp_path_factory)
    return _EXPORTED[dtype]


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory):
    return toy_greedy_for_cuda("fp32", tmp_path_factory)


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory):
    """The serving dtype, with the matmul kernels tuned as for the 8B: its designed tokens hold in bf16."""
    return toy_greedy_for_cuda("bf16", tmp_path_factory)


@pytest.fixture(scope="module")
def artifact(cuda_artifact):
    return load_artifact(cuda_artifact)


def test_graph_replay_equals_the_method_on_every_static_width(artifact):
    """Each width captured once (from an all-padding step), then replayed with new steps copied into its
    buffers: logits and pool writes are the uncaptured method's on the same inputs and pool (the same
    kernels: equal within float rounding of 1e-5)."""
    meta, device = artifact.metadata, artifact.device
    cache = meta.cache
    storage, k_pools, v_pools = allocate_kv_pools(cache["num_layers"], POOL_CELLS, cache["num_kv_heads"],
                                                  cache["head_dim"], meta.kv_dtype, device)
    storage.normal_(generator=torch.Generator(device).manual_seed(0))
    pools = [*k_pools, *v_pools]
    # Each buffer holds its method's whole index; the steps below fill only its front.
    idle = {f"forward_{n}": (pack([], f"forward_{n}", n), with_entries(pack([], f"forward_{n}", n).sizes,
                                                                      meta.entries_of(n)))
            for n in meta.forward_sizes}
    captured, _ = capture_all(artifact.run, idle, pools, device, use_graph=True)
    rng = np.random.default_rng(0)
    for width in meta.forward_sizes:
        method = f"forward_{width}"
        assert captured[method].graph is not None
        previous = None
        for fill in (width, width // 2 + 1):  # a full step, then one with padding
            chunks = random_chunks(rng, split_width(rng, fill, 3), POOL_CELLS, meta.vocab_size, sample_every=1)
            call = pack(list(enumerate(chunks)), method, width)
            before = storage.clone()
            captured[method].load(call.host)
            replayed = captured[method].run().clone()
            after_replay = storage.clone()
            storage.copy_(before)
            direct = artifact.run(method, [*call.padded(meta.entries_of(width)).device_inputs(device), *pools])[0]
            torch.testing.assert_close(replayed, direct, atol=1e-5, rtol=0, msg=method)
            torch.testing.assert_close(after_replay, storage, atol=1e-5, rtol=0, msg=method)
            assert not torch.equal(after_replay, before)  # the step wrote its cells
            if previous is not None:
                assert not torch.equal(replayed[:1], previous[:1])  # a new step, not the captured one
            previous = replayed


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_runner_serves_designed_tokens_through_graphs(dtype, request):
    path = request.getfixturevalue("cuda_artifact" if dtype == "fp32" else "bf16_artifact")
    runner = open_runner(path, executor_config=ExecutorConfig(num_cells=8192),
                         runner_config=RunnerConfig(token_budget=64))
    try:
        assert runner.executor.uses_cuda_graphs and runner.executor.forward_sizes == FORWARD_SIZES
        assert f"CUDA graphs for {len(FORWARD_SIZES)} widths" in describe_load(runner)
        rng = np.random.default_rng(1)
        prompts = [[256, *rng.integers(0, 256, int(n)).tolist()] for n in rng.integers(1, 120, 24)]
        handles = [runner.submit(p, max_new_tokens=40) for p in prompts]
        for prompt, handle in zip(prompts, handles):
            assert handle.result(timeout=120).token_ids == toy_greedy_continuation(prompt, 40)
        methods = {call.method for step in runner.step_history for call in step.calls}
        assert {f"forward_{n}" for n in FORWARD_SIZES} & methods, methods  # steps replayed graphs
    finally:
        runner.close()


def test_without_cuda_graphs_every_step_runs_forward_others(cuda_artifact):
    runner = open_runner(cuda_artifact, executor_config=ExecutorConfig(num_cells=8192, use_cuda_graphs=False))
    try:
        assert not runner.executor.uses_cuda_graphs and runner.executor.forward_sizes == ()
        assert "no CUDA graphs: every step runs forward_others" in describe_load(runner)
        prompt = [256, 5, 6, 7]
        assert runner.generate(prompt, max_new_tokens=20).token_ids == toy_greedy_continuation(prompt, 20)
        assert {call.method for step in runner.step_history for call in step.calls} == {"forward_others"}
    finally:
        runner.close()


def test_pool_is_sized_from_free_gpu_memory(artifact):
    cache, meta = artifact.metadata.cache, artifact.metadata
    torch.cuda.synchronize()
    free, _total = torch.cuda.mem_get_info(artifact.device)
    fraction = 0.01
    expected = cells_that_fit(free, fraction, cache["num_layers"], cache["num_kv_heads"], cache["head_dim"],
                              meta.kv_dtype)
    assert meta.max_context + 1 < expected < meta.max_cells  # the fraction decides, not the artifact
    executor = Executor(artifact, ExecutorConfig(kv_memory_fraction=fraction, use_cuda_graphs=False))
    assert executor.allocator.num_cells == pytest.approx(expected, rel=0.02)
    assert executor.memory.pool_bytes == pytest.approx(fraction * free, rel=0.02)
    del executor
    with pytest.raises(Pt2ServeError, match="fewer than one max-context sequence needs"):
        Executor(artifact, ExecutorConfig(kv_memory_fraction=1e-9, use_cuda_graphs=False))


def test_an_artifact_for_another_gpu_architecture_is_refused(cuda_artifact, tmp_path):
    built = read_metadata(cuda_artifact).raw["built_with"]
    major, minor = torch.cuda.get_device_capability()
    assert built["gpu_arch"] == f"sm_{major}{minor}" and built["gpu_name"] == torch.cuda.get_device_name()
    other = tmp_path / "other-arch.pt2"
    with_metadata(cuda_artifact, other, lambda m: m["built_with"].update(gpu_arch="sm_00", gpu_name="Imaginary"))
    with pytest.raises(Pt2ServeError, match=f"built for sm_00 \\(Imaginary\\), but this GPU is sm_{major}{minor}"):
        load_artifact(other)
    with pytest.raises(Pt2ServeError, match="exported for cuda"):
        load_artifact(cuda_artifact, device="cpu")


def test_speculation_through_captured_graphs_gives_the_designed_tokens(cuda_artifact):
    """Verifying steps of 1 + k tokens per sequence replay the static widths' graphs: n-gram drafts on toy-greedy
    are accepted whole, and drafts that are wrong are rejected without changing a token."""
    from pt2serve.runtime.drafter import Speculation

    runner = open_runner(cuda_artifact, executor_config=ExecutorConfig(num_cells=4097),
                         runner_config=RunnerConfig(speculate=Speculation.NGRAM, num_draft_tokens=3))
    try:
        cycle = [5] + toy_greedy_continuation([5], 69)
        handles = [runner.submit(cycle[i:], max_new_tokens=40) for i in range(3)]
        for x in (10, 11, 12):  # the first sample, toy_successor(x), appears earlier followed by a wrong token
            first = toy_successor(x)
            wrong = (toy_successor(first) + 1) % 256
            handles.append(runner.submit([first, wrong, wrong, wrong, x], max_new_tokens=40))  # drafts that miss
        for handle in handles:
            result = handle.result(timeout=120)
            assert result.token_ids == toy_greedy_continuation(handle.prompt_ids, 40)
        methods = {call.method for record in runner.step_history for call in record.calls}
        assert methods & {"forward_4", "forward_16"}  # verifying steps ran in captured widths
        scheduler = runner.scheduler
        assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    finally:
        runner.close()


LONG_CONTEXT = 16384
LONG_SIZES = (1, 8)


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory):
    """tiny-random's weights behind a config of 2 x LONG_CONTEXT positions, exported for CUDA at that whole
    context in fp32, with static widths 1 and 8."""
    root = tmp_path_factory.mktemp("long-checkpoint") / "tiny-long"
    model = build_preset_model("tiny-random", torch.float32)
    write_checkpoint(root, dataclasses.replace(model.config, max_position_embeddings=2 * LONG_CONTEXT),
                     hf_tensors(model), None)

    def options(path):
        return ExportOptions(backend="cuda", output=path, checkpoint=root, dtype="fp32", forward_sizes=LONG_SIZES,
                             max_step_tokens=2048, max_cells=MAX_CELLS)

    return exported("tiny-long-cuda", options, tmp_path_factory)


def long_runs(path, prompts: list[list[int]], num_tokens: int, num_cells: int) -> list[tuple[list[int], set]]:
    """Each prompt's greedy tokens, all submitted together, and the methods the decode steps ran, with graphs
    and then with the same static methods run without them (the same kernels: the same tokens, exactly)."""
    runs = []
    for graphs in (True, False):
        config = ExecutorConfig(num_cells=num_cells, use_cuda_graphs=graphs, use_static_methods=True)
        runner = open_runner(path, executor_config=config, runner_config=RunnerConfig(token_budget=2048))
        try:
            assert runner.executor.uses_cuda_graphs is graphs
            handles = [runner.submit(p, max_new_tokens=num_tokens, ignore_eos=True) for p in prompts]
            tokens = [list(h.result(timeout=300).token_ids) for h in handles]
            decodes = {call.method for step in runner.step_history if step.num_decode == step.num_tokens
                       for call in step.calls}
            runs.append((tokens, decodes))
        finally:
            runner.close()
    return runs


def test_decodes_at_context_16k_replay_their_widths_graph(long_artifact):
    """Eight sequences at context 16k decode on forward_8's graph (8 x 16k entries: far past any fixed index),
    with the tokens the same methods give without graphs."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, LONG_CONTEXT - int(rng.integers(0, 64))).tolist() for _ in range(8)]
    (graphed, graphed_methods), (plain, plain_methods) = long_runs(long_artifact, prompts, 12, 8 * LONG_CONTEXT + 1024)
    assert graphed == plain
    assert "forward_8" in graphed_methods and "forward_others" not in graphed_methods, graphed_methods


def test_a_sequence_at_the_max_context_decodes_through_a_graph(long_artifact):
    """A prompt two tokens short of the artifact's max context: its decode (at position max context - 2, whose
    token is the last the context holds) runs on forward_1's graph and gives the method's token without one."""
    max_context = read_metadata(long_artifact).max_context
    prompt = np.random.default_rng(4).integers(0, 256, max_context - 2).tolist()
    (graphed, graphed_methods), (plain, _) = long_runs(long_artifact, [prompt], 2, max_context + 1)
    assert graphed == plain and len(graphed[0]) == 2
    assert graphed_methods == {"forward_1"}
