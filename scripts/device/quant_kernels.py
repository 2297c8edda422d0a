"""On a GPU: the quantized linear's kernels on the llama-3.1-8b shapes, next to bf16 torch.mm and the reference.

Usage: python scripts/device/quant_kernels.py [M,M,...]
For each layer shape, bits (int8 per row, int4 group 128) and width M: the op's error against the reference
(dequantize then matmul), and the time of bf16 torch.mm, of the reference and of the op (CUDA-graph replays,
median of 20), with the op's bandwidth against the floor of its bytes (packed weights + scales + zeros).
This is the measurement to choose the kernels' tiles and the small-M / wide-M switch by.
"""

from __future__ import annotations

import statistics
import sys

import torch

from pt2serve.kernels import quant_linear_triton  # noqa: F401  (registers the op)
from pt2serve.kernels.quant_linear import pack, reference_quant_linear

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


def graph_ms(fn, replays: int = 20) -> float:
    """Median time of one call, captured in a CUDA graph (as the artifact's static methods run)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a large device copy (read + write), the floor's denominator."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = graph_ms(lambda: b.copy_(a))
    return 2 * a.numel() / (ms / 1e3)


def main() -> None:
    widths = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 16, 32, 64, 128, 1024]
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for bits, group_size in ((8, k), (4, 128)):
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randint(0, 2**bits, (n, k), device="cuda", generator=gen)
            qweight = pack(q, bits)
            num_groups = -(-k // group_size)
            scales = (torch.rand(n, num_groups, device="cuda", generator=gen) * 0.01).to(torch.bfloat16)
            zeros = None if bits == 8 else torch.randint(0, 16, (n, num_groups), device="cuda", generator=gen).to(torch.uint8)
            packed_bytes = qweight.numel() + scales.numel() * 2 + (0 if zeros is None else zeros.numel())
            for m in widths:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = reference_quant_linear(x, qweight, scales, zeros, None, bits, group_size)
                out = torch.ops.pt2serve.quant_linear(x, qweight, scales, zeros, None, bits, group_size)
                error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                mm = graph_ms(lambda: torch.mm(x, weight.T))
                reference = graph_ms(lambda: reference_quant_linear(x, qweight, scales, zeros, None, bits, group_size))
                op = graph_ms(lambda: torch.ops.pt2serve.quant_linear(x, qweight, scales, zeros, None, bits, group_size))
                floor_ms = (packed_bytes + 2 * m * (n + k)) / bandwidth * 1e3
                rows.append((name, f"int{bits}", m, error, mm, reference, op, floor_ms))
    print(f"{'layer':>13} {'bits':>5} {'M':>5} {'rel err':>8} {'bf16 mm':>8} {'ref ms':>8} {'op ms':>8} "
          f"{'floor ms':>8} {'op/floor':>8} {'op/mm':>6}")
    for name, bits, m, error, mm, reference, op, floor_ms in rows:
        print(f"{name:>13} {bits:>5} {m:>5} {error:8.1e} {mm:8.4f} {reference:8.4f} {op:8.4f} {floor_ms:8.4f} "
              f"{op / floor_ms:8.2f} {op / mm:6.2f}")


if __name__ == "__main__":
    main()
