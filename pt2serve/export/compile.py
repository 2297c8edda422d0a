"""Tracing and AOTInductor-compiling methods, serially or in worker processes.

Each worker builds the model once (from the checkpoint or preset: workers share nothing with the parent)
and compiles the methods it is handed. Weights are left out of every compiled method
(package_constants_in_so=False); the package stores them once and the runtime binds them at load.
"""

from __future__ import annotations

import contextlib
import functools
import os
import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Iterator

import torch
import torch._inductor

from pt2serve.contract import ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED, DRAFT_CONTEXT
from pt2serve.export import inductor_fixes
from pt2serve.export.methods import (
    MethodSpec,
    trace_acceptor,
    trace_draft_block,
    trace_draft_context,
    trace_forward,
    trace_sampler,
)
from pt2serve.kernels import batch_invariant
from pt2serve.kernels.linear_choice import LinearChoices, using
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.checkpoint import load_model
from pt2serve.model.dflash import attach_draft
from pt2serve.model.kv_fp8 import has_kv_scales, install_kv_scales
from pt2serve.model.model import Transformer
from pt2serve.model.quant import QuantScheme


@dataclass(frozen=True)
class CompileJob:
    """Everything a worker needs to rebuild the model and compile one method."""

    spec: MethodSpec
    checkpoint: str | None
    preset: str | None
    dtype: torch.dtype
    device: str
    max_step_tokens: int
    max_cells: int
    attention: AttentionImpl
    quantize: QuantScheme | None = None
    linear_choices: dict | None = None  # LinearChoices.to_dict(): the small-M kernels the export chose
    draft: str | None = None  # a DFlash draft directory: the model taps its layers and holds the draft
    max_draft_cells: int = 0  # the draft pool's largest cell count (with a draft)
    kv_scales: tuple | None = None  # FP8 cells: each layer's (k_scale, v_scale), calibrated once by the export
    deterministic_context: int | None = None  # --deterministic: the max context (model/attention.py), else None


def inductor_options(deterministic: bool = False) -> dict:
    options = {
        "aot_inductor.package": True,
        "aot_inductor.package_constants_in_so": False,
        # Dynamic dims are traced with min 2; the runtime may run smaller sizes, which the code handles.
        "aot_inductor.check_lowerbound": False,
    }
    if deterministic:
        options.update(deterministic_inductor_options())
    return options


def deterministic_inductor_options() -> dict:
    """Inductor settings of a deterministic method: no reduction split in two kernels by its size (on the GPU
    Inductor splits a long reduction over few rows, so a one-row norm would sum in another order than a
    wide one), and, where this torch has it, Inductor's own batch-invariant mode (torch 2.13's fixes the
    batch dim's hint when it picks a reduction's tiles). Options this torch lacks are left out."""
    wanted = {"split_reductions": False, "batch_invariant": True}
    return {name: value for name, value in wanted.items() if hasattr(torch._inductor.config, name)}


def _init_worker(threads_per_worker: int) -> None:
    # Each worker runs its own pool of kernel compilers: share the cores instead of oversubscribing them.
    torch._inductor.config.compile_threads = threads_per_worker


@functools.cache
def _worker_model(
    checkpoint: str | None, preset: str | None, dtype: torch.dtype, device: str, attention: AttentionImpl,
    quantize: QuantScheme | None, draft: str | None,
) -> Transformer:
    model = load_model(checkpoint, preset, dtype, device, attention, quantize).model.eval()
    if draft is not None:
        attach_draft(model, draft)
    return model


def _job_model(job: CompileJob) -> Transformer:
    model = _worker_model(job.checkpoint, job.preset, job.dtype, job.device, job.attention, job.quantize, job.draft)
    if job.kv_scales is not None and not has_kv_scales(model):
        install_kv_scales(model, job.kv_scales)
    return model


# Notices torch prints while tracing and compiling that a user of export can do nothing about: a deprecation
# inside torch's own pytree code, Inductor's note that it split a softmax reduction, and TF32 advice for fp32
# graphs, which an fp32 export keeps exact on purpose.
COMPILER_NOTICES = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r"\s*Online softmax is disabled on the fly"),
    (UserWarning, r"TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"),
)


@contextlib.contextmanager
def _without_compiler_notices() -> Iterator[None]:
    with warnings.catch_warnings():
        for category, message in COMPILER_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def compile_method(job: CompileJob, model: Transformer | None = None) -> tuple[str, list]:
    """Trace and compile one method; returns (method name, AOTInductor files)."""
    try:
        with _without_compiler_notices():
            return _compile_method(job, model)
    except Exception as err:
        # Compiler exceptions do not always survive pickling back from a worker: send their text.
        raise RuntimeError(f"compiling {job.spec.name} failed: {type(err).__name__}: {err}") from None


def _compile_method(job: CompileJob, model: Transformer | None) -> tuple[str, list]:
    if model is None:
        model = _job_model(job)
    model.deterministic_context = job.deterministic_context  # read when the forward is traced
    deterministic = job.deterministic_context is not None
    if job.spec.name.startswith("forward"):
        with using(LinearChoices.from_dict(job.linear_choices or {})), batch_invariant.tracing(deterministic):
            program, args = trace_forward(model, job.spec, job.max_step_tokens, job.max_cells)
    elif job.spec.name == DRAFT_CONTEXT:
        program, args = trace_draft_context(model, job.max_step_tokens, job.max_draft_cells)
    elif job.spec.num_seqs is not None:
        program, args = trace_draft_block(model, job.spec, job.max_draft_cells)
    elif job.spec.name in (ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED):
        program, args = trace_acceptor(job.spec, model.config.vocab_size, job.device)
    else:
        program, args = trace_sampler(job.spec, model.config.vocab_size, job.device)
    inductor_fixes.apply()
    with torch.no_grad():
        files = torch._inductor.aot_compile(program.module(), args, options=inductor_options(deterministic))
    return job.spec.name, files


def compile_all(jobs: list[CompileJob], num_workers: int, model: Transformer) -> Iterator[tuple[str, list]]:
    """Yield (name, files) as methods finish; in-process when one worker is asked for."""
    if num_workers <= 1:
        for job in jobs:
            yield compile_method(job, model)
        return
    # spawn, not fork: CUDA cannot be used in a forked child.
    context = multiprocessing.get_context("spawn")
    num_workers = min(num_workers, len(jobs))
    threads = max(1, (os.cpu_count() or 1) // num_workers)
    with ProcessPoolExecutor(num_workers, mp_context=context, initializer=_init_worker, initargs=(threads,)) as pool:
        futures = [pool.submit(compile_method, job) for job in jobs]
        for future in as_completed(futures):
            yield future.result()

