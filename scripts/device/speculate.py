"""Speculative decoding on an artifact: what a verifying step costs, and what n-gram drafts buy on text that repeats.

Usage: python scripts/device/speculate.py ARTIFACT.pt2 [--seconds S] [--num-draft-tokens K] [--json PATH]

1. Verify cost: at batch 1 and 32, the median time of a step in which every sequence runs its pending token and
   k drafts (k = 3, 7, 15 and --num-draft-tokens; greedy acceptance on the device included), over the time of a plain decode step.
2. n-gram drafts: each sequence's prompt is the model's own greedy continuation of a random seed, PROMPT_TOKENS
   long, and it generates NEW_TOKENS more: the text the model writes itself, which repeats wherever its greedy
   text loops (a small random model's loops soon; random weights of the 8B's size never repeat themselves, and
   do not continue a pasted pattern either: on them this measures what speculation costs when it finds
   nothing; toy-greedy-8b has the 8B's cost and text that repeats, toy-copy-8b text that copies its own context
   through attention, as retrieval and editing traffic does). Output tokens/s with
   --speculate ngram against none, at batch 1 and 32, the mean tokens a verifying step emitted, the steps
   launched and (GPU) the share of the time the device was busy: what the runner adds between steps.
3. The decode phase of each n-gram run (every request has its first token): a step's cost in the run, the
   interval between two steps' ids reaching the host (and its device time), against the verify step of the
   same k measured alone at the runs' mean context (every sequence verifying k drafts): within 10% is the bar.
Prints one markdown table last. Parts that would run past --seconds are left out (the table says so).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.drafter import Speculation
from pt2serve.runtime.executor import Executor
from pt2serve.runtime.runner import Runner, RunnerConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk

BATCHES = (1, 32)
DRAFT_COUNTS = (3, 7, 15)
CONTEXT = 64  # tokens each sequence holds before the timed steps
TIMED_STEPS = 12
PROMPT_TOKENS = 256
NEW_TOKENS = 128
RUN_CONTEXT = PROMPT_TOKENS + NEW_TOKENS // 2  # an n-gram run's mean context in its decode phase


def step_ms(executor: Executor, sequences: list, num_drafts: int, context: int) -> tuple[float, str]:
    """Median time of a step of 1 + num_drafts tokens per sequence (always the same positions), and its method."""
    greedy = SamplingParams()
    times, method = [], ""
    for _ in range(TIMED_STEPS + 2):
        chunks = [Chunk(cells, (7,) + (11,) * num_drafts, context, greedy, drafts=(11,) * num_drafts)
                  if num_drafts else Chunk(cells, (7,), context, greedy) for cells in sequences]
        started = time.perf_counter()
        result = executor.step(chunks)  # ends with the ids on the host: a full sync
        times.append(time.perf_counter() - started)
        method = result.calls[0].method
    times = sorted(times[2:])
    return 1000 * times[len(times) // 2], method


def verify_costs(executor: Executor, deadline: float, batches: tuple[int, ...], draft_counts: tuple[int, ...],
                 context: int = CONTEXT) -> dict:
    """(batch, drafts) -> step_ms, every sequence holding `context` tokens before the timed steps."""
    costs = {}
    for batch in batches:
        sequences = [executor.allocator.allocate(context + max(draft_counts) + 1) for _ in range(batch)]
        prompt = tuple(1 + i % 250 for i in range(context))  # ids every preset has (toy-greedy's vocabulary: 258)
        executor.step([Chunk(cells, prompt, 0, None) for cells in sequences])
        for num_drafts in draft_counts:
            if time.monotonic() > deadline:
                break
            costs[(batch, num_drafts)] = step_ms(executor, sequences, num_drafts, context)
        for cells in sequences:
            executor.allocator.free(cells)
    return costs


def own_text_prompts(executor: Executor, batch: int, seed: int) -> list[list[int]]:
    """Each prompt: a random seed of 8 ids and the model's greedy continuation of it, PROMPT_TOKENS in all."""
    rng = random.Random(seed)
    # Byte ids: toy-greedy-8b designs only those (the others embed to zero), any other model takes them too.
    seeds = [[rng.randrange(256) for _ in range(8)] for _ in range(batch)]
    runner = Runner(executor, None, RunnerConfig())
    try:
        handles = [runner.submit(s, max_new_tokens=PROMPT_TOKENS - len(s), ignore_eos=True) for s in seeds]
        return [s + h.result().token_ids for s, h in zip(seeds, handles)]
    finally:
        runner.close()


def generate(executor: Executor, prompts: list[list[int]], config: RunnerConfig) -> dict:
    runner = Runner(executor, None, config)
    first_tokens: dict[int, float] = {}  # prompt index -> when its first event came (on the engine thread)

    try:
        runner.generate(prompts[0][:8], max_new_tokens=4, ignore_eos=True)  # warm up
        runner.clear_prefix_cache()
        before = runner.scheduler.num_accepted_tokens, runner.scheduler.num_verify_steps, runner.scheduler.step
        started = time.perf_counter()
        handles = [runner.submit(p, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                 on_event=lambda event, i=i: first_tokens.setdefault(i, time.perf_counter()))
                   for i, p in enumerate(prompts)]
        tokens = sum(len(h.result().token_ids) for h in handles)
        seconds = time.perf_counter() - started
        accepted = runner.scheduler.num_accepted_tokens - before[0]
        verifies = runner.scheduler.num_verify_steps - before[1]  # one per speculating request and step
        records = [r for r in runner.step_history if r.step > before[2]]
    finally:
        runner.close()
    # The steps launched, prefill included, and the share of the time the device spent on them (GPU only): beside
    # the verify cost above, what the runner adds between steps.
    device = [r.device_seconds for r in records if r.device_seconds is not None]
    # The decode phase: every request has its first token, so every step is decodes (and verifies) alone. A
    # step's cost in the run is the interval between two steps' ids reaching the host, beside its device time.
    decoding = [r for r in records if r.ended > max(first_tokens.values())]
    intervals = [b.ended - a.ended for a, b in zip(decoding, decoding[1:])]
    decode_device = [r.device_seconds for r in decoding if r.device_seconds is not None]
    return {"tokens_per_second": tokens / seconds, "seconds": seconds,
            "tokens_per_verify_step": accepted / verifies + 1 if verifies else None, "verify_steps": verifies,
            "steps": len(records), "device_share": sum(device) / seconds if device else None,
            "decode_steps": len(decoding), "decode_step_ms": 1000 * statistics.median(intervals) if intervals else None,
            "decode_device_ms": 1000 * statistics.median(decode_device) if decode_device else None,
            "decode_tokens_per_step": sum(r.num_tokens for r in decoding) / len(decoding) if decoding else None}



def ngram_runs(executor: Executor, num_draft_tokens: int, deadline: float) -> dict:
    runs = {}
    for batch in BATCHES:
        if time.monotonic() > deadline:
            break
        prompts = own_text_prompts(executor, batch, seed=batch)
        for name, config in (("none", RunnerConfig()),
                             ("ngram", RunnerConfig(speculate=Speculation.NGRAM, num_draft_tokens=num_draft_tokens))):
            if time.monotonic() > deadline:
                break
            runs[(batch, name)] = generate(executor, prompts, config)
    return runs


def table(costs: dict, alone_costs: dict, runs: dict, num_draft_tokens: int, device: str) -> str:
    lines = [f"| {device} | batch 1 | batch 32 |", "|---|---|---|"]
    for num_drafts in (0, *sorted({*DRAFT_COUNTS, num_draft_tokens})):
        label = "plain decode step" if not num_drafts else f"verify step, k = {num_drafts}"
        cells = []
        for batch in BATCHES:
            if (batch, num_drafts) not in costs:
                cells.append("(not run)")
                continue
            ms, method = costs[(batch, num_drafts)]
            base = costs[(batch, 0)][0]
            cells.append(f"{ms:.2f} ms ({method})" if not num_drafts else f"{ms / base:.2f}x, {ms:.2f} ms ({method})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for batch in BATCHES:
        plain, ngram = runs.get((batch, "none")), runs.get((batch, "ngram"))
        if plain is None or ngram is None:
            cells.append("(not run)")
            continue
        per_step = ngram["tokens_per_verify_step"]
        cells.append(f"{ngram['tokens_per_second']:,.0f} vs {plain['tokens_per_second']:,.0f} tok/s "
                     f"({ngram['tokens_per_second'] / plain['tokens_per_second']:.2f}x), "
                     + (f"{per_step:.2f} tokens per verify step" if per_step else "no drafts")
                     + f"; {ngram['steps']} vs {plain['steps']} steps" + _device_shares(ngram, plain))
    lines.append(f"| n-gram k = {num_draft_tokens} vs none, the model's own greedy text | " + " | ".join(cells) + " |")
    cells = []
    for batch in BATCHES:
        ngram, alone = runs.get((batch, "ngram")), alone_costs.get((batch, num_draft_tokens))
        if ngram is None or ngram["decode_step_ms"] is None:
            cells.append("(not run)")
            continue
        cell = (f"{ngram['decode_step_ms']:.2f} ms per step ({ngram['decode_steps']} steps, "
                f"{ngram['decode_tokens_per_step']:.0f} tokens each)")
        if ngram["decode_device_ms"] is not None:
            cell += f", device {ngram['decode_device_ms']:.2f} ms"
        if alone is not None:
            cell += f"; alone: {alone[0]:.2f} ms ({ngram['decode_step_ms'] / alone[0]:.2f}x)"
        cells.append(cell)
    lines.append(f"| n-gram decode phase: a step in the run (ids to ids) vs a verify step alone at context "
                 f"{RUN_CONTEXT} | "
                 + " | ".join(cells) + " |")
    return "\n".join(lines)



def _device_shares(ngram: dict, plain: dict) -> str:
    if ngram["device_share"] is None or plain["device_share"] is None:
        return ""
    return f", the device busy {ngram['device_share']:.0%} vs {plain['device_share']:.0%} of the time"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--seconds", type=float, default=170.0)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    started = time.monotonic()
    executor = Executor(load_artifact(args.artifact))
    # Verify costs first (a few seconds), then the generation runs with what is left.
    costs = verify_costs(executor, started + args.seconds / 3, BATCHES,
                         (0, *sorted({*DRAFT_COUNTS, args.num_draft_tokens})))
    runs = ngram_runs(executor, args.num_draft_tokens, started + args.seconds * 0.6)
    # The n-gram runs' verify step alone at their mean context: what their decode-phase steps compare with.
    alone = verify_costs(executor, started + args.seconds * 0.7, BATCHES, (args.num_draft_tokens,), RUN_CONTEXT)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"verify_ms": {f"batch{b}_k{k}": v for (b, k), v in costs.items()},
                       "verify_ms_at_run_context": {f"batch{b}_k{k}": v for (b, k), v in alone.items()},
                       "ngram": {f"batch{b}_{name}": v for (b, name), v in runs.items()}}, file, indent=1)
    print(f"total seconds: {time.monotonic() - started:.0f}")
    print(table(costs, alone, runs, args.num_draft_tokens, str(executor.device)))


if __name__ == "__main__":
    main()
