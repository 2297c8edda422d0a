"""Timing the narrow-step matmuls of a model on the export's GPU, and keeping the fastest kernel of each.

For every weight shape of the model and every static width up to SMALL_M_MAX, each launch config of the
small-M kernels (kernels/linear_choice.py) is timed against cuBLAS; a config is chosen only where it beats
cuBLAS by more than the timing noise. The choices are traced into the methods and recorded in the metadata
with the times that chose them (nothing is tuned at load).

How a time is taken: a step reads each weight once from DRAM, so a kernel timed in a loop over one weight
would be served partly from L2 (50 MB on an H200). Each measurement captures calls over enough copies of
the weight that one pass reads ROTATION_BYTES, replays that CUDA graph, and divides by the number of
copies: back to back in a graph, as the methods run them, with no launch cost between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pt2serve.kernels.graph_timing import graph_replay_ms
from pt2serve.kernels.linear_choice import SMALL_M_MAX, LaunchConfig, LinearChoices, candidates, choice_key
from pt2serve.model.model import Embedding, Linear, Transformer

ROTATION_BYTES = 256 * 2**20  # several times the L2
REPLAYS = 7
# A config must beat cuBLAS by this fraction to be chosen: closer than that is timing noise.
MARGIN = 0.02


@dataclass(frozen=True)
class MatmulShape:
    kind: str  # "linear", or "swiglu" for a stacked gate/up projection whose activation is fused
    rows: int  # of the weight (for swiglu: gate and up together)
    cols: int


@dataclass(frozen=True)
class Timing:
    shape: MatmulShape
    width: int
    dtype: torch.dtype
    cublas_ms: float
    best: LaunchConfig | None  # the fastest config that ran; None when none did
    best_ms: float

    @property
    def key(self) -> str:
        return choice_key(self.shape.kind, self.shape.rows, self.shape.cols, self.width, self.dtype)

    @property
    def chosen(self) -> LaunchConfig | None:
        if self.best is None or self.best_ms > self.cublas_ms * (1 - MARGIN):
            return None
        return self.best

    def to_dict(self) -> dict:
        return {"key": self.key, "cublas_us": round(self.cublas_ms * 1e3, 2),
                "best": self.best.name if self.best else None,
                "best_us": round(self.best_ms * 1e3, 2) if self.best else None,
                "chosen": self.chosen is not None}


def model_matmuls(model: Transformer) -> dict[MatmulShape, int]:
    """The weight matmuls a forward runs through `linear`/`swiglu_linear`: shape -> calls per step.

    Quantized projections run their own operator and are not listed.
    """
    calls: dict[MatmulShape, int] = {}

    def add(kind: str, weight: torch.Tensor) -> None:
        shape = MatmulShape(kind, *weight.shape)
        calls[shape] = calls.get(shape, 0) + 1

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for projection in (attn.qkv_proj, attn.o_proj, mlp.down_proj):
            if type(projection) is Linear:
                add("linear", projection.weight)
        if type(mlp.gate_up_proj) is Linear:
            add("swiglu", mlp.gate_up_proj.weight)
    if model.lm_head is None and type(model.embed_tokens) is Embedding:  # the tied head
        add("linear", model.embed_tokens.weight)
    elif type(model.lm_head) is Linear:
        add("linear", model.lm_head.weight)
    return calls


def tune(model: Transformer, widths: tuple[int, ...], show_progress: bool = True) -> tuple[LinearChoices, list[Timing]]:
    """Time every (shape, width) of the model on its GPU; the choices and every timing."""
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    widths = tuple(sorted(w for w in widths if w <= SMALL_M_MAX))
    shapes = list(model_matmuls(model))
    timings = []
    with tqdm(total=len(shapes) * len(widths), desc="timing matmul kernels", disable=not show_progress) as bar:
        for shape in shapes:
            weights = _rotation(shape, device, dtype)
            for width in widths:
                timings.append(_time_shape(shape, width, weights, device, dtype))
                bar.update()
            del weights
    torch.cuda.empty_cache()
    choices = {t.key: t.chosen for t in timings if t.chosen is not None}
    return LinearChoices(choices), timings


def _rotation(shape: MatmulShape, device, dtype) -> list[torch.Tensor]:
    nbytes = shape.rows * shape.cols * dtype.itemsize
    copies = max(1, -(-ROTATION_BYTES // nbytes))
    return [torch.randn(shape.rows, shape.cols, device=device, dtype=dtype) * 0.02 for _ in range(copies)]


def _time_shape(shape: MatmulShape, width: int, weights: list[torch.Tensor], device, dtype) -> Timing:
    from pt2serve.kernels import small_m_linear

    x = torch.randn(width, shape.cols, device=device, dtype=dtype)
    swiglu = shape.kind == "swiglu"

    def cublas(w: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, w)
        if swiglu:  # what the method runs instead of the fused kernel: the matmul and one elementwise kernel
            gate, up = out.chunk(2, dim=-1)
            out = torch.mul(gate, up)
        return out

    cublas_ms = graph_replay_ms(lambda: [cublas(w) for w in weights], REPLAYS) / len(weights)
    best, best_ms = None, float("inf")
    for config in candidates(width, swiglu):
        try:
            work = lambda: [small_m_linear.launch(x, w, swiglu, config) for w in weights]  # noqa: E731
            ms = graph_replay_ms(work, REPLAYS) / len(weights)
        except Exception:  # a config this GPU cannot run (registers, shared memory): not a candidate here
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return Timing(shape, width, dtype, cublas_ms, best, best_ms)


def describe(model: Transformer, timings: list[Timing]) -> dict:
    """The metadata record: every timing, and per width the weight matmuls of one step with cuBLAS only and
    with the chosen kernels (milliseconds, from the same timings)."""
    calls = model_matmuls(model)
    per_width: dict[int, list[float]] = {}
    for timing in timings:
        chosen_ms = timing.best_ms if timing.chosen is not None else timing.cublas_ms
        totals = per_width.setdefault(timing.width, [0.0, 0.0])
        totals[0] += calls[timing.shape] * timing.cublas_ms
        totals[1] += calls[timing.shape] * chosen_ms
    return {
        "timings": [t.to_dict() for t in timings],
        "step_matmuls_ms": {str(width): {"cublas": round(cublas, 4), "chosen": round(chosen, 4)}
                            for width, (cublas, chosen) in sorted(per_width.items())},
    }
