"""On a GPU: the cell-attention kernels' speed, then their launch configs, one knob at a time from the defaults.

Usage: python scripts/device/attention_tune.py [--quick] [--speed-only] [--only TEXT]
1. Speed at the defaults: each case replayed in a CUDA graph (as the runtime runs static widths), next to the
   bytes of K/V it must read over the measured copy bandwidth, and to the masked path where that fits in memory
   (--quick leaves the masked path out).
2. Launch configs (--speed-only leaves them out): static (decode-sized) cases vary the KV block, warps, stages,
   split minimum and split count (e4m3 cells too); dynamic (prefill-sized) cases vary the query and KV tiles,
   warps and stages. --only TEXT: only the cases of this part whose names hold TEXT (e.g. "fp8").
Each time is one call inside a CUDA graph of 16 calls (as a step's layers run), llama-3.1-8b head shapes, bf16.
A table per part last. Correctness at these shapes: tests/test_cuda_kernels.py (marked cuda).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

from pt2serve.bench.roofline import measure_limits
from pt2serve.kernels import cell_attention as ops
from pt2serve.kernels.graph_timing import graph_replay_ms

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEVICE = "cuda"


def random_step(seed: int, chunks, num_cells: int, dtype):
    """(q, k_pool, v_pool, positions, token_seq, query_indptr, seq_indptr, seq_cells) for (before, count) chunks:
    the operator's inputs but the block table, which depends on the launch config (see `runner`)."""
    rng = np.random.default_rng(seed)
    order = torch.from_numpy(rng.permutation(np.arange(1, num_cells)))
    taken, seq_cells, indptr, positions, token_seq = 0, [], [0], [], []
    for seq, (before, count) in enumerate(chunks):
        length = before + count
        seq_cells.append(order[taken:taken + length])
        taken += length
        indptr.append(indptr[-1] + length)
        positions.append(torch.arange(before, length))
        token_seq.append(torch.full((count,), seq))
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    num_tokens = sum(count for _, count in chunks)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, device=DEVICE, generator=generator, dtype=dtype)
    k = torch.randn(num_cells, KV_HEADS, HEAD_DIM, device=DEVICE, generator=generator, dtype=dtype)
    v = torch.randn(num_cells, KV_HEADS, HEAD_DIM, device=DEVICE, generator=generator, dtype=dtype)
    token_seq = torch.cat(token_seq).to(DEVICE)
    seq_indptr = torch.tensor(indptr, device=DEVICE)
    query_indptr = ops.query_indptr(token_seq, len(chunks))
    return q, k, v, torch.cat(positions).to(DEVICE), token_seq, query_indptr, seq_indptr, torch.cat(seq_cells).to(DEVICE)


def config_for(step, static: bool, fp8: bool) -> ops.LaunchConfig:
    q, _, _, _, _, _, seq_indptr, _ = step
    return ops.LaunchConfig.for_call(q.shape[0] if static else None, seq_indptr.shape[0] - 1, HEADS, KV_HEADS, fp8)


def runner(step, config: ops.LaunchConfig, scales=(None, None)):
    """A call of the operator's kernels on `step` with `config`, its block table built once (as per step);
    `scales`: an FP8 pool's (k_scale, v_scale)."""
    q, _, _, _, _, query_indptr, seq_indptr, _ = step
    block_seq_end = ops.block_sequence_ends(query_indptr, config.num_blocks(q.shape[0], seq_indptr.shape[0] - 1), config.block_q)
    return lambda: ops.launch_cell_attention(*step, block_seq_end, config, *scales)


def with_fp8_cells(step):
    """The step with its pools in e4m3 (scale 1 per KV head): the operator's FP8-cell path."""
    q, k, v, *rest = step
    scale = torch.ones(KV_HEADS, device=DEVICE)
    return (q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), *rest), (scale, scale)


def graph_ms(fn, iters: int = 20, calls: int = 16) -> float:
    """Median ms of one `fn`, `calls` of them captured back to back in a CUDA graph (as a step's layers run)."""
    return graph_replay_ms(lambda: [fn() for _ in range(calls)], iters) / calls


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write), measured as the bench measures it."""
    return measure_limits(DEVICE, "bf16").memory_bandwidth


SPEED = {  # name: (chunks, static call site?)
    "T=1 ctx 64": ([(63, 1)], True),
    "T=1 ctx 4096": ([(4095, 1)], True),
    "T=32 ctx 64": ([(63, 1)] * 32, True),
    "T=64 ctx 64": ([(63, 1)] * 64, True),
    "T=64 ctx 4096": ([(4095, 1)] * 64, True),
    "T=32 ctx 4096": ([(4095, 1)] * 32, True),
    "T=32 ctx 4096 fp8 cells": ([(4095, 1)] * 32, True),
    "T=64 ctx 4096 fp8 cells": ([(4095, 1)] * 64, True),
    "T=2048 chunk after 12k": ([(12288, 2048)], False),
    "T=4096 prefill": ([(0, 4096)], False),
}


def speed(bandwidth: float, quick: bool) -> None:
    """The defaults' time per case, against the KV read floor and the masked path."""
    rows = []
    for name, (chunks, static) in SPEED.items():
        num_cells = sum(b + c for b, c in chunks) + 16
        step = random_step(3, chunks, num_cells, torch.bfloat16)
        fp8 = name.endswith("fp8 cells")
        config = config_for(step, static, fp8)
        step, scales = with_fp8_cells(step) if fp8 else (step, (None, None))
        kernel_ms = graph_ms(runner(step, config, scales))
        kv_bytes = sum(b + c for b, c in chunks) * KV_HEADS * HEAD_DIM * 2 * (1 if fp8 else 2)
        floor_ms = kv_bytes / bandwidth * 1e3
        masked = "-"
        if not quick and not fp8 and sum(c for _, c in chunks) * sum(b + c for b, c in chunks) <= 64 * 8192:
            q, k, v, positions, token_seq, _, seq_indptr, seq_cells = step
            mask = ops.visibility_mask(positions, token_seq, seq_indptr, seq_cells.shape[0])
            masked = f"{graph_ms(lambda: ops.masked_cell_attention(q, k, v, seq_cells, mask), calls=4) * 1e3:.1f}"
        rows.append((name, f"{kernel_ms * 1e3:.1f} us", f"{floor_ms * 1e3:.1f} us", f"{floor_ms / kernel_ms:.0%}",
                     f"{masked} us", f"splits<={config.max_splits}"))
        print(rows[-1], flush=True)
    print("\n| case | kernel | KV floor | of bandwidth | masked | |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


STATIC_CASES = {
    "T=1 ctx 64": [(63, 1)],
    "T=1 ctx 4096": [(4095, 1)],
    "T=8 ctx 2048": [(2047, 1)] * 8,
    "T=32 ctx 64": [(63, 1)] * 32,
    "T=64 ctx 64": [(63, 1)] * 64,
    "T=64 ctx 4096": [(4095, 1)] * 64,
    "T=32 ctx 4096 fp8 cells": [(4095, 1)] * 32,
    "T=64 ctx 4096 fp8 cells": [(4095, 1)] * 64,
}
STATIC_VARIANTS = {
    "default": {},
    "block_n 32": {"block_n": 32},
    "block_n 128": {"block_n": 128},
    "warps 2": {"num_warps": 2},
    "warps 8": {"num_warps": 8},
    "stages 1": {"num_stages": 1},
    "stages 3": {"num_stages": 3},
    "min_split 64": {"min_split": 64},
    "min_split 256": {"min_split": 256},
    "min_split 512": {"min_split": 512},
    "splits/2": "half",
    "splits*2": "double",
    "unmasked bulk": {"unmasked_bulk": True},
}
DYNAMIC_CASES = {
    "T=4096 prefill": [(0, 4096)],
    "T=2048 after 12k": [(12288, 2048)],
    "T=512 x4 after 1k + 32 decodes": [(1024, 512)] * 4 + [(2047, 1)] * 32,
}
DYNAMIC_VARIANTS = {
    "default": {},
    "masked bulk": {"unmasked_bulk": False},
    "m64 n64 w4 s2": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    "m64 n64 w4 s3": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
    "m128 n64 w4 s3": {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    "m128 n64 w8 s2": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    "m128 n64 w8 s4": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4},
    "m128 n128 w8 s2": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    "m128 n128 w8 s3": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    "m128 n32 w4 s3": {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3},
    "m256 n64 w8 s3": {"block_m": 256, "block_n": 64, "num_warps": 8, "num_stages": 3},
}


def variant(base, change):
    if change == "half":
        return dataclasses.replace(base, max_splits=max(1, base.max_splits // 2))
    if change == "double":
        return dataclasses.replace(base, max_splits=min(64, base.max_splits * 2))
    config = dataclasses.replace(base, **change)
    group = 32 // KV_HEADS
    return dataclasses.replace(config, block_q=config.block_m // group)


def attention_flops(chunks) -> float:
    """Causal attention FLOPs of the step: 4 * head_dim * heads per (query, visible key) pair."""
    pairs = sum(count * before + count * (count + 1) / 2 for before, count in chunks)
    return 4 * HEAD_DIM * 32 * pairs


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    speed(bandwidth, "--quick" in sys.argv)
    if "--speed-only" in sys.argv:
        return
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for all_cases, variants, static in ((STATIC_CASES, STATIC_VARIANTS, True),
                                        (DYNAMIC_CASES, DYNAMIC_VARIANTS, False)):
        cases = {name: chunks for name, chunks in all_cases.items() if only in name}
        if not cases:
            continue
        table = {}
        for case, chunks in cases.items():
            num_cells = sum(b + c for b, c in chunks) + 16
            step = random_step(5, chunks, num_cells, torch.bfloat16)
            fp8 = case.endswith("fp8 cells")
            base = config_for(step, static, fp8)
            step, scales = with_fp8_cells(step) if fp8 else (step, (None, None))
            kv_bytes = sum(b + c for b, c in chunks) * KV_HEADS * HEAD_DIM * 2 * (1 if fp8 else 2)
            for name, change in variants.items():
                config = variant(base, change)
                try:
                    ms = graph_ms(runner(step, config, scales))
                except Exception as err:  # a config the compiler refuses (e.g. out of shared memory)
                    table[(case, name)] = f"error {type(err).__name__}"
                    continue
                if static:
                    table[(case, name)] = f"{ms * 1e3:.1f} us {kv_bytes / bandwidth / (ms / 1e3):.0%}"
                else:
                    table[(case, name)] = f"{ms * 1e3:.0f} us {attention_flops(chunks) / (ms / 1e3) / 1e12:.0f} TF/s"
                print(case, name, table[(case, name)], flush=True)
            print(case, "default config:", base, flush=True)
        print("\n| variant | " + " | ".join(cases) + " |")
        print("|---|" + "---|" * len(cases))
        for name in variants:
            print(f"| {name} | " + " | ".join(table[(case, name)] for case in cases) + " |")


if __name__ == "__main__":
    main()
