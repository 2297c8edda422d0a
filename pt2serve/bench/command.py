"""`pt2serve bench`: the command line over sweep.py and requests_mode.py (heavy imports stay inside)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from pt2serve.bench.options import DEFAULT_TPOT_TARGET_MS, DEFAULT_TTFT_TARGET_MS
from pt2serve.bench.startup import DEFAULT_RUNS
from pt2serve.cli_errors import fail
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime_flags import (
    deterministic_option,
    kv_memory_fraction_option,
    kv_pool,
    max_decode_sequences_option,
    min_prefill_chunk_option,
    num_cells_option,
    num_draft_tokens_option,
    prefix_cache_option,
    prefix_reuse,
    speculate_option,
    speculation,
    step_budget,
    token_budget_option,
)

_HELP = f"""Benchmark an artifact: throughput per step width (sweep) or latency under load (requests).

--mode sweep: for each T in --tokens the runner's token budget is T and every steady step is exactly T tokens wide: T decoding requests when T fits a static forward size, else --decode-cap decodes plus a backlog of prompts of --prefill-chunk tokens. Each row is the median over --iters steady steps after --warmup:

- exec ms: the step's own time on the device (CUDA events around its queued work; on the CPU, the time of the launch, which runs it)
- step ms: launch-to-launch interval of consecutive steps (the runner keeps one step in flight: its own per-step work shows only where it outlasts a device step)
- tok/s = T / step interval
- limit = max(bytes / measured memory bandwidth, FLOPs / measured matmul throughput); bytes = weights + KV cells (each sequence's context read once, new cells written); FLOPs = 2 x matmul params x T + attention
- % of limit = limit / step interval. Rows whose steps were not T wide are flagged, not hidden.
- eager ms: the peer, the row's middle measured step replayed through the uncompiled model module on the same weights (no compile, no CUDA graphs); x eager = eager ms / exec ms. --no-eager-peer skips it.

--mode requests: --requests prompts of --prompt-tokens random token ids, --max-new-tokens each (greedy, with ignore_eos), arriving every --stagger-ms or as a seeded Poisson process at --request-rate. --url drives a running server's OpenAI API (POST /v1/completions, stream=true, temperature 0, ignore_eos) instead. --request-rates 1,2,4,8 runs the whole workload once per rate (Poisson arrivals; each run's own prompts, so a server's prefix cache holds none from the run before) and prints one row per offered rate: where achieved throughput stops following it and latency climbs, the target is saturated.

- TTFT = first token time - submit time
- TPOT = (end - first token time) / (n - 1), n = output tokens (n >= 2)
- E2E = end - submit time (end: the last token's arrival)
- output tok/s = all output tokens / (last end - first submit); req/s = completed requests / the same time; p50/p90/p99 of each latency
- goodput = requests with TTFT <= --ttft-target-ms and TPOT <= --tpot-target-ms (none for one-token answers), per second of the same time. The default targets, {DEFAULT_TTFT_TARGET_MS:g} ms and {DEFAULT_TPOT_TARGET_MS:g} ms, are MLPerf Inference's server-scenario limits for Llama 3.1 8B: a reply starts within 2 s and then streams at 10 tokens/s or faster, quicker than people read (MLPerf holds its p99 to them; goodput counts each request).
- in-process: steps = runner steps the workload took, mean width = their tokens / steps; the step budget (--token-budget, --max-decode-sequences, --min-prefill-chunk) is the runner's unless given
- prompt tokens reused = those whose KV cells came from the prefix cache (usage.prompt_tokens_details.cached_tokens); computed = the rest. --no-prefix-cache runs without it (in-process), for a before/after.

--workload chat: --requests conversations, each --turns turns long, all starting with one system prompt of --system-tokens; each turn is a user message of --prompt-tokens and a reply of --max-new-tokens, sent as the whole conversation so far through the chat template (in-process the artifact's; with --url POST /v1/chat/completions), the replies as the text they came back as, each turn as soon as the last one ended. In process, an artifact without a tokenizer has conversations of token ids (system, then each user turn and reply as sampled). TTFT is also shown for first turns and later turns apart.

--mode quality --reference REF.pt2: the artifact (e.g. quantized) against REF (e.g. its bf16 export) on --requests prompts of --prompt-tokens random token ids, then REF's greedy continuation of --max-new-tokens, fed token by token to both:

- top-1 agreement = fraction of those positions where both artifacts' highest logit is the same token
- KL = KL(REF || artifact) of the next-token distributions, in nats: mean and max over the positions

--mode profile: where a decode step's time goes, kernel by kernel. For each T in --tokens (default 1,64), T sequences at context 64 decode together with CUDA graphs off (so every kernel is seen) on the static methods; --iters steps after --warmup run under torch.profiler. Per T: the kernels' device time per step, the kernels a step launches, and the 16 that took the most time with their calls per step and share (on the CPU: operators and their own CPU time).

--mode matmuls: a decode step's weight matmuls alone (every layer's projections and the LM head of the artifact's model, random weights in its dtype) at M = --tokens rows (default 1,8,16,32,64), back to back, against the floor = the weights' bytes / measured copy bandwidth; the plain matmuls (cuBLAS) beside the kernels the export chose (its small-M Triton kernels where they won). On a GPU in one CUDA graph, the median of --iters replays.

--mode startup: --runs launches (default 2) of pt2serve serve-artifact on 127.0.0.1 (with the pool, graph and step budget flags given here), each timed from launch to the first 200 from /health (at most --timeout seconds) and stopped with SIGINT; beside it the server's own load line: ready after launch, and the load's parts (weights, methods beside them, binding, KV pool, graph capture).

--json writes every number with the machine, versions, artifact metadata and flags; --plot writes a PNG.
"""


def bench_command(
    artifact: Optional[Path] = typer.Argument(None, help="A .pt2 written by pt2serve export (optional with --url)."),
    mode: str = typer.Option("sweep", help="sweep, requests, quality, profile, matmuls or startup (see above)."),
    reference: Optional[Path] = typer.Option(None, help="quality: the artifact to compare against (e.g. the bf16 export)."),
    tokens: Optional[str] = typer.Option(
        None, help="sweep: step widths T, comma-separated (default: 1,2,4,... up to min(4096, max_step_tokens)); "
        "profile: decode widths (default 1,64); matmuls: rows M (default 1,8,16,32,64)."
    ),
    warmup: int = typer.Option(3, help="sweep: steady steps skipped before measuring (profile: decode steps)."),
    iters: int = typer.Option(10, help="sweep: steady steps measured (median reported); profile: steps profiled; "
                              "matmuls: timed runs (median reported)."),
    decode_cap: int = typer.Option(32, help="sweep: decoding requests in rows wider than the widest static size."),
    prefill_chunk: Optional[int] = typer.Option(
        None, help="sweep: backlog prompt length in those rows (default: min(256, max_context - 1))."
    ),
    context: Optional[str] = typer.Option(
        None, help="sweep: the contexts the decoding requests decode at, their prompt length, comma-separated "
        "(default 8); e.g. 4000,16000,32000 measures long-context decode, every T at each, the KV read counted "
        "in the limit."
    ),
    prompt_tokens: Optional[int] = typer.Option(
        None, help="requests and quality: prompt length (default 128); chat: each user message's length."
    ),
    workload: Optional[str] = typer.Option(
        None, help="requests: random (prompts of random token ids, the default) or chat (multi-turn conversations "
        "sharing a system prompt; see above)."
    ),
    turns: Optional[int] = typer.Option(None, help="requests, chat workload: turns per conversation (default 6)."),
    system_tokens: Optional[int] = typer.Option(
        None, help="requests, chat workload: tokens of the shared system prompt (default 1024)."
    ),
    requests: int = typer.Option(32, help="requests: how many (chat: conversations); quality: how many prompts."),
    max_new_tokens: int = typer.Option(64, help="requests: output tokens per request; quality: positions per prompt."),
    stagger_ms: Optional[float] = typer.Option(None, help="requests: fixed gap between arrivals (default 0)."),
    request_rate: Optional[float] = typer.Option(None, help="requests: Poisson arrivals at this rate (req/s)."),
    request_rates: Optional[str] = typer.Option(
        None, help="requests: run the workload once per rate (req/s, Poisson), comma-separated, e.g. 1,2,4,8."
    ),
    ttft_target_ms: Optional[float] = typer.Option(
        None, help=f"requests: goodput's TTFT target (default {DEFAULT_TTFT_TARGET_MS:g} ms; see above)."
    ),
    tpot_target_ms: Optional[float] = typer.Option(
        None, help=f"requests: goodput's TPOT target (default {DEFAULT_TPOT_TARGET_MS:g} ms; see above)."
    ),
    seed: int = typer.Option(0, help="Seed for prompts and arrivals."),
    token_budget: Optional[int] = token_budget_option(),
    max_decode_sequences: Optional[int] = max_decode_sequences_option(),
    min_prefill_chunk: Optional[int] = min_prefill_chunk_option(),
    prefix_cache: Optional[bool] = prefix_cache_option(),
    speculate: Optional[str] = speculate_option(),
    num_draft_tokens: Optional[int] = num_draft_tokens_option(),
    url: Optional[str] = typer.Option(None, help="requests: drive the server at this URL instead (e.g. http://127.0.0.1:8000)."),
    model: Optional[str] = typer.Option(None, help="requests with --url: model name (default: the server's first)."),
    device: Optional[str] = typer.Option(None, help="Load onto this device (default: what the artifact was built for)."),
    num_cells: Optional[int] = num_cells_option(),
    kv_memory_fraction: Optional[float] = kv_memory_fraction_option(),
    no_cuda_graphs: bool = typer.Option(
        False, "--no-cuda-graphs", help="In-process runs without CUDA graphs (then every step runs forward_others)."
    ),
    deterministic: bool = deterministic_option(),
    timeout: float = typer.Option(600.0, help="Seconds a sweep row, or each requests run, may take (startup: "
                                  "each launch until ready)."),
    runs: Optional[int] = typer.Option(None, help=f"startup: server launches (default {DEFAULT_RUNS})."),
    eager_peer: bool = typer.Option(True, help="sweep: also time each row's middle step in eager PyTorch."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every number to this JSON file."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG plot here (needs matplotlib)."),
) -> None:
    try:
        _run(**locals())
    except Pt2ServeError as err:
        fail(str(err))


bench_command.__doc__ = _HELP


def _run(
    artifact, mode, reference, tokens, warmup, iters, decode_cap, prefill_chunk, context, prompt_tokens, workload,
    turns, system_tokens, requests, max_new_tokens, stagger_ms, request_rate, request_rates, ttft_target_ms,
    tpot_target_ms, seed, token_budget, max_decode_sequences, min_prefill_chunk, prefix_cache, speculate,
    num_draft_tokens, url, model, device,
    num_cells, kv_memory_fraction, no_cuda_graphs, deterministic, timeout, runs, eager_peer, json_path, plot,
) -> None:
    # Every flag as given, for the JSON report (taken first, before the imports below add names).
    flags = {("json" if name == "json_path" else name): value for name, value in locals().items()}
    from rich.console import Console

    from pt2serve.bench.options import (
        MODES,
        LatencyTargets,
        RequestsOptions,
        SweepOptions,
        parse_contexts,
        parse_rates,
        parse_tokens,
    )
    from pt2serve.bench.progress import StatusLine
    from pt2serve.runtime.artifact import read_metadata
    from pt2serve.runtime.executor import ExecutorConfig

    if mode not in MODES:
        raise Pt2ServeError(f"unknown --mode {mode!r}: choose {' or '.join(MODES)}")
    # The sweep sets its own step budget per row; a server (--url) has its own runner and pool.
    runner_flags = {"--token-budget": token_budget, "--max-decode-sequences": max_decode_sequences,
                    "--min-prefill-chunk": min_prefill_chunk,
                    "--prefix-cache/--no-prefix-cache": prefix_cache, "--speculate": speculate,
                    "--num-draft-tokens": num_draft_tokens}
    chat_flags = {"--workload": workload, "--turns": turns, "--system-tokens": system_tokens}
    wrong_mode = {
        "sweep": {**chat_flags, "--runs": runs, "--stagger-ms": stagger_ms, "--request-rate": request_rate,
                  "--request-rates": request_rates, "--ttft-target-ms": ttft_target_ms, "--tpot-target-ms": tpot_target_ms, "--url": url,
                  "--model": model, "--prompt-tokens": prompt_tokens, "--reference": reference, **runner_flags},
        "requests": {"--tokens": tokens, "--prefill-chunk": prefill_chunk, "--context": context,
                     "--reference": reference, "--runs": runs},
        "quality": {**chat_flags, "--tokens": tokens, "--prefill-chunk": prefill_chunk, "--context": context,
                    "--stagger-ms": stagger_ms, "--request-rate": request_rate, "--request-rates": request_rates,
                    "--ttft-target-ms": ttft_target_ms, "--tpot-target-ms": tpot_target_ms, "--url": url,
                    "--model": model, "--plot": plot, "--runs": runs, **runner_flags},
    }.get(mode)
    if wrong_mode is None:  # the modes of one measurement each: every optional flag but the ones they take
        every = {**chat_flags, **runner_flags, "--reference": reference, "--tokens": tokens,
                 "--prefill-chunk": prefill_chunk, "--context": context, "--prompt-tokens": prompt_tokens,
                 "--stagger-ms": stagger_ms, "--request-rate": request_rate, "--request-rates": request_rates,
                 "--ttft-target-ms": ttft_target_ms, "--tpot-target-ms": tpot_target_ms, "--url": url,
                 "--model": model, "--plot": plot, "--runs": runs}
        takes = {"profile": {"--tokens"}, "matmuls": {"--tokens"}, "startup": {"--runs", *runner_flags}}[mode]
        wrong_mode = {name: value for name, value in every.items() if name not in takes}
    given = [name for name, value in wrong_mode.items() if value is not None]
    if given:
        raise Pt2ServeError(f"{', '.join(given)} do not apply to --mode {mode}")
    if workload != "chat" and (turns is not None or system_tokens is not None):
        raise Pt2ServeError("--turns and --system-tokens apply to --workload chat only")
    if mode == "quality" and (artifact is None or reference is None):
        raise Pt2ServeError("--mode quality compares two artifacts: give PATH.pt2 and --reference REF.pt2")
    if url is not None:
        in_process = {**runner_flags, "--num-cells": num_cells, "--kv-memory-fraction": kv_memory_fraction,
                      "--device": device, "--no-cuda-graphs": no_cuda_graphs or None,
                      "--deterministic": deterministic or None}
        given = [name for name, value in in_process.items() if value is not None]
        if given:
            raise Pt2ServeError(f"{', '.join(given)} only apply to in-process runs; a server at --url has its own "
                                "(set them on pt2serve serve-artifact)")
    arrivals = {"--stagger-ms": stagger_ms, "--request-rate": request_rate, "--request-rates": request_rates}
    given = [name for name, value in arrivals.items() if value is not None]
    if len(given) > 1:
        raise Pt2ServeError(f"give one of {', '.join(given)}, not both")
    rates = parse_rates(request_rates) if request_rates is not None else None
    if artifact is None and url is None:
        raise Pt2ServeError("give the artifact to benchmark (PATH.pt2), or --url with --mode requests")
    raw = read_metadata(artifact).raw if artifact is not None else None  # a missing or bad artifact fails here
    executor_config = ExecutorConfig(**kv_pool(num_cells, kv_memory_fraction), use_cuda_graphs=not no_cuda_graphs,
                                     deterministic=deterministic)
    budget = step_budget(token_budget, max_decode_sequences, min_prefill_chunk)
    speculating = speculation(speculate, num_draft_tokens)
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
            contexts=parse_contexts(context) if context is not None else SweepOptions.contexts,
            seed=seed, row_timeout=timeout, eager_peer=eager_peer,
        )
        with StatusLine() as status:
            result = run_sweep(artifact, options, device=device, executor_config=executor_config, progress=status)
        title = f"pt2serve bench sweep: {name} on {result.device}"
        console.print(report.sweep_table(result, title))
        document = report.sweep_document(result, str(artifact), raw, flags)
        if plot is not None:
            report.plot_sweep(result, plot, title)
    elif mode == "profile":
        from pt2serve.bench.profile import ProfileOptions, profile_document, profile_tables, run_profile

        options = ProfileOptions(tokens=parse_tokens(tokens) if tokens is not None else None, warmup=warmup,
                                 iters=iters)
        with StatusLine() as status:
            result = run_profile(artifact, options, device=device, executor_config=executor_config, progress=status)
        for part in profile_tables(result, f"pt2serve bench profile: {name} on {result.device}"):
            console.print(part)
        document = profile_document(result, str(artifact), raw, flags)
    elif mode == "matmuls":
        from pt2serve.bench.matmul_floor import matmul_floor_document, matmul_floor_table, run_matmul_floor

        with StatusLine() as status:
            result = run_matmul_floor(artifact, parse_tokens(tokens) if tokens is not None else None, iters=iters,
                                      device=device, progress=status)
        console.print(matmul_floor_table(result, f"pt2serve bench matmuls: {name} on {result.device}"))
        document = matmul_floor_document(result, str(artifact), raw, flags)
    elif mode == "startup":
        from pt2serve.bench.startup import run_startup, startup_document, startup_table

        server_args = _server_args(token_budget=token_budget, max_decode_sequences=max_decode_sequences,
                                   min_prefill_chunk=min_prefill_chunk, speculate=speculate,
                                   num_draft_tokens=num_draft_tokens, num_cells=num_cells,
                                   kv_memory_fraction=kv_memory_fraction, device=device)
        if prefix_cache is not None:
            server_args.append("--prefix-cache" if prefix_cache else "--no-prefix-cache")
        if no_cuda_graphs:
            server_args.append("--no-cuda-graphs")
        with StatusLine() as status:
            result = run_startup(artifact, server_args, runs=runs if runs is not None else DEFAULT_RUNS,
                                 timeout=timeout, progress=status)
        console.print(startup_table(result, f"pt2serve bench startup: {name}"))
        document = startup_document(result, str(artifact), raw, flags)
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
        from pt2serve.runtime.runner import RunnerConfig

        targets = LatencyTargets(
            ttft_ms=ttft_target_ms if ttft_target_ms is not None else LatencyTargets.ttft_ms,
            tpot_ms=tpot_target_ms if tpot_target_ms is not None else LatencyTargets.tpot_ms,
        )
        options = RequestsOptions(
            requests=requests,
            prompt_tokens=prompt_tokens if prompt_tokens is not None else RequestsOptions.prompt_tokens,
            workload=workload or RequestsOptions.workload,
            turns=turns if turns is not None else RequestsOptions.turns,
            system_tokens=system_tokens if system_tokens is not None else RequestsOptions.system_tokens,
            max_new_tokens=max_new_tokens, stagger_ms=stagger_ms or 0.0, request_rate=request_rate, seed=seed,
            url=url, model=model, timeout=timeout, targets=targets,
        )
        target = dict(device=device, executor_config=executor_config,
                      runner_config=RunnerConfig(**budget, **prefix_reuse(prefix_cache), **speculating))
        with StatusLine() as status:
            if rates is None:
                from pt2serve.bench.requests_mode import run_requests

                result = run_requests(artifact, options, progress=status, **target)
                table, to_document, draw = report.requests_table, report.requests_document, report.plot_requests
            else:
                from pt2serve.bench.rates import run_request_rates

                result = run_request_rates(artifact, options, rates, progress=status, **target)
                table, to_document, draw = report.rates_table, report.rates_document, report.plot_rates
        title = (f"pt2serve bench requests: {name}" + ("" if url is not None else " in process")
                 + (f" on {result.device}" if result.device else ""))
        console.print(table(result, title))
        document = to_document(result, str(artifact) if artifact else None, raw, flags)
        if plot is not None:
            draw(result, plot, title)
    if json_path is not None:
        report.write_json(document, json_path)
        console.print(f"wrote {json_path}")
    if plot is not None:
        console.print(f"wrote {plot}")


def _server_args(**given) -> list[str]:
    """serve-artifact's flags for the values given (None: left to the server's default)."""
    args = []
    for name, value in given.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args
