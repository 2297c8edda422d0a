"""The runtime's command-line flags that serve-artifact, bench and generate share: the step budget, the KV
pool, the prefix cache and speculative decoding.

Each flag defaults to None, which leaves the field out of RunnerConfig / ExecutorConfig so the runtime's
own default applies; the defaults live there, and the help only says in words what they are. A value a
user can get wrong is refused here with the flag's name, before anything loads.
"""

from __future__ import annotations

from typing import Any

import typer

from pt2serve.errors import Pt2ServeError


def token_budget_option() -> Any:
    return typer.Option(
        None, help="Tokens one runner step may carry, decodes and prefill chunks together (default: the runner's "
        "budget, 2,048 or the artifact's max step tokens if fewer, so prompts prefill in wide chunks while every "
        "running decode still gets its token each step). Wider steps amortise the weight reads over more tokens; "
        "narrower ones keep each decode step short."
    )


def max_decode_sequences_option() -> Any:
    return typer.Option(
        None, help="Running sequences that get a decode token in one step (default: the runner's cap, the token "
        "budget). When prompts wait, the scheduler also keeps room for a prefill chunk."
    )


def min_prefill_chunk_option() -> Any:
    return typer.Option(
        None, help="A prompt is not cut into prefill chunks shorter than this, but for its last piece (default: "
        "the artifact's, as exported with --min-prefill-chunk)."
    )


def num_cells_option() -> Any:
    return typer.Option(
        None, help="KV pool size in cells, one per token of context, up to the artifact's max_cells (default: as "
        "many as --kv-memory-fraction of the free memory holds; on the CPU at most 65,536 tokens or one "
        "max-context sequence). The load line says what the pool got, in tokens and GB."
    )


def kv_memory_fraction_option() -> Any:
    return typer.Option(
        None, help="The share of the device memory left free after the weights load (on the CPU: of the host "
        "memory available) that the KV pool fills when --num-cells is not given (default: the executor's share, "
        "0.6; the rest holds CUDA graphs and step activations)."
    )


def prefix_cache_option() -> Any:
    return typer.Option(
        None, "--prefix-cache/--no-prefix-cache", help="Start every request from the longest prefix of its tokens "
        "whose KV cells are still cached, from any earlier request (default: on; cached cells are freed as soon "
        "as a step needs them, so the cache costs no pool space)."
    )


def prefix_reuse(enabled: bool | None, session_pin_seconds: float | None = None) -> dict[str, Any]:
    """The RunnerConfig fields --prefix-cache and --session-pin-seconds set (the ones given), checked."""
    if session_pin_seconds is not None and not 0 <= session_pin_seconds < float("inf"):
        raise Pt2ServeError(f"--session-pin-seconds must be a number of seconds >= 0, got {session_pin_seconds}")
    given = {"prefix_cache": enabled, "session_pin_seconds": session_pin_seconds}
    return {name: value for name, value in given.items() if value is not None}


def step_budget(token_budget: int | None, max_decode_sequences: int | None,
                min_prefill_chunk: int | None) -> dict[str, int]:
    """The RunnerConfig fields the flags set (the ones given), each checked."""
    given = {"token_budget": token_budget, "max_decode_sequences": max_decode_sequences,
             "min_prefill_chunk": min_prefill_chunk}
    for name, value in given.items():
        if value is not None and value < 1:
            raise Pt2ServeError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return {name: value for name, value in given.items() if value is not None}


def kv_pool(num_cells: int | None, kv_memory_fraction: float | None) -> dict[str, Any]:
    """The ExecutorConfig fields the flags set (the ones given); ExecutorConfig checks the fraction."""
    if num_cells is not None and num_cells < 2:
        raise Pt2ServeError(f"--num-cells must be at least 2 (a cell for a token and the scratch cell), got {num_cells}")
    given = {"num_cells": num_cells, "kv_memory_fraction": kv_memory_fraction}
    return {name: value for name, value in given.items() if value is not None}


def deterministic_option() -> Any:
    return typer.Option(
        False, "--deterministic", help="Require an artifact exported with --deterministic (refused otherwise), "
        "whose every row's logits are the same bits whatever shares its step, whichever method runs it, however "
        "its prompt is chunked and whether its prefix comes from the cache; seeded sampling then repeats exactly. "
        "Such an artifact behaves so without the flag too: the flag makes it a requirement."
    )


SPECULATION_METHODS = ("none", "ngram", "dflash")


def speculate_option() -> Any:
    return typer.Option(
        None, help="Speculative decoding: none; ngram (drafts from the request's own prompt and output, where its "
        "last tokens occurred before); or dflash (the artifact's DFlash draft model, exported with --draft). Each "
        "step verifies a sequence's drafts with its pending token, so it may emit several tokens; greedy output is unchanged and sampled output keeps its distribution. Requests with "
        "structured output, logprobs, penalties, logit_bias, min_tokens or n > 1 decode plainly (default: none)."
    )


def num_draft_tokens_option() -> Any:
    return typer.Option(
        None, help="With --speculate: tokens drafted and verified per sequence and step, at most the artifact's widest "
        "static width minus one (and, for dflash, the draft's block_size minus one) (default: the runner's, 4)."
    )


def speculation(speculate: str | None, num_draft_tokens: int | None) -> dict[str, Any]:
    """The RunnerConfig fields --speculate and --num-draft-tokens set (the ones given), checked."""
    from pt2serve.runtime.drafter import Speculation

    if speculate is not None and speculate not in SPECULATION_METHODS:
        raise Pt2ServeError(f"--speculate must be one of {', '.join(SPECULATION_METHODS)}, got {speculate!r}")
    if num_draft_tokens is not None:
        if speculate in (None, "none"):
            raise Pt2ServeError("--num-draft-tokens applies with --speculate ngram or dflash only")
        if num_draft_tokens < 1:
            raise Pt2ServeError(f"--num-draft-tokens must be at least 1, got {num_draft_tokens}")
    given: dict[str, Any] = {"num_draft_tokens": num_draft_tokens}
    if speculate is not None:
        given["speculate"] = Speculation(speculate)
    return {name: value for name, value in given.items() if value is not None}
