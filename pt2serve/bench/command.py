"""`pt2serve bench`: the command line over sweep.py and requests_mode.py (heavy imports stay inside)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

_HELP = """Benchmark an artifact: throughput per step width (sweep) or latency under load (requests).

--mode sweep: for each T in --tokens the runner's token budget is T and every steady step is exactly T tokens wide: T decoding requests when T fits a static forward size, else --decode-cap decodes plus a backlog of prompts of --prefill-chunk tokens. Each row is the median over --iters steady steps after --warmup:

- exec ms: time of executor.step (the compiled calls, ending with the sampled tokens on the host)
- step ms: start-to-start interval of consecutive steps (adds the runner's own per-step work)
- tok/s = T / step interval
- limit = max(bytes / measured memory bandwidth, FLOPs / measured matmul throughput); bytes = weights + KV cells (each sequence's context read once, new cells written); FLOPs = 2 x matmul params x T + attention
- % of limit = limit / step interval. Rows whose steps were not T wide are flagged, not hidden.
- eager ms: the peer, the row's middle measured step replayed through the uncompiled model module on the same weights (no compile, no CUDA graphs); x eager = eager ms / exec ms. --no-eager-peer skips it.

--mode requests: --requests prompts of --prompt-tokens random token ids, --max-new-tokens each (in-process with ignore_eos), arriving every --stagger-ms or as a seeded Poisson process at --request-rate. --url drives a running server's OpenAI API (POST /v1/completions, stream=true) instead.

- TTFT = first token time - submit time
- TPOT = (end - first token time) / (n - 1), n = output tokens (n >= 2)
- E2E = end - submit time (end: the last token's arrival)
- output tok/s = all output tokens / (last end - first submit); p50/p90/p99 of each latency

--mode quality --reference REF.pt2: the artifact (e.g. quantized) against REF (e.g. its bf16 export) on --requests prompts of --prompt-tokens random token ids, then REF's greedy continuation of --max-new-tokens, fed token by token to both:

- top-1 agreement = fraction of those positions where both artifacts' highest logit is the same token
- KL = KL(REF || artifact) of the next-token distributions, in nats: mean and max over the positions

--json writes every number with the machine, versions, artifact metadata and flags; --plot writes a PNG.
"""


def bench_command(
    artifact: Optional[Path] = typer.Argument(None, help="A .pt2 written by pt2serve export (optional with --url)."),
    mode: str = typer.Option("sweep", help="sweep, requests or quality."),
    reference: Optional[Path] = typer.Option(None, help="quality: the artifact to compare against (e.g. the bf16 export)."),
    tokens: Optional[str] = typer.Option(
        None, help="sweep: step widths T, comma-separated (default: 1,2,4,... up to min(4096, max_step_tokens))."
    ),
    warmup: int = typer.Option(3, help="sweep: steady steps skipped before measuring."),
    iters: int = typer.Option(10, help="sweep: steady steps measured (median reported)."),
    decode_cap: int = typer.Option(32, help="sweep: decoding requests in rows wider than the widest static size."),
    prefill_chunk: Optional[int] = typer.Option(
        None, help="sweep: backlog prompt length in those rows (default: min(256, max_context - 1))."
    ),
    prompt_tokens: Optional[int] = typer.Option(
        None, help="Prompt length: sweep's decoding requests (default 8); requests mode (default 128)."
    ),
    requests: int = typer.Option(32, help="requests: how many; quality: how many prompts."),
    max_new_tokens: int = typer.Option(64, help="requests: output tokens per request; quality: positions per prompt."),
    stagger_ms: Optional[float] = typer.Option(None, help="requests: fixed gap between arrivals (default 0)."),
    request_rate: Optional[float] = typer.Option(None, help="requests: Poisson arrivals at this rate (req/s)."),
    seed: int = typer.Option(0, help="Seed for prompts and arrivals."),
    token_budget: Optional[int] = typer.Option(None, help="requests, in-process: runner tokens per step."),
    url: Optional[str] = typer.Option(None, help="requests: drive the server at this URL instead (e.g. http://127.0.0.1:8000)."),
    model: Optional[str] = typer.Option(None, help="requests with --url: model name (default: the server's first)."),
    device: Optional[str] = typer.Option(None, help="Load onto this device (default: what the artifact was built for)."),
    num_cells: Optional[int] = typer.Option(None, help="KV pool size in cells (default: the executor's)."),
    no_cuda_graphs: bool = typer.Option(
        False, "--no-cuda-graphs", help="In-process runs without CUDA graphs (then every step runs forward_others)."
    ),
    timeout: float = typer.Option(600.0, help="Seconds a sweep row, or the whole requests run, may take."),
    eager_peer: bool = typer.Option(True, help="sweep: also time each row's middle step in eager PyTorch."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every number to this JSON file."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG plot here (needs matplotlib)."),
) -> None:
    from pt2serve.cli import fail
    from pt2serve.errors import Pt2ServeError

    try:
        _run(**locals_without(locals(), "fail", "Pt2ServeError"))
    except Pt2ServeError as err:
        fail(str(err))


bench_command.__doc__ = _HELP


def locals_without(values: dict, *names: str) -> dict:
    return {k: v for k, v in values.items() if k not in names}


def _run(
    artifact, mode, reference, tokens, warmup, iters, decode_cap, prefill_chunk, prompt_tokens, requests, max_new_tokens,
    stagger_ms, request_rate, seed, token_budget, url, model, device, num_cells, no_cuda_graphs, timeout,
    eager_peer, json_path, plot,
) -> None:
    from rich.console import Console

    from pt2serve.bench.options import MODES, RequestsOptions, SweepOptions, parse_tokens
    from pt2serve.bench.progress import StatusLine
    from pt2serve.errors import Pt2ServeError
    from pt2serve.runtime.artifact import read_metadata
    from pt2serve.runtime.executor import ExecutorConfig

    flags = {
        "artifact": artifact, "mode": mode, "reference": reference, "tokens": tokens, "warmup": warmup, "iters": iters,
        "decode_cap": decode_cap, "prefill_chunk": prefill_chunk, "prompt_tokens": prompt_tokens,
        "requests": requests, "max_new_tokens": max_new_tokens, "stagger_ms": stagger_ms,
        "request_rate": request_rate, "seed": seed, "token_budget": token_budget, "url": url, "model": model,
        "device": device, "num_cells": num_cells, "no_cuda_graphs": no_cuda_graphs, "timeout": timeout, "eager_peer": eager_peer, "json": json_path,
        "plot": plot,
    }
    if mode not in MODES:
        raise Pt2ServeError(f"unknown --mode {mode!r}: choose {' or '.join(MODES)}")
    wrong_mode = {
        "sweep": {"--stagger-ms": stagger_ms, "--request-rate": request_rate, "--url": url, "--model": model,
                  "--token-budget": token_budget, "--reference": reference},
        "requests": {"--tokens": tokens, "--prefill-chunk": prefill_chunk, "--reference": reference},
        "quality": {"--tokens": tokens, "--prefill-chunk": prefill_chunk, "--stagger-ms": stagger_ms,
                    "--request-rate": request_rate, "--url": url, "--model": model, "--token-budget": token_budget,
                    "--plot": plot},
    }[mode]
    given = [name for name, value in wrong_mode.items() if value is not None]
    if given:
        raise Pt2ServeError(f"{', '.join(given)} do not apply to --mode {mode}")
    if mode == "quality" and (artifact is None or reference is None):
        raise Pt2ServeError("--mode quality compares two artifacts: give PATH.pt2 and --reference REF.pt2")
    if stagger_ms is not None and request_rate is not None:
        raise Pt2ServeError("give --stagger-ms or --request-rate, not both")
    if artifact is None and url is None:
        raise Pt2ServeError("give the artifact to benchmark (PATH.pt2), or --url with --mode requests")
    raw = read_metadata(artifact).raw if artifact is not None else None  # a missing or bad artifact fails here
    if num_cells is not None and num_cells < 2:
        raise Pt2ServeError(f"--num-cells must be at least 2, got {num_cells}")
    executor_config = ExecutorConfig(num_cells=num_cells, use_cuda_graphs=not no_cuda_graphs)
    if plot is not None:
        from pt2serve.bench.report import check_plot_support

        check_plot_support()
    from pt2serve.bench import report

    # A table cut to 80 columns is unreadable in logs: outside a terminal, give it room.
    console = Console() if sys.stdout.isatty() else Console(width=180)
    name = artifact.name if artifact is not None else url
    if mode == "sweep":
        from pt2serve.bench.sweep import run_sweep

        options = SweepOptions(
            tokens=parse_tokens(tokens) if tokens is not None else None, warmup=warmup, iters=iters,
            decode_cap=decode_cap, prefill_chunk=prefill_chunk,
            prompt_tokens=prompt_tokens if prompt_tokens is not None else SweepOptions.prompt_tokens,
            seed=seed, row_timeout=timeout, eager_peer=eager_peer,
        )
        with StatusLine() as status:
            result = run_sweep(artifact, options, device=device, executor_config=executor_config, progress=status)
        title = f"pt2serve bench sweep: {name} on {result.device}"
        console.print(report.sweep_table(result, title))
        document = report.sweep_document(result, str(artifact), raw, flags)
        if plot is not None:
            report.plot_sweep(result, plot, title)
    elif mode == "quality":
        from pt2serve.bench.quality import QualityOptions, run_quality

        read_metadata(reference)  # a missing or bad reference fails before anything loads
        options = QualityOptions(
            prompts=requests, prompt_tokens=prompt_tokens if prompt_tokens is not None else QualityOptions.prompt_tokens,
            max_new_tokens=max_new_tokens, seed=seed,
        )
        with StatusLine() as status:
            result = run_quality(artifact, reference, options, device=device, progress=status)
        console.print(report.quality_table(result, f"pt2serve bench quality: {name} against {reference.name}"))
        document = report.quality_document(result, str(artifact), raw, flags)
    else:
        from pt2serve.bench.requests_mode import run_requests

        options = RequestsOptions(
            requests=requests,
            prompt_tokens=prompt_tokens if prompt_tokens is not None else RequestsOptions.prompt_tokens,
            max_new_tokens=max_new_tokens, stagger_ms=stagger_ms or 0.0, request_rate=request_rate, seed=seed,
            token_budget=token_budget, url=url, model=model, timeout=timeout,
        )
        with StatusLine() as status:
            result = run_requests(artifact, options, device=device, executor_config=executor_config,
                                  progress=status)
        title = f"pt2serve bench requests: {name}" + (f" on {result.device}" if result.device else "")
        console.print(report.requests_table(result, title))
        document = report.requests_document(result, str(artifact) if artifact else None, raw, flags)
        if plot is not None:
            report.plot_requests(result, plot, title)
    if json_path is not None:
        report.write_json(document, json_path)
        console.print(f"wrote {json_path}")
    if plot is not None:
        console.print(f"wrote {plot}")
