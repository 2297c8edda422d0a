"""On a GPU: time the cell-attention kernels over launch configs, one knob at a time from the defaults.

Usage: python scripts/device/attention_tune.py
Static (decode-sized) cases vary the KV block, warps, stages, split minimum and split count; dynamic
(prefill-sized) cases vary the query and KV tiles, warps and stages. Each time is one call inside a CUDA graph
of 16 calls (as a step's layers run), llama-3.1-8b head shapes, bf16. A table per case family last.
"""

from __future__ import annotations

import dataclasses

import torch

from attention_check import config_for, copy_bandwidth, graph_ms, random_step, runner, HEAD_DIM, KV_HEADS

STATIC_CASES = {
    "T=1 ctx 64": [(63, 1)],
    "T=1 ctx 4096": [(4095, 1)],
    "T=8 ctx 2048": [(2047, 1)] * 8,
    "T=32 ctx 64": [(63, 1)] * 32,
    "T=64 ctx 64": [(63, 1)] * 64,
    "T=64 ctx 4096": [(4095, 1)] * 64,
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
}
DYNAMIC_CASES = {
    "T=4096 prefill": [(0, 4096)],
    "T=2048 after 12k": [(12288, 2048)],
    "T=512 x4 after 1k + 32 decodes": [(1024, 512)] * 4 + [(2047, 1)] * 32,
}
DYNAMIC_VARIANTS = {
    "default": {},
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
    for cases, variants, static in ((STATIC_CASES, STATIC_VARIANTS, True), (DYNAMIC_CASES, DYNAMIC_VARIANTS, False)):
        table = {}
        for case, chunks in cases.items():
            num_cells = sum(b + c for b, c in chunks) + 16
            step = random_step(5, chunks, num_cells, torch.bfloat16)
            base = config_for(step, static)
            kv_bytes = sum(b + c for b, c in chunks) * KV_HEADS * HEAD_DIM * 2 * 2
            for name, change in variants.items():
                config = variant(base, change)
                try:
                    ms = graph_ms(runner(step, config))
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
