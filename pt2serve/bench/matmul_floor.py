"""--mode matmuls: a decode step's weight matmuls alone, against the bandwidth floor, at each step width M.

Every layer's projections of the artifact's model (qkv, o, gate/up with SwiGLU, down) and the LM head, each
with its own random weight in the artifact's dtype (so nothing is served from L2 across them), run back to
back at M = --tokens rows, two ways:
  - plain: F.linear for every matmul (cuBLAS on a GPU), the gate/up one followed by one elementwise kernel,
    as a method without the fused kernel runs it;
  - chosen: the kernels the export chose (its `linear_kernels` record: the small-M Triton kernel where it
    won, the plain matmul elsewhere). A CPU export chose none, so there both ways are the plain one.
On a GPU each way is captured in one CUDA graph and replayed --iters times (the median replay); on a CPU it
runs --iters times (the median run). The floor is the weights' bytes over the measured copy bandwidth
(roofline.py). Dense weights: for a quantized artifact this times the dense matmuls its format replaces.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pt2serve.bench.progress import Progress
from pt2serve.errors import Pt2ServeError

DEFAULT_TOKENS = (1, 8, 16, 32, 64)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Matmul:
    kind: str  # "linear", or "swiglu" (gate and up in one weight, then their product)
    rows: int  # N: output features
    cols: int  # K: input features


@dataclass(frozen=True)
class MatmulRow:
    tokens: int  # M
    plain_ms: float
    chosen_ms: float
    num_chosen: int  # matmuls the chosen way runs with the export's Triton kernel


@dataclass
class MatmulFloorResult:
    rows: list[MatmulRow]
    num_matmuls: int
    weight_bytes: int
    bandwidth: float  # bytes/s of a device copy
    dtype: str
    device: str
    iters: int

    @property
    def floor_ms(self) -> float:
        return self.weight_bytes / self.bandwidth * 1e3


def step_matmuls(model_config: dict[str, Any]) -> list[Matmul]:
    """Every weight matmul of one decode step, in order."""
    cfg = model_config
    q, kv = cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"]
    hidden = cfg["hidden_size"]
    layer = [Matmul("linear", q + 2 * kv, hidden), Matmul("linear", hidden, q),
             Matmul("swiglu", 2 * cfg["intermediate_size"], hidden), Matmul("linear", hidden, cfg["intermediate_size"])]
    return layer * cfg["num_layers"] + [Matmul("linear", cfg["vocab_size"], hidden)]


def plain(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    out = F.linear(x, weight)
    if kind == "swiglu":
        gate, up = out.chunk(2, dim=-1)
        out = torch.mul(gate, up)
    return out


def run_matmul_floor(path: str | Path, tokens: tuple[int, ...] | None = None, iters: int = 10,
                     device: str | None = None, progress: Progress | None = None) -> MatmulFloorResult:
    """Time a step's weight matmuls of the artifact at `path` at each M in `tokens` (see the module docstring)."""
    from pt2serve.bench.roofline import measure_limits
    from pt2serve.kernels.linear_choice import LinearChoices
    from pt2serve.runtime.artifact import read_metadata

    if iters < 1:
        raise Pt2ServeError(f"--iters must be at least 1, got {iters}")
    widths = tokens or DEFAULT_TOKENS
    if any(m < 1 for m in widths):
        raise Pt2ServeError(f"--tokens must be positive integers, got {list(widths)}")
    raw = read_metadata(path).raw
    if raw["dtype"] not in _DTYPES:
        raise Pt2ServeError(f"--mode matmuls times {', '.join(_DTYPES)} matmuls; this artifact's dtype is "
                            f"{raw['dtype']}")
    dtype = _DTYPES[raw["dtype"]]
    on = torch.device(device or raw["backend"])
    if on.type == "cuda" and not torch.cuda.is_available():
        raise Pt2ServeError("the artifact was exported for cuda, but no GPU is visible: give --device cpu")
    # Triton launch configs exist only for GPU exports; on the CPU every matmul is the plain one.
    record = (raw.get("linear_kernels") or {}).get("choices", {}) if on.type == "cuda" else {}
    choices = LinearChoices.from_dict(record)
    shapes = step_matmuls(raw["model_config"])
    _say(progress, f"{len(shapes)} random weights on {on}")
    generator = torch.Generator(on).manual_seed(0)
    weights = [(torch.randn(s.rows, s.cols, device=on, generator=generator) * 0.02).to(dtype) for s in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    _say(progress, "measuring the copy bandwidth")
    bandwidth = measure_limits(on, raw["dtype"]).memory_bandwidth
    rows = []
    for m in widths:
        _say(progress, f"M={m}")
        inputs = {cols: torch.randn(m, cols, device=on, generator=generator).to(dtype)
                  for cols in {s.cols for s in shapes}}
        calls = [(s.kind, inputs[s.cols], w, choices.lookup(s.kind, inputs[s.cols], w))
                 for s, w in zip(shapes, weights)]
        plain_ms = _median_ms(lambda: [plain(x, w, kind) for kind, x, w, _ in calls], on, iters)
        chosen = [call for call in calls if call[3] is not None]
        if chosen:
            from pt2serve.kernels import small_m_linear

            chosen_ms = _median_ms(lambda: [
                plain(x, w, kind) if config is None else small_m_linear.launch(x, w, kind == "swiglu", config)
                for kind, x, w, config in calls], on, iters)
        else:
            chosen_ms = plain_ms  # the export chose no kernel at this width: the same calls
        rows.append(MatmulRow(m, plain_ms, chosen_ms, len(chosen)))
    return MatmulFloorResult(rows, len(shapes), weight_bytes, bandwidth, raw["dtype"], str(on), iters)


def _median_ms(work: Callable[[], object], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        from pt2serve.kernels.graph_timing import graph_replay_ms

        return graph_replay_ms(work, iters)
    work()  # warm up
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def matmul_floor_table(result: MatmulFloorResult, title: str):
    from rich.table import Table

    floor = result.floor_ms
    plain_name = "cuBLAS" if result.device.startswith("cuda") else "plain"
    table = Table(title=title, caption=f"{result.num_matmuls} weight matmuls, {result.weight_bytes / 1e9:.3g} GB "
                  f"({result.dtype}), copy bandwidth {result.bandwidth / 1e9:.1f} GB/s: floor {floor:.3g} ms; "
                  f"median of {result.iters}")
    for name in ("M", f"{plain_name} ms", "% of floor", "chosen ms", "% of floor", "Triton calls"):
        table.add_column(name, justify="right")
    for row in result.rows:
        table.add_row(str(row.tokens), f"{row.plain_ms:.3g}", f"{floor / row.plain_ms:.1%}", f"{row.chosen_ms:.3g}",
                      f"{floor / row.chosen_ms:.1%}", f"{row.num_chosen} of {result.num_matmuls}")
    return table


def matmul_floor_document(result: MatmulFloorResult, artifact: str, raw: dict[str, Any],
                          flags: dict[str, Any]) -> dict[str, Any]:
    from pt2serve.bench.report import document_header

    return {**document_header("matmuls", artifact, raw, result.device, flags), "num_matmuls": result.num_matmuls,
            "weight_bytes": result.weight_bytes, "bandwidth": result.bandwidth, "floor_ms": result.floor_ms,
            "iters": result.iters, "rows": [dataclasses.asdict(row) for row in result.rows]}


def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)
