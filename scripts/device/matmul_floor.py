"""On a GPU: a decode step's weight matmuls alone, as a fraction of the bandwidth floor, at each step width.

Usage: python scripts/device/matmul_floor.py ARTIFACT.pt2 PRESET   (an export of PRESET for the GPU)
Runs every layer's projections (qkv, o, gate/up with SwiGLU, down) and the LM head back to back in one CUDA
graph, at M = 1, 8, 16, 32, 64 tokens, in the artifact's dtype, two ways: cuBLAS only (the gate/up matmul
followed by one elementwise kernel, as a method without the fused kernel runs it), and the kernels the
export chose (its `linear_kernels` record: the small-M Triton kernel where it won, cuBLAS elsewhere). The
floor is the weights' bytes over the measured copy bandwidth (bench/roofline.py). A table last.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pt2serve.bench.roofline import measure_limits
from pt2serve.export.linear_tuning import MatmulShape
from pt2serve.kernels.graph_timing import graph_replay_ms
from pt2serve.kernels import small_m_linear
from pt2serve.kernels.linear_choice import LinearChoices
from pt2serve.model.presets import CONFIGS
from pt2serve.runtime.artifact import read_metadata

WIDTHS = (1, 8, 16, 32, 64)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def step_matmuls(preset: str) -> list[MatmulShape]:
    """Every weight matmul of one decode step, in order."""
    cfg = CONFIGS[preset]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [MatmulShape("linear", q + 2 * kv, cfg.hidden_size), MatmulShape("linear", cfg.hidden_size, q),
             MatmulShape("swiglu", 2 * cfg.intermediate_size, cfg.hidden_size),
             MatmulShape("linear", cfg.hidden_size, cfg.intermediate_size)]
    return layer * cfg.num_layers + [MatmulShape("linear", cfg.vocab_size, cfg.hidden_size)]


def cublas(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    out = F.linear(x, weight)
    if kind == "swiglu":
        gate, up = out.chunk(2, dim=-1)
        out = torch.mul(gate, up)
    return out


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    artifact, preset = sys.argv[1], sys.argv[2]
    meta = read_metadata(artifact).raw
    dtype = DTYPES[meta["dtype"]]
    record = meta.get("linear_kernels") or {"choices": {}}
    choices = LinearChoices.from_dict(record["choices"])
    shapes = step_matmuls(preset)
    # Distinct random weights for every matmul, so nothing is served from L2 across them.
    weights = [torch.randn(s.rows, s.cols, device="cuda", dtype=dtype) * 0.02 for s in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = measure_limits("cuda", meta["dtype"]).memory_bandwidth
    floor_ms = weight_bytes / bandwidth * 1e3
    rows = []
    for m in WIDTHS:
        inputs = {cols: torch.randn(m, cols, device="cuda", dtype=dtype) for cols in {s.cols for s in shapes}}
        calls = []
        for shape, weight in zip(shapes, weights):
            x = inputs[shape.cols]
            config = choices.lookup(shape.kind, x, weight)
            calls.append((shape.kind, x, weight, config))
        cublas_ms = graph_replay_ms(lambda: [cublas(x, w, kind) for kind, x, w, _ in calls])
        chosen_ms = graph_replay_ms(lambda: [
            cublas(x, w, kind) if config is None else small_m_linear.launch(x, w, kind == "swiglu", config)
            for kind, x, w, config in calls
        ])
        kernels = sum(config is not None for *_, config in calls)
        rows.append((m, cublas_ms, chosen_ms, kernels))
        print(rows[-1], flush=True)
    print(f"\n{preset} ({meta['dtype']}): {len(shapes)} weight matmuls, {weight_bytes / 1e9:.2f} GB, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, floor {floor_ms:.2f} ms")
    print("| M | cuBLAS ms | % of floor | chosen ms | % of floor | Triton calls |\n|---:|---:|---:|---:|---:|---:|")
    for m, cublas_ms, chosen_ms, kernels in rows:
        print(f"| {m} | {cublas_ms:.2f} | {floor_ms / cublas_ms:.1%} | {chosen_ms:.2f} | {floor_ms / chosen_ms:.1%} "
              f"| {kernels} of {len(shapes)} |")


if __name__ == "__main__":
    main()
