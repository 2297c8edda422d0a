"""`pt2serve export`: model -> traced methods -> AOTInductor -> one .pt2 with weights once and metadata."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

import pt2serve
from pt2serve.contract import CONTENT_HASH_SCHEME, FORMAT_VERSION, internal_model_name
from pt2serve.export.compile import CompileJob, compile_all
from pt2serve.export.linear_tuning import describe, tune
from pt2serve.export.methods import draft_specs, method_specs
from pt2serve.export.options import ExportOptions
from pt2serve.export.toolchain import libstdcxx_mismatch, warn_about
from pt2serve.export.package import weight_entries, weights_hash, write_package
from pt2serve.kernels.linear_choice import LinearChoices
from pt2serve.model.checkpoint import load_model
from pt2serve.model.dflash import DFlashDraft, attach_draft
from pt2serve.model.hub import resolve_checkpoint
from pt2serve.model.kv_fp8 import calibrate_kv_scales, install_kv_scales
from pt2serve.model.model import Transformer
from pt2serve.model.quant import describe_quantization


@dataclass(frozen=True)
class ExportSummary:
    methods: tuple[str, ...]
    package_bytes: int
    weight_bytes: int
    seconds: float


def export(options: ExportOptions, show_progress: bool = True) -> ExportSummary:
    """Build the artifact described by `options`; raises Pt2ServeError on bad input before compiling."""
    started = time.perf_counter()
    options.validate()
    mismatch = libstdcxx_mismatch()
    if mismatch:
        warn_about(mismatch)
    resolved = None
    if options.checkpoint is not None:
        resolved = resolve_checkpoint(str(options.checkpoint), options.revision, options.hf_token)
    checkpoint = str(resolved.path) if resolved is not None else None
    loaded = load_model(
        checkpoint, options.preset, options.torch_dtype, options.device, options.attention_impl, options.quant_scheme
    )
    config, model, tokenizer = loaded.config, loaded.model, loaded.tokenizer
    max_context = options.validate_for_model(config.context_length)
    kv_scales = None
    if options.kv_dtype == "fp8":
        kv_scales = tuple(calibrate_kv_scales(model))
        install_kv_scales(model, kv_scales)
    choices, tuning = LinearChoices({}), None
    # A deterministic method takes one batch-invariant matmul at every width: nothing to tune.
    if options.backend == "cuda" and options.tune_matmuls and not options.deterministic:
        choices, timings = tune(model, options.forward_sizes, show_progress)
        tuning = describe(model, timings) | {"choices": choices.to_dict()}
    specs = method_specs(options.forward_sizes, lambda width: options.entries_for(width, max_context))
    draft, max_draft_cells = None, 0
    if options.draft is not None:
        draft = attach_draft(model, options.draft)  # checks the draft against the target before any compile
        block = draft.config.block_size
        specs += draft_specs(options.draft_sizes, lambda n: options.draft_entries_for(n, max_context, block))
        max_draft_cells = options.max_cells + 1 + max(options.draft_sizes) * block
    jobs = [
        CompileJob(spec, checkpoint, options.preset, options.torch_dtype, options.device,
                   options.max_step_tokens, options.max_cells, options.attention_impl, options.quant_scheme,
                   choices.to_dict(), str(options.draft) if options.draft is not None else None,
                   max_draft_cells, kv_scales, max_context if options.deterministic else None)
        for spec in specs
    ]
    internal = {spec.name: internal_model_name(i) for i, spec in enumerate(specs)}
    aoti_files: dict[str, list] = {}
    # Each worker builds its own model, in float before it quantizes one: budget for the larger of the two.
    worker_bytes = max(weight_bytes(model), config.weight_count * options.torch_dtype.itemsize)
    num_workers = options.num_jobs(worker_bytes)
    if num_workers > 1 and options.backend == "cuda":
        # Workers build their own copies; the parent's only waits to be packaged, so park it on the host.
        model = model.cpu()
        torch.cuda.empty_cache()
        num_workers = options.num_jobs(worker_bytes)
    progress = tqdm(total=len(jobs), desc="compiling methods", unit="method", disable=not show_progress)
    with progress:
        for name, files in compile_all(jobs, num_workers, model):
            aoti_files[internal[name]] = files
            progress.set_postfix_str(name)
            progress.update()
    weights = model_weights(model)
    metadata = build_metadata(options, config.to_dict(), max_context, specs, internal, weights, tokenizer)
    metadata["generation_defaults"] = loaded.generation_defaults
    if resolved is not None:
        metadata["source"] = resolved.source
    metadata["built_with"]["libstdcxx_mismatch"] = mismatch
    metadata["quantization"] = describe_quantization(model, loaded.quantization_method)
    metadata["linear_kernels"] = tuning
    if draft is not None:
        metadata["draft"] = draft_metadata(draft, options)
    write_package(options.output, aoti_files, weights, metadata, tokenizer.tokenizer_json if tokenizer else None)
    return ExportSummary(
        methods=tuple(spec.name for spec in specs),
        package_bytes=options.output.stat().st_size,
        weight_bytes=weight_bytes(model),
        seconds=time.perf_counter() - started,
    )


def weight_bytes(model: Transformer) -> int:
    return sum(t.numel() * t.element_size() for t in model_weights(model).values())


def model_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Every constant a compiled method may ask for: parameters plus non-persistent buffers (inv_freq)."""
    weights = dict(model.named_parameters())
    weights.update(model.named_buffers())
    return {name: t.detach() for name, t in weights.items()}


def build_metadata(
    options: ExportOptions,
    config: dict[str, Any],
    max_context: int,
    specs,
    internal: dict[str, str],
    weights: dict[str, torch.Tensor],
    tokenizer,
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "source": f"checkpoint:{options.checkpoint}" if options.checkpoint else f"preset:{options.preset}",
        "architecture": config["architecture"],
        "model_config": config,
        "vocab_size": config["vocab_size"],
        "max_context": max_context,
        "cache": {
            "num_layers": config["num_layers"],
            "num_kv_heads": config["num_kv_heads"],
            "head_dim": config["head_dim"],
            "dtype": options.kv_dtype_name,
        },
        "max_cells": options.max_cells,
        "forward_sizes": list(options.forward_sizes),
        "max_step_tokens": options.max_step_tokens,
        "min_prefill_chunk": options.min_prefill_chunk,
        "dtype": options.dtype_name,
        "backend": options.backend,
        "attention": options.attention_impl.value,
        "deterministic": options.deterministic,
        "methods": {spec.name: method_metadata(spec, internal[spec.name]) for spec in specs},
        "weights": weight_entries(weights),
        "content_hash": weights_hash(config, weights),
        "content_hash_scheme": CONTENT_HASH_SCHEME,
        "tokenizer": tokenizer.to_dict() if tokenizer else None,
        "built_with": build_environment(options),
    }


def method_metadata(spec, internal_name: str) -> dict[str, Any]:
    entry = {"internal_name": internal_name, "width": spec.width, "num_entries": spec.num_entries}
    if spec.num_seqs is not None:
        entry["num_seqs"] = spec.num_seqs
    return entry


def draft_metadata(draft: DFlashDraft, options: ExportOptions) -> dict[str, Any]:
    """What the runtime needs of a DFlash draft: how it drafts and its cell pool's geometry."""
    cfg = draft.config
    return {
        "kind": "dflash",
        "source": str(options.draft),
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "sizes": sorted(options.draft_sizes),
        "cache": {"num_layers": cfg.layers.num_layers, "num_kv_heads": cfg.layers.num_kv_heads,
                  "head_dim": cfg.layers.head_dim, "dtype": options.dtype_name},
        "config": cfg.to_dict(),
    }


def build_environment(options: ExportOptions) -> dict[str, Any]:
    env: dict[str, Any] = {
        "pt2serve": pt2serve.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "gpu_arch": None,
        "gpu_name": None,
    }
    if options.backend == "cuda":
        major, minor = torch.cuda.get_device_capability(options.device_index)
        env["gpu_arch"] = f"sm_{major}{minor}"
        env["gpu_name"] = torch.cuda.get_device_name(options.device_index)
    return env
