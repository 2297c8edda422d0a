"""On a GPU: a decode step's weight matmuls alone, as a fraction of the bandwidth floor, at each step width.

Usage: python scripts/device/matmul_floor.py [PRESET]   (default llama-3.1-8b)
Runs every layer's stacked projections (qkv, o, gate_up, down) and the LM head back to back in one CUDA graph,
at M = 1, 8, 16, 32, 64 tokens, bf16, through cuBLAS (torch.mm, as the compiled methods do today). The floor
is the weights' bytes over the measured copy bandwidth (bench/roofline.py). A table last.
"""

from __future__ import annotations

import statistics
import sys

import torch

from pt2serve.bench.roofline import measure_limits
from pt2serve.model.presets import CONFIGS

WIDTHS = (1, 8, 16, 32, 64)


def weight_shapes(preset: str) -> list[tuple[int, int]]:
    """(out, in) of every weight matmul of one decode step, in order."""
    cfg = CONFIGS[preset]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size),
             (cfg.hidden_size, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def graph_ms(fn, iters: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    shapes = weight_shapes(preset)
    # Distinct random weights for every matmul, so nothing is served from L2 across them.
    weights = [torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) for out, inp in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = measure_limits("cuda", "bf16").memory_bandwidth
    floor_ms = weight_bytes / bandwidth * 1e3
    rows = []
    for m in WIDTHS:
        inputs = {inp: torch.randn(m, inp, device="cuda", dtype=torch.bfloat16) for _, inp in shapes}
        cublas_ms = graph_ms(lambda: [torch.mm(inputs[w.shape[1]], w.t()) for w in weights])
        rows.append((m, cublas_ms, floor_ms / cublas_ms))
        print(rows[-1], flush=True)
    print(f"\n{preset}: {len(shapes)} weight matmuls, {weight_bytes / 1e9:.2f} GB, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, floor {floor_ms:.2f} ms")
    print("| M | cuBLAS ms | % of floor |\n|---:|---:|---:|")
    for m, ms, fraction in rows:
        print(f"| {m} | {ms:.2f} | {fraction:.1%} |")


if __name__ == "__main__":
    main()
