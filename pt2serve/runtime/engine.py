"""One call from an artifact path to a running Runner: load, size the pool, capture graphs, start."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from pt2serve.runtime.artifact import load_artifact, read_metadata, read_tokenizer_json
from pt2serve.runtime.drafter import DeviceDrafter, Drafter, Speculation
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.runner import Runner, RunnerConfig
from pt2serve.tokenizer import Tokenizer, TokenizerFiles


def artifact_tokenizer(tokenizer_json: str | None, tokenizer_meta: dict | None) -> Tokenizer | None:
    if tokenizer_json is None or tokenizer_meta is None:
        return None
    return Tokenizer(TokenizerFiles.from_dict(tokenizer_json, tokenizer_meta))


def read_tokenizer(path: str | Path) -> Tokenizer | None:
    """The artifact's tokenizer, without loading its methods or weights."""
    return artifact_tokenizer(read_tokenizer_json(path), read_metadata(path).raw.get("tokenizer"))


def open_runner(
    path: str | Path,
    device: str | None = None,
    executor_config: ExecutorConfig = ExecutorConfig(),
    runner_config: RunnerConfig = RunnerConfig(),
    show_progress: bool = False,
    drafter: Drafter | DeviceDrafter | None = None,
) -> Runner:
    """Load `path` onto `device` (default: what it was built for) and start its engine thread."""
    if drafter is None and runner_config.speculate is Speculation.DFLASH:
        executor_config = replace(executor_config, draft=True)  # the runner drafts with the executor's draft
    # The tokenizer (a second for a 128k vocabulary) is built beside the weights, which load on other threads.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pt2serve-tokenizer") as background:
        tokenizer = background.submit(read_tokenizer, path)  # a bad path: load_artifact says why first
        artifact = load_artifact(path, device=device, show_progress=show_progress)
        executor = Executor(artifact, executor_config)
        return Runner(executor, tokenizer.result(), runner_config, drafter)


def describe_load(runner: Runner) -> str:
    """One line on what loading cost (time, device memory by kind, graph capture) and the step budget."""
    executor = runner.executor
    memory = executor.memory
    if executor.uses_cuda_graphs:
        graphs = (f"CUDA graphs for {len(executor.forward_sizes)} widths, {memory.graph_bytes / 1e6:.1f} MB, "
                  f"captured in {memory.capture_seconds:.2f} s")
    elif executor.forward_sizes:
        graphs = "CUDA graphs off, static methods run without them"
    else:
        graphs = "no CUDA graphs: every step runs forward_others"
    if runner.widest_step_bytes:
        graphs += f", the widest step's memory {_size(runner.widest_step_bytes)} held from the start"
    budget = runner.scheduler.config
    speculation = ""
    if runner.drafter is not None:
        speculation = (f"; speculating with {type(runner.drafter).__name__}, up to {runner.num_draft_tokens} drafts "
                       "per sequence and step")
    return (
        f"loaded in {_startup_seconds(executor):.1f} s on {executor.device} ({describe_startup(executor)}): weights "
        f"{_size(memory.weight_bytes)}, KV pool {_size(memory.pool_bytes)} for {memory.num_cells - 1:,} tokens "
        f"({memory.pool_sized_by}{_fp8_cells(executor)}), {graphs}; steps of up to {budget.token_budget} tokens "
        f"with up to {budget.max_decode_sequences} decodes, prefill chunks of {budget.min_prefill_chunk} tokens or more"
        f"{speculation}"
    )


def _fp8_cells(executor: Executor) -> str:
    """Said on the load line: FP8 cells hold twice the tokens bf16 ones would in the same memory."""
    return "; fp8 cells, half the bytes of bf16 ones" if executor.artifact.metadata.cache["dtype"] == "fp8" else ""


def startup_parts(executor: Executor) -> dict[str, float]:
    """Seconds of each part of loading, in order (weights and methods load at the same time)."""
    load, memory = executor.artifact.report, executor.memory
    return {"weights": load.weights_seconds, "methods": load.methods_seconds, "binding": load.bind_seconds,
            "KV pool": memory.pool_seconds, "graph capture": memory.capture_seconds,
            "total": _startup_seconds(executor)}


def describe_startup(executor: Executor) -> str:
    """Where the loading time went, e.g. `weights 1.2 s at 13.4 GB/s, methods 1.5 s beside them, ...`."""
    parts = startup_parts(executor)
    bytes_per_s = executor.memory.weight_bytes / parts["weights"] if parts["weights"] else 0.0
    rate = f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"  # small models
    return (f"weights {parts['weights']:.2f} s at {rate}, methods {parts['methods']:.2f} s beside them, "
            f"binding {parts['binding']:.2f} s, KV pool {parts['KV pool']:.2f} s, "
            f"graph capture {parts['graph capture']:.2f} s")


def _startup_seconds(executor: Executor) -> float:
    """The artifact's load, then the pool and graphs (the executor's setup); the tokenizer is built meanwhile."""
    return executor.artifact.report.load_seconds + executor.memory.setup_seconds


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"
