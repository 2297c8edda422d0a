"""On a GPU: the Triton cell-attention operator against the masked reference, then its speed.

Usage: python scripts/device/attention_check.py [--quick]
1. Correctness (bf16 and fp32, llama-3.1-8b head shapes: 32 heads, 8 KV heads, head dim 128) on random
   steps with cells in random pool order: mixed steps, 64 decodes at 4k context, a 2,048-token chunk
   behind a 12k-token prefix; both call-site configs (static width, dynamic width).
2. Speed, each case replayed in a CUDA graph (as the runtime runs static widths), next to the bytes of K/V it
   must read over the measured copy bandwidth, and to the masked path where that fits in memory.
A table last.
"""

from __future__ import annotations

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
    the operator's inputs but the block table, which depends on the launch config (see `run`)."""
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


def config_for(step, static: bool) -> ops.LaunchConfig:
    q, _, _, _, _, _, seq_indptr, _ = step
    return ops.LaunchConfig.for_call(q.shape[0] if static else None, seq_indptr.shape[0] - 1, HEADS, KV_HEADS)


def runner(step, config: ops.LaunchConfig):
    """A call of the operator's kernels on `step` with `config`, its block table built once (as per step)."""
    q, _, _, _, _, query_indptr, seq_indptr, _ = step
    block_seq_end = ops.block_sequence_ends(query_indptr, config.num_blocks(q.shape[0], seq_indptr.shape[0] - 1), config.block_q)
    return lambda: ops.launch_cell_attention(*step, block_seq_end, config)


def reference(step) -> torch.Tensor:
    q, k, v, positions, token_seq, _, seq_indptr, seq_cells = step
    mask = ops.visibility_mask(positions, token_seq, seq_indptr, seq_cells.shape[0])
    return ops.masked_cell_attention(q.float(), k.float(), v.float(), seq_cells, mask)


def graph_ms(fn, iters: int = 20, calls: int = 16) -> float:
    """Median ms of one `fn`, `calls` of them captured back to back in a CUDA graph (as a step's layers run)."""
    return graph_replay_ms(lambda: [fn() for _ in range(calls)], iters) / calls


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write), measured as the bench measures it."""
    return measure_limits(DEVICE, "bf16").memory_bandwidth


CHECKS = {
    "mixed step": [(0, 5), (3, 1), (200, 1), (0, 70), (129, 2), (1000, 1)],
    "64 decodes at 4k": [(4095, 1)] * 64,
    "2048 chunk behind 12k": [(12288, 2048)],
}
SPEED = {  # name: (chunks, static call site?)
    "T=1 ctx 64": ([(63, 1)], True),
    "T=1 ctx 4096": ([(4095, 1)], True),
    "T=32 ctx 64": ([(63, 1)] * 32, True),
    "T=64 ctx 64": ([(63, 1)] * 64, True),
    "T=64 ctx 4096": ([(4095, 1)] * 64, True),
    "T=2048 chunk after 12k": ([(12288, 2048)], False),
    "T=4096 prefill": ([(0, 4096)], False),
}


def main() -> None:
    quick = "--quick" in sys.argv
    rows = []
    for dtype, tolerance in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        for name, chunks in CHECKS.items():
            num_cells = sum(b + c for b, c in chunks) + 16
            step = random_step(7, chunks, num_cells, dtype)
            ref = reference(step)
            for static in (True, False):
                out = runner(step, config_for(step, static))()
                err = float((out.float() - ref).norm() / ref.norm())
                status = "PASS" if err < tolerance and torch.isfinite(out).all() else "FAIL"
                rows.append(("check", f"{name} {str(dtype)[6:]} {'static' if static else 'dynamic'}", f"{err:.1e}", status))
                print(rows[-1], flush=True)
            del ref
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for name, (chunks, static) in SPEED.items():
        num_cells = sum(b + c for b, c in chunks) + 16
        step = random_step(3, chunks, num_cells, torch.bfloat16)
        config = config_for(step, static)
        kernel_ms = graph_ms(runner(step, config))
        kv_bytes = sum(b + c for b, c in chunks) * KV_HEADS * HEAD_DIM * 2 * 2
        floor_ms = kv_bytes / bandwidth * 1e3
        masked = "-"
        if not quick and sum(c for _, c in chunks) * sum(b + c for b, c in chunks) <= 64 * 8192:
            q, k, v, positions, token_seq, _, seq_indptr, seq_cells = step
            mask = ops.visibility_mask(positions, token_seq, seq_indptr, seq_cells.shape[0])
            masked = f"{graph_ms(lambda: ops.masked_cell_attention(q, k, v, seq_cells, mask), calls=4) * 1e3:.1f}"
        rows.append(("speed", name, f"{kernel_ms * 1e3:.1f} us (KV floor {floor_ms * 1e3:.1f}, "
                     f"{floor_ms / kernel_ms:.0%} of bw; masked {masked} us)", f"splits<={config.max_splits}"))
        print(rows[-1], flush=True)
    print("\n| kind | case | result | |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if any(row[3] == "FAIL" for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
