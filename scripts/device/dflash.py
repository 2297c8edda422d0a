"""DFlash speculation at batch 1: output tokens/s as a function of the accepted length, beside plain decoding and
the weight-read floor.

Usage: python scripts/device/dflash.py ARTIFACT.pt2 [--seconds S] [--num-draft-tokens K] [--json PATH]

The artifact holds a DFlash draft (export --draft); with random weights its drafts are almost never accepted, so
acceptance is set by an oracle: a drafter that runs the artifact's real draft (its whole device cost is paid)
but proposes the known greedy continuation, wrong at draft index a, so that every verifying step accepts
exactly a drafts and emits a + 1 tokens. Rows: plain decode; the real draft's own proposals; the oracle at
a = 0, 1, 3, 7, ... up to k (all accepted). Each row is one request of NEW_TOKENS tokens after a short prompt;
its step cost in the run is the median interval between two steps' ids reaching the host (after the prompt's
step), beside plain decoding's (the bar for a verifying step at k = 15: 1.15x).
Its verifying steps are counted: a request whose drafts all fail decodes without drafts for a while (scheduler.py),
so rows with nothing accepted run mostly plain steps.
The floor: the weights read per step (target alone for plain decode; target and draft for a verifying step)
over the measured copy bandwidth. Prints one markdown table last; rows past --seconds are left out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from pt2serve.bench.roofline import measure_limits
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.drafter import DraftRequest
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.runner import Runner, RunnerConfig

PROMPT_TOKENS = 32
NEW_TOKENS = 128
NUM_CELLS = 4096  # per executor: two share the device


class OracleDrafter:
    """The artifact's DFlash draft runs (its cost is real), then its proposals are replaced by the known greedy
    continuation, corrupted at index `accept` (none corrupted when accept >= the drafts asked for). A device
    drafter, as the real draft is: its proposals go up without a wait, and the host never reads them back."""

    def __init__(self, dflash, truth: list[int], accept: int, vocab_size: int) -> None:
        self.dflash = dflash
        self.block_size = dflash.block_size  # the runner bounds --num-draft-tokens by it
        self.accept = accept
        # The known continuation on the device, corrupted at `accept` past each position (prompt + greedy output,
        # then room for a block past its end): a proposal is a gather at the pending token's position, which is
        # known on the device alone when its request follows a verify still in flight.
        padded = np.array(truth + [0] * self.block_size, dtype=np.int64)
        self.truth = torch.from_numpy(padded).to(dflash.artifact.device)
        self.vocab_size = vocab_size

    def draft_on_device(self, requests: list[DraftRequest], last_tokens: torch.Tensor,
                        shortfall: torch.Tensor | None) -> torch.Tensor:
        real = self.dflash.draft_on_device(requests, last_tokens, shortfall)
        lengths = np.array([len(r.cells) for r in requests], dtype=np.int64)
        positions = torch.from_numpy(lengths)  # of each pending token
        if real.device.type == "cuda":  # (from pinned memory: a pageable copy would wait for the stream)
            positions = positions.pin_memory().to(real.device, non_blocking=True)
        if shortfall is not None:
            positions = positions + shortfall
        offsets = torch.arange(1, real.shape[1] + 1, device=real.device)
        index = (positions[:, None] + offsets[None, :]).clamp(max=self.truth.shape[0] - 1)
        drafts = self.truth[index]
        if self.accept < real.shape[1]:
            drafts[:, self.accept] = (drafts[:, self.accept] + 1) % self.vocab_size
        return drafts


def timed(executor: Executor, prompt: list[int], config: RunnerConfig, drafter=None) -> dict:
    runner = Runner(executor, None, config, drafter)
    try:
        runner.generate(prompt[:8], max_new_tokens=4, ignore_eos=True)  # warm up
        runner.clear_prefix_cache()
        before = runner.scheduler.num_accepted_tokens, runner.scheduler.num_verify_steps, runner.scheduler.step
        started = time.perf_counter()
        completion = runner.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        seconds = time.perf_counter() - started
        accepted = runner.scheduler.num_accepted_tokens - before[0]
        steps = runner.scheduler.num_verify_steps - before[1]
        # A step's cost in the run: the interval between two steps' ids reaching the host, after the prompt's.
        decoding = [r for r in runner.step_history if r.step > before[2] + 1]
    finally:
        runner.close()
    intervals = [b.ended - a.ended for a, b in zip(decoding, decoding[1:])]
    return {"tokens": completion.token_ids, "tokens_per_second": len(completion.token_ids) / seconds,
            "seconds": seconds, "verify_steps": steps,
            "tokens_per_verify_step": accepted / steps + 1 if steps else None,
            "step_ms": 1000 * statistics.median(intervals) if intervals else None}


def check_unchanged(run: dict, plain: dict) -> None:
    if run["tokens"] != plain["tokens"]:
        pairs = enumerate(zip(run["tokens"], plain["tokens"]))
        first = next((i for i, (a, b) in pairs if a != b), min(len(run["tokens"]), len(plain["tokens"])))
        raise SystemExit(f"speculation changed the greedy output from token {first} on. With random weights in "
                         "bf16, near-tied logits flip between step widths: use a preset with designed weights "
                         "(toy-greedy, toy-greedy-8b), or an fp32 export")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--seconds", type=float, default=170.0)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="default: block_size - 1, within "
                        "the widest static width")
    parser.add_argument("--json")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.seconds
    artifact = load_artifact(args.artifact)
    meta = artifact.metadata
    # Plain decoding on an executor without the draft: with one, every forward also writes the draft context.
    plain_executor = Executor(artifact, ExecutorConfig(num_cells=NUM_CELLS))
    executor = Executor(artifact, ExecutorConfig(num_cells=NUM_CELLS, draft=True))
    block = meta.draft["block_size"]
    k = args.num_draft_tokens or min(block - 1, max(meta.forward_sizes) - 1)
    rng = random.Random(0)
    prompt = [rng.randrange(meta.vocab_size) for _ in range(PROMPT_TOKENS)]

    # The floor: every weight read once per step.
    bandwidth = measure_limits(executor.device, meta.raw["dtype"]).memory_bandwidth
    draft_bytes = sum(t.numel() * t.element_size() for name, t in artifact.weights.items() if name.startswith("draft."))
    target_bytes = artifact.report.weight_bytes - draft_bytes
    plain_floor_ms, verify_floor_ms = 1000 * target_bytes / bandwidth, 1000 * (target_bytes + draft_bytes) / bandwidth

    plain = timed(plain_executor, prompt, RunnerConfig(token_budget=64))
    truth = prompt + plain["tokens"]
    rows = [("plain decode", plain, 1, plain_floor_ms)]
    speculating = RunnerConfig(token_budget=64, num_draft_tokens=k)
    if time.monotonic() < deadline:
        real = timed(executor, prompt, speculating, executor.draft)
        check_unchanged(real, plain)
        rows.append(("DFlash, the draft's own proposals", real, real["tokens_per_verify_step"] or 1, verify_floor_ms))
    for accept in sorted({0, 1, 3, 7, k} & set(range(k + 1))):
        if time.monotonic() > deadline:
            break
        oracle = OracleDrafter(executor.draft, truth, accept, meta.vocab_size)
        run = timed(executor, prompt, speculating, oracle)
        check_unchanged(run, plain)
        rows.append((f"DFlash, oracle accepts {accept} of {k}", run, accept + 1, verify_floor_ms))

    if args.json:
        with open(args.json, "w") as file:
            json.dump({"bandwidth": bandwidth, "target_bytes": target_bytes, "draft_bytes": draft_bytes,
                       "rows": [{"name": name, "tokens_per_step": per_step, "floor_ms": floor,
                                 **{key: value for key, value in run.items() if key != "tokens"}}
                                for name, run, per_step, floor in rows]}, file, indent=1)
    print(f"total seconds: {time.monotonic() - started:.0f}; k = {k} drafts (block {block}); weights: target "
          f"{target_bytes / 1e6:.1f} MB, draft {draft_bytes / 1e6:.1f} MB; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"| batch 1, {executor.device} | tokens per step | verifying steps | ms per step in the run (x plain) "
          "| tok/s | weight-read floor tok/s | of floor |")
    print("|---|---|---|---|---|---|---|")
    for name, run, per_step, floor_ms in rows:
        floor_tps = 1000 * per_step / floor_ms
        step = f"{run['step_ms']:.2f} ({run['step_ms'] / plain['step_ms']:.2f}x)" if run["step_ms"] else "-"
        print(f"| {name} | {per_step:.2f} | {run['verify_steps']} | {step} | {run['tokens_per_second']:,.1f} | "
              f"{floor_tps:,.0f} | {run['tokens_per_second'] / floor_tps:.0%} |")


if __name__ == "__main__":
    main()
