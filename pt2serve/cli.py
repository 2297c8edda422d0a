"""The `pt2serve` command line: export, inspect, generate (and serve-artifact, serve-ray, bench)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from pt2serve.cli_errors import fail
from pt2serve.contract import FP8_FORMAT
from pt2serve.errors import Pt2ServeError
from pt2serve.export.defaults import (
    DEFAULT_DRAFT_SIZES,
    DEFAULT_FORWARD_SIZES,
    DEFAULT_GRAPH_ENTRIES,
    DEFAULT_MAX_CELLS,
    DEFAULT_MAX_STEP_TOKENS,
    DEFAULT_MIN_PREFILL_CHUNK,
)
from pt2serve.runtime_flags import deterministic_option, num_draft_tokens_option, speculate_option, speculation

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        fail(f"expected comma-separated integers, got {text!r}")


@app.command("export")
def export_command(
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the .pt2 package."),
    backend: str = typer.Option("cuda", help="cuda or cpu."),
    use_offgraph_kv_cache: bool = typer.Option(
        False, "--use-offgraph-kv-cache", help="Keep the KV pool outside the graph (required: the batching contract)."
    ),
    checkpoint: Optional[Path] = typer.Option(None, help="Hugging Face-format checkpoint directory, or a Hub id "
                                              "(ORG/NAME) read through the Hugging Face cache."),
    revision: Optional[str] = typer.Option(None, help="Branch, tag or commit of a Hub checkpoint (default: main)."),
    hf_token: Optional[str] = typer.Option(None, help="Hugging Face token for gated or private checkpoints "
                                           "(default: HF_TOKEN or the saved login)."),
    preset: Optional[str] = typer.Option(None, help="Built-in model with generated weights (e.g. tiny)."),
    dtype: Optional[str] = typer.Option(None, help="bf16, fp16 or fp32 (default: bf16 on cuda, fp32 on cpu)."),
    kv_dtype: Optional[str] = typer.Option(
        None, help="KV cells: fp8 (e4m3 with a scale per layer and KV head, calibrated at export: twice the "
        "tokens in the same memory) or the model's dtype (the default)."
    ),
    attention: Optional[str] = typer.Option(
        None, help="kernel (Triton: each token reads only its own cells; cuda only) or masked (plain PyTorch, "
        "cost grows with the entry capacity). Default: kernel on cuda, masked on cpu."
    ),
    forward_sizes: str = typer.Option(
        ",".join(map(str, DEFAULT_FORWARD_SIZES)), help="Static step widths, increasing."
    ),
    max_step_tokens: int = typer.Option(DEFAULT_MAX_STEP_TOKENS, help="Widest step forward_others runs."),
    max_cells: int = typer.Option(
        DEFAULT_MAX_CELLS, help="Upper bound on the KV pool (cells) the runtime may allocate; the runtime sizes the "
        "pool by the memory it finds. The default, 2^40, is no practical cap."
    ),
    max_context: Optional[int] = typer.Option(None, help="Longest sequence (default: the model's)."),
    graph_entries: int = typer.Option(
        DEFAULT_GRAPH_ENTRIES, help="Context cells one static step may list with --attention masked (which "
        "gathers them all; steps that list more run on forward_others), and one static DFlash draft call "
        "(--draft). With the attention kernel a static forward takes every context its width can meet."
    ),
    min_prefill_chunk: int = typer.Option(
        DEFAULT_MIN_PREFILL_CHUNK, help="Prefill is not cut into chunks shorter than this."
    ),
    jobs: Optional[int] = typer.Option(None, help="Parallel compile workers (default: one per core, at most 8; fewer when GPU memory is short)."),
    device_index: int = typer.Option(0, help="GPU to build on."),
    quantize: Optional[str] = typer.Option(
        None, help="Quantize the linear layers: fp8 (e4m3 weights with a scale per output channel, activations "
        "quantized per token; GPUs from sm_89), or weight-only int8 (symmetric) or int4 (with zero points)."
    ),
    group_size: Optional[int] = typer.Option(
        None, help="Inputs sharing one scale with --quantize (default: 128 for int4, a whole row for int8)."
    ),
    quantize_lm_head: bool = typer.Option(
        False, "--quantize-lm-head", help="Quantize the LM head too (with tied embeddings: the shared matrix)."
    ),
    quantize_embedding: bool = typer.Option(
        False, "--quantize-embedding", help="Quantize the input embedding too (with tied embeddings: the shared matrix)."
    ),
    draft: Optional[Path] = typer.Option(
        None, help="A DFlash draft checkpoint directory (z-lab layout) to export into the same artifact, for "
        "serving with --speculate dflash."
    ),
    draft_sizes: str = typer.Option(
        ",".join(map(str, DEFAULT_DRAFT_SIZES)), help="With --draft: sequences per static draft method, increasing."
    ),
    tune_matmuls: bool = typer.Option(
        True, "--tune-matmuls/--no-tune-matmuls",
        help="cuda: time the small-step matmul kernels against cuBLAS for each weight shape and static width, "
             "and each tile config of a quantized weight's kernel, and build each method with the fastest "
             "(recorded in the metadata; nothing is tuned at load).",
    ),
    deterministic: bool = typer.Option(
        False, "--deterministic/--no-deterministic",
        help="Build methods whose every row's logits are the same bits whatever shares its step, whichever "
             "method runs it, however its prompt is chunked and whether its prefix comes from the cache "
             "(batch-invariant matmuls, norms and attention; no matmul tuning; not with --quantize). "
             "serve-artifact, bench and generate --deterministic require such an artifact.",
    ),
) -> None:
    """Trace a model and compile it into one multi-method .pt2 package."""
    from pt2serve.export.exporter import export
    from pt2serve.export.options import ExportOptions

    if not use_offgraph_kv_cache:
        fail(
            "--use-offgraph-kv-cache is required: the batching runtime keeps the KV pool outside the graph so one "
            "compiled method serves any mix of sequences (an in-graph, single-sequence cache is not supported)"
        )
    options = ExportOptions(
        backend=backend, output=output, checkpoint=checkpoint, preset=preset, dtype=dtype, kv_dtype=kv_dtype,
        attention=attention,
        forward_sizes=parse_sizes(forward_sizes), max_step_tokens=max_step_tokens, max_cells=max_cells,
        max_context=max_context, graph_entries=graph_entries, min_prefill_chunk=min_prefill_chunk, jobs=jobs,
        device_index=device_index, quantize=quantize, group_size=group_size, quantize_lm_head=quantize_lm_head,
        quantize_embedding=quantize_embedding, tune_matmuls=tune_matmuls, revision=revision, hf_token=hf_token,
        draft=draft, draft_sizes=parse_sizes(draft_sizes), deterministic=deterministic,
    )
    try:
        summary = export(options)
    except Pt2ServeError as err:
        fail(str(err))
    console.print(
        f"wrote {output}: {len(summary.methods)} methods ({', '.join(summary.methods)}), "
        f"{summary.package_bytes / 1e6:.1f} MB (weights {summary.weight_bytes / 1e6:.1f} MB), "
        f"in {summary.seconds:.0f} s"
    )


@app.command("inspect")
def inspect_command(
    artifact: Path = typer.Argument(..., help="A .pt2 written by pt2serve export."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw metadata as JSON."),
) -> None:
    """Show an artifact's metadata and methods without loading it."""
    from pt2serve.runtime.artifact import read_metadata

    try:
        metadata = read_metadata(artifact)
    except Pt2ServeError as err:
        fail(str(err))
    meta = metadata.raw
    if as_json:
        sys.stdout.write(json.dumps(meta, indent=2) + "\n")
        return
    table = Table(title=str(artifact), show_header=False)
    cfg = meta["model_config"]
    built = meta["built_with"]
    rows = [
        ("format version", meta["format_version"]),
        ("source", meta.get("source")),
        ("architecture", meta["architecture"]),
        ("layers / hidden / heads / kv heads / head dim",
         f"{cfg['num_layers']} / {cfg['hidden_size']} / {cfg['num_heads']} / {cfg['num_kv_heads']} / {cfg['head_dim']}"),
        ("vocab size", meta["vocab_size"]),
        ("dtype / backend / attention", f"{meta['dtype']} / {meta['backend']} / {meta.get('attention', 'masked')}"),
        ("max context", meta["max_context"]),
        ("max cells", meta["max_cells"]),
        ("KV cells", describe_kv_cells(metadata)),
        ("forward sizes", ", ".join(map(str, meta["forward_sizes"]))),
        ("max step tokens", meta["max_step_tokens"]),
        ("min prefill chunk", meta["min_prefill_chunk"]),
        ("methods", ", ".join(meta["methods"])),
        ("weights", f"{len(meta['weights'])} tensors"),
        ("quantization", describe_quantization_record(meta.get("quantization"))),
        ("small-step matmuls", describe_linear_kernels(meta.get("linear_kernels"), meta["backend"])),
        ("deterministic", describe_determinism(metadata)),
        ("draft", describe_draft_record(meta.get("draft"))),
        ("tokenizer", "yes" if meta.get("tokenizer") else "no (token ids only)"),
        ("built with", f"torch {built['torch']}, cuda {built['cuda']}, {built.get('gpu_arch') or 'cpu'}"),
        ("content hash", meta["content_hash"]),
        ("hash scheme", "2: sha256 per weight" if meta.get("content_hash_scheme") == 2 else "1: one sha256 stream"),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


def describe_determinism(metadata) -> str:
    """One line for `inspect`: whether a row's logits depend on what else shares its step."""
    if metadata.deterministic:
        return "yes: a row's logits are the same bits at every width, in any company, however chunked (--deterministic)"
    return "no: a row's logits may differ in the last bits with the step's width, company and chunking"


def describe_draft_record(record: dict | None) -> str:
    """One line for `inspect`: the DFlash draft's shape and how it drafts."""
    if record is None:
        return "none"
    cache = record["cache"]
    return (f"dflash from {record['source']}: {cache['num_layers']} layers, block {record['block_size']}, "
            f"mask token {record['mask_token_id']}, taps layers {record['target_layer_ids']}, "
            f"draft sizes {', '.join(map(str, record['sizes']))}")


def describe_linear_kernels(record: dict | None, backend: str) -> str:
    """One line for `inspect`: how many timed float shapes took a Triton kernel instead of cuBLAS, how many
    quantized ones were tuned, and a step's matmuls untuned and tuned."""
    if record is None:
        return "cuBLAS (not tuned)" if backend == "cuda" else "not tuned (tuning needs a GPU)"
    # Quantized timings name a default config as their baseline; records from before they were timed name none.
    dense = [t for t in record["timings"] if t.get("baseline", "cuBLAS") == "cuBLAS"]
    fp8 = [t for t in record["timings"] if t.get("baseline") == "scaled_mm"]
    parts = []
    if dense:
        parts.append(f"Triton kernel for {sum(t['chosen'] for t in dense)} of {len(dense)} shape x width")
    if fp8:
        parts.append(f"FP8: Triton kernel for {sum(t['chosen'] for t in fp8)} of {len(fp8)} (else _scaled_mm)")
    quantized = len(record["timings"]) - len(dense) - len(fp8)
    if quantized:
        parts.append(f"quantized kernel config tuned for {quantized} shape x width")
    widths = "; ".join("M={}: {:.2f} -> {:.2f} ms".format(width, *_untuned_and_tuned(ms))
                       for width, ms in record["step_matmuls_ms"].items())
    return f"{', '.join(parts)}; untuned -> tuned: {widths}"


def _untuned_and_tuned(step_ms: dict) -> tuple[float, float]:
    if "untuned" in step_ms:
        return step_ms["untuned"], step_ms["tuned"]
    return step_ms["cublas"], step_ms["chosen"]  # records from before quantized weights were tuned


def describe_kv_cells(metadata) -> str:
    """One line for `inspect`: the cells' dtype and bytes per token."""
    from pt2serve.runtime.cells import bytes_per_cell

    cache = metadata.cache
    per_token = bytes_per_cell(cache["num_layers"], cache["num_kv_heads"], cache["head_dim"], metadata.kv_dtype)
    kind = "fp8 e4m3, a scale per layer and KV head" if cache["dtype"] == "fp8" else cache["dtype"]
    return f"{kind}; {per_token:,} bytes a token"


def describe_quantization_record(record: dict | None) -> str:
    """One line for `inspect`: e.g. 'int4 rtn, group 128, zero points; LM head and embedding not quantized'."""
    if record is None:
        return "none"
    if record.get("format") == FP8_FORMAT:
        head = "LM head quantized" if record["lm_head"] else "LM head and embedding not quantized"
        return (f"fp8 e4m3 {record['method']}, {record['weight_scales']} weight scales, {record['activations']} "
                f"activation scales; {record['num_layers_quantized']} layers; {head}")
    groups = f"group {record['group_size']}" if record["group_size"] else "one group per row"
    zeros = "symmetric" if record["symmetric"] else "zero points"
    order = ", act-order" if record["act_order"] else ""
    quantized = [part for part in ("lm_head", "embedding") if record[part]]
    plain = [part for part in ("lm_head", "embedding") if not record[part]]
    names = {"lm_head": "LM head", "embedding": "embedding"}
    extent = []
    if quantized:
        extent.append(" and ".join(names[p] for p in quantized) + " quantized")
    if plain:
        extent.append(" and ".join(names[p] for p in plain) + " not quantized")
    return (f"int{record['bits']} {record['method']}, {groups}, {zeros}{order}; "
            f"{record['num_layers_quantized']} layers; {'; '.join(extent)}")


@app.command("generate")
def generate_command(
    artifact: Path = typer.Argument(..., help="A .pt2 written by pt2serve export."),
    prompt: str = typer.Option(..., help="Prompt text (or comma-separated token ids with --token-ids)."),
    token_ids: bool = typer.Option(False, "--token-ids", help="Read --prompt as comma-separated token ids."),
    max_new_tokens: int = typer.Option(32, help="Tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 for greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 for no limit."),
    seed: Optional[int] = typer.Option(None, help="Seed of the request's sampler."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: what the artifact was built for)."),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs", help="No CUDA graphs (then every step runs forward_others)."),
    speculate: Optional[str] = speculate_option(),
    num_draft_tokens: Optional[int] = num_draft_tokens_option(),
    deterministic: bool = deterministic_option(),
) -> None:
    """Generate from a compiled artifact, streaming the text."""
    from pt2serve.runtime.engine import describe_load, open_runner
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig
    from pt2serve.runtime.sampling import SamplingParams

    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        runner_config = RunnerConfig(**speculation(speculate, num_draft_tokens))
        executor_config = ExecutorConfig(use_cuda_graphs=not no_cuda_graphs, deterministic=deterministic)
        runner = open_runner(artifact, device, executor_config, runner_config)
    except Pt2ServeError as err:
        fail(str(err))
    console.print(f"[dim]{describe_load(runner)}[/]")
    try:
        request = parse_sizes(prompt) if token_ids else prompt
        handle = runner.submit(request, max_new_tokens=max_new_tokens, sampling=sampling)
        for event in handle.events():
            text = event.text if runner.tokenizer is not None else (
                f"{event.token_id} " if event.token_id is not None else "")
            sys.stdout.write(text)
            sys.stdout.flush()
        done = handle.result()
        sys.stdout.write("\n")
        drafts = ""
        if done.stats.verify_steps:
            drafts = (f", {done.stats.accepted_tokens} of {done.stats.draft_tokens} drafted tokens accepted in "
                      f"{done.stats.verify_steps} steps")
        console.print(f"[dim]{done.stats.prompt_tokens} prompt tokens, {done.stats.completion_tokens} generated, "
                      f"finish: {done.finish_reason.value}{drafts}[/]")
    except Pt2ServeError as err:
        fail(str(err))
    finally:
        runner.close()


def _register_subcommands() -> None:
    # Each module keeps heavy imports inside its command, so `pt2serve --help` stays quick.
    from pt2serve.bench.command import bench_command
    from pt2serve.cluster.command import serve_ray_command
    from pt2serve.serve.command import serve_artifact_command

    app.command("serve-artifact")(serve_artifact_command)
    app.command("bench")(bench_command)
    app.command("serve-ray")(serve_ray_command)


_register_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
