"""Speculating requests in the engine's order, on plain data: which steps kept one in flight, and the host's work.

Usage: python scripts/speculation_steps.py [--batch 1,32] [--num-draft-tokens 4] [--new-tokens 128]

The scheduler runs as the runner drives it (plan and launch step n+1, then commit step n) with n-gram drafts, on
text that copies its context (toy-copy's greedy tokens: each the token RECALL_LAG back), so drafts are right
nearly always. A stand-in device answers each step at once with the tokens toy-copy emits. Per batch: steps
planned, how many were launched while the previous one was still in flight (the others wait for the host's
whole plan, drafting and commit with the device idle), speculating requests per step, and the host's
microseconds per step to plan (drafting included) and to commit. Prompts: PROMPT_TOKENS of the text.
"""

from __future__ import annotations

import argparse
import random
import time

from pt2serve.model.presets import toy_copy_continuation
from pt2serve.runtime.cells import CellAllocator
from pt2serve.runtime.drafter import NgramDrafter
from pt2serve.runtime.request import Request, RequestSpec
from pt2serve.runtime.sampling import RequestRandom
from pt2serve.runtime.scheduler import Scheduler, SchedulerConfig, StepPlan

PROMPT_TOKENS = 256


def emitted(request: Request, chunk) -> tuple[int, ...]:
    """What toy-copy emits for a verifying chunk: its drafts while they are the model's tokens, then one more."""
    history = list(request.tokens)
    out = []
    for draft in chunk.drafts:
        (token,) = toy_copy_continuation(history, 1)
        out.append(token)
        if token != draft:
            return tuple(out)
        history.append(token)
    return tuple(out) + tuple(toy_copy_continuation(history, 1))


def device_answer(scheduler: Scheduler, plan: StepPlan) -> tuple[tuple, tuple]:
    """The step's sampled tokens and verified tokens, as the executor's result gives them."""
    tokens, verified = [], []
    for chunk in plan.chunks:
        request = scheduler.requests.get(chunk.request_id)
        sampled = request is not None and chunk.samples
        tokens.append(toy_copy_continuation(request.tokens, 1)[0] if sampled and not chunk.drafts else None)
        verified.append(emitted(request, chunk) if sampled and chunk.drafts else None)
    return tuple(tokens), tuple(verified)


def run(batch: int, num_draft_tokens: int, new_tokens: int) -> dict:
    rng = random.Random(batch)
    scheduler = Scheduler(SchedulerConfig(token_budget=2048, max_decode_sequences=2048, max_context=4096),
                          CellAllocator(batch * (PROMPT_TOKENS + new_tokens + 64) + 64), NgramDrafter())
    for request_id in range(1, batch + 1):
        seed = [rng.randrange(256) for _ in range(8)]
        prompt = tuple(seed + toy_copy_continuation(seed, PROMPT_TOKENS - len(seed)))
        scheduler.add(Request(request_id, RequestSpec(prompt, new_tokens, num_draft_tokens=num_draft_tokens),
                              list(prompt), RequestRandom(0)))
    in_flight, steps, overlapped, verifying, plan_s, commit_s = None, 0, 0, [], 0.0, 0.0
    while scheduler.has_work():
        started = time.perf_counter()
        plan = scheduler.plan()
        plan_s += time.perf_counter() - started
        if plan.chunks:
            steps += 1
            overlapped += in_flight is not None
            verifying.append(sum(1 for c in plan.chunks if c.drafts))
        if in_flight is not None:
            answer = device_answer(scheduler, in_flight)
            started = time.perf_counter()
            scheduler.commit(in_flight, *answer)
            commit_s += time.perf_counter() - started
        in_flight = plan if plan.chunks else None
    decode_steps = [v for v in verifying if v]
    return {"steps": steps, "overlapped": overlapped, "verify_steps": scheduler.num_verify_steps,
            "tokens_per_verify": scheduler.num_accepted_tokens / max(1, scheduler.num_verify_steps) + 1,
            "verifying_per_step": sum(decode_steps) / max(1, len(decode_steps)),
            "plan_us": 1e6 * plan_s / max(1, steps), "commit_us": 1e6 * commit_s / max(1, steps)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    print("| batch | steps | launched with one in flight | verifying chunks | tokens per verify | speculating "
          "requests per step with any | host us per step: plan / commit |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        r = run(batch, args.num_draft_tokens, args.new_tokens)
        print(f"| {batch} | {r['steps']} | {r['overlapped']} | {r['verify_steps']} | {r['tokens_per_verify']:.2f} | "
              f"{r['verifying_per_step']:.1f} | {r['plan_us']:.0f} / {r['commit_us']:.0f} |")


if __name__ == "__main__":
    main()
