"""The random workload, and what every workload of --mode requests shares: when requests arrive, and that
they fit the artifact's context.

Arrivals: request i (with --workload chat, conversation i) is submitted at i x stagger, or (with a request
rate R) at the times of a Poisson process: exponential gaps of mean 1/R drawn from a seeded generator, the
first at 0. The random workload's prompts are --prompt-tokens random token ids each, from their own seed.
"""

from __future__ import annotations

import numpy as np

from pt2serve.bench.options import RequestsOptions
from pt2serve.errors import Pt2ServeError


def arrival_times(options: RequestsOptions) -> list[float]:
    if options.request_rate is not None:
        rng = np.random.default_rng(options.seed)
        gaps = rng.exponential(1.0 / options.request_rate, options.requests)
        gaps[0] = 0.0
        return np.cumsum(gaps).tolist()
    return [i * options.stagger_ms / 1e3 for i in range(options.requests)]


def make_prompts(options: RequestsOptions, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(options.seed + 1 if not options.prompt_set else [options.seed + 1, options.prompt_set])
    return [rng.integers(0, vocab_size, options.prompt_tokens).tolist() for _ in range(options.requests)]


def check_lengths(options: RequestsOptions, max_context: int) -> None:
    if options.workload == "chat":
        total = options.system_tokens + options.turns * (options.prompt_tokens + options.max_new_tokens)
        if total > max_context:
            raise Pt2ServeError(
                f"--system-tokens {options.system_tokens} + --turns {options.turns} x (--prompt-tokens "
                f"{options.prompt_tokens} + --max-new-tokens {options.max_new_tokens}) = {total} exceeds the "
                f"artifact's max context ({max_context}), before the chat template adds its own"
            )
        return
    total = options.prompt_tokens + options.max_new_tokens
    if total > max_context:
        raise Pt2ServeError(
            f"--prompt-tokens {options.prompt_tokens} + --max-new-tokens {options.max_new_tokens} = {total} exceeds "
            f"the artifact's max context ({max_context})"
        )
