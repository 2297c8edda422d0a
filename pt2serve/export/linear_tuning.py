"""Timing the narrow-step matmuls of a model on the export's GPU, and keeping the fastest kernel of each.

For every weight shape of the model and every static width up to SMALL_M_MAX, each launch config of the
small-M kernels (kernels/linear_choice.py) is timed against cuBLAS; the fastest config is chosen unless
cuBLAS beats it by more than the timing noise (a tie goes to the Triton kernel: see Timing.chosen). A
FP8 weight is timed the same way on e4m3 operands (kinds fp8-linear / fp8-swiglu), against torch._scaled_mm. A
quantized weight always runs its own small-M kernel at these widths (kernels/quant_linear_triton.py): a few
launch configs of it (tuning_candidates) are timed on random packed weights of the weight's shape and
format, and the fastest is chosen (the default config, which an untuned export runs, is one of them). The
choices are traced into the methods and recorded in the metadata with the times that chose them (nothing is
tuned at load).

How a time is taken: a step reads each weight once from DRAM, so a kernel timed in a loop over one weight
would be served partly from L2 (50 MB on an H200). Each measurement captures calls over enough copies of
the weight that one pass reads ROTATION_BYTES (at most MAX_COPIES: a weight under 1 MB belongs to a model
whose weights L2 holds anyway, and a graph of tens of thousands of launches per config took longer to
capture than the tuning of an 8B), replays that CUDA graph, and divides by the number of copies: back to
back in a graph, as the methods run them, with no launch cost between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pt2serve.kernels.fp8_linear import has_kernel_shape
from pt2serve.kernels.graph_timing import graph_replay_ms
from pt2serve.kernels.linear_choice import SMALL_M_MAX, LinearChoices, candidates, choice_key
from pt2serve.kernels.linear_configs import FP8_LINEAR, FP8_SWIGLU, LaunchConfig, QuantFormat, QuantLaunchConfig
from pt2serve.model.fp8 import Fp8Linear
from pt2serve.model.model import Embedding, Linear, Transformer
from pt2serve.model.quant import QuantizedEmbedding, QuantizedLinear

ROTATION_BYTES = 256 * 2**20  # several times the L2
MAX_COPIES = 256
REPLAYS = 7
# Timings of one weight closer than this fraction are noise (between runs they came out either way).
MARGIN = 0.02


@dataclass(frozen=True)
class MatmulShape:
    kind: str  # "linear", "swiglu" for a stacked gate/up projection whose activation is fused, their fp8 twins,
    # or quant.kind
    rows: int  # of the weight (for swiglu: gate and up together)
    cols: int  # the weight's inputs (K)
    quant: QuantFormat | None = None  # a quantized weight's format


@dataclass(frozen=True)
class Timing:
    shape: MatmulShape
    width: int
    dtype: torch.dtype
    baseline_ms: float  # what an untuned export runs: cuBLAS, or a quantized weight's default config
    best: LaunchConfig | QuantLaunchConfig | None  # the fastest config that ran; None when none did
    best_ms: float
    baseline: str = "cuBLAS"

    @property
    def key(self) -> str:
        return choice_key(self.shape.kind, self.shape.rows, self.shape.cols, self.width, self.dtype)

    @property
    def chosen(self) -> LaunchConfig | QuantLaunchConfig | None:
        if self.best is None:
            return None
        # A quantized weight's default is a config like the others: its fastest config is taken as it is.
        if self.shape.quant is not None:
            return self.best
        # Within the noise the Triton kernel takes the tie: in the step, cuBLAS brings kernels that timing the
        # weight alone does not see in full (the activation after an unfused gate/up matmul, split-K
        # reductions, the copies of a beta-add GEMM), and the Triton kernel fuses what it can. Measured on the
        # 8B (H200, two runs whose choices differed only within the noise): gate/up at M=1 fused 1.83 ms a
        # step against 1.88 for cuBLAS and the activation; q/k/v and o at M=32 on cuBLAS made the step 0.26 ms
        # slower, 64 copies and 32 reductions among it.
        return self.best if self.best_ms <= self.baseline_ms * (1 + MARGIN) else None

    @property
    def chosen_ms(self) -> float:
        return self.best_ms if self.chosen is not None else self.baseline_ms

    def to_dict(self) -> dict:
        return {"key": self.key, "baseline": self.baseline, "baseline_us": round(self.baseline_ms * 1e3, 2),
                "best": self.best.name if self.best else None,
                "best_us": round(self.best_ms * 1e3, 2) if self.best else None,
                "chosen": self.chosen is not None}


def model_matmuls(model: Transformer) -> dict[MatmulShape, int]:
    """The weight matmuls a forward runs: shape -> calls per step. Float weights run through
    `linear`/`swiglu_linear`, quantized ones through the quantized operator (kind: their format's)."""
    calls: dict[MatmulShape, int] = {}

    def add(shape: MatmulShape) -> None:
        calls[shape] = calls.get(shape, 0) + 1

    def add_projection(module, kind: str = "linear") -> None:
        if type(module) in (Linear, Embedding):
            add(MatmulShape(kind, *module.weight.shape))
        elif isinstance(module, Fp8Linear) and has_kernel_shape(*module.weight.shape):
            add(MatmulShape(FP8_SWIGLU if kind == "swiglu" else FP8_LINEAR, *module.weight.shape))
        elif isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            add(_quantized_shape(module))

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for projection in (attn.qkv_proj, attn.o_proj, mlp.down_proj):
            add_projection(projection)
        add_projection(mlp.gate_up_proj, "swiglu")  # an integer one is a plain matmul, then the activation
    add_projection(model.embed_tokens if model.lm_head is None else model.lm_head)  # a tied head: the embedding
    return calls


def _quantized_shape(module: QuantizedLinear | QuantizedEmbedding) -> MatmulShape:
    fmt = QuantFormat(module.bits, module.group_size, module.zeros is not None, module.perm is not None)
    return MatmulShape(fmt.kind, module.out_features, module.in_features, fmt)


def tune(model: Transformer, widths: tuple[int, ...], show_progress: bool = True) -> tuple[LinearChoices, list[Timing]]:
    """Time every (shape, width) of the model on its GPU; the choices and every timing."""
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    widths = tuple(sorted(w for w in widths if w <= SMALL_M_MAX))
    shapes = list(model_matmuls(model))
    timings = []
    with tqdm(total=len(shapes) * len(widths), desc="timing matmul kernels", disable=not show_progress) as bar:
        for shape in shapes:
            if shape.kind in (FP8_LINEAR, FP8_SWIGLU):
                weights, time_shape = _rotation(shape, device, torch.float8_e4m3fn), _time_fp8_shape
            elif shape.quant is None:
                weights, time_shape = _rotation(shape, device, dtype), _time_shape
            else:
                weights, time_shape = _quantized_rotation(shape, device, dtype), _time_quantized_shape
            for width in widths:
                timings.append(time_shape(shape, width, weights, device, dtype))
                bar.update()
            del weights
    torch.cuda.empty_cache()
    choices = {t.key: t.chosen for t in timings if t.chosen is not None}
    return LinearChoices(choices), timings


def _rotation(shape: MatmulShape, device, dtype) -> list[torch.Tensor]:
    copies = rotation_copies(shape.rows * shape.cols * dtype.itemsize)
    return [(torch.randn(shape.rows, shape.cols, device=device) * 0.02).to(dtype) for _ in range(copies)]


def rotation_copies(nbytes: int) -> int:
    """How many copies of a weight of `nbytes` one timed pass runs over."""
    return min(MAX_COPIES, max(1, -(-ROTATION_BYTES // nbytes)))


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
    times = _time_configs(candidates(width, swiglu), weights,
                          lambda config, w: small_m_linear.launch(x, w, swiglu, config))
    best = min(times, key=times.get, default=None)
    return Timing(shape, width, dtype, cublas_ms, best, times.get(best, float("inf")))


def _time_fp8_shape(shape: MatmulShape, width: int, weights: list[torch.Tensor], device, dtype) -> Timing:
    """The small-M kernels on e4m3 operands against torch._scaled_mm (both after the activation's quantization,
    which either path runs the same way)."""
    from pt2serve.kernels import small_m_linear

    x_q = torch.randn(width, shape.cols, device=device).to(torch.float8_e4m3fn)
    x_scale = torch.rand(width, 1, device=device) * 0.01
    w_scale = torch.rand(shape.rows, device=device) * 0.01
    swiglu = shape.kind == FP8_SWIGLU

    def scaled_mm(w: torch.Tensor) -> torch.Tensor:
        out = torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=dtype)
        if swiglu:  # the method's other kernel: the activation (its silu and multiply, one pass)
            gate, up = out.chunk(2, dim=-1)
            out = torch.mul(gate, up)
        return out

    baseline_ms = graph_replay_ms(lambda: [scaled_mm(w) for w in weights], REPLAYS) / len(weights)
    times = _time_configs(candidates(width, swiglu, weight_bytes=1), weights,
                          lambda config, w: small_m_linear.launch(x_q, w, swiglu, config, (x_scale, w_scale)))
    best = min(times, key=times.get, default=None)
    return Timing(shape, width, dtype, baseline_ms, best, times.get(best, float("inf")), baseline="scaled_mm")


def _time_configs(configs: list, weights: list, launch) -> dict:
    """Milliseconds of one call of each config that runs on this GPU (launch(config, weight))."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    times = {}
    for config in configs:
        try:
            work = lambda: [launch(config, w) for w in weights]  # noqa: E731
            times[config] = graph_replay_ms(work, REPLAYS) / len(weights)
        # Tiles this GPU cannot hold (fp32 in shared memory), or operands its compiler refuses in a tile (e4m3
        # tl.dot has minimum sizes per architecture): not candidates here.
        except (OutOfResources, CompilationError):
            continue
    return times


def _quantized_rotation(shape: MatmulShape, device, dtype) -> list[tuple]:
    """Copies of random packed weights in the shape's format, as many as make ROTATION_BYTES."""
    fmt = shape.quant
    num_groups = -(-shape.cols // fmt.group_size)
    nbytes = shape.rows * (shape.cols * fmt.bits // 8 + num_groups * (dtype.itemsize + fmt.has_zeros))
    return [_random_packed(shape, num_groups, device, dtype) for _ in range(rotation_copies(nbytes))]


def _random_packed(shape: MatmulShape, num_groups: int, device, dtype) -> tuple:
    """(qweight, scales, zeros, perm): the kernels' time does not depend on the values."""
    fmt = shape.quant
    qweight = torch.randint(0, 256, (shape.rows, shape.cols * fmt.bits // 8), dtype=torch.uint8, device=device)
    scales = torch.rand(shape.rows, num_groups, device=device, dtype=dtype) * 0.01
    zeros = None
    if fmt.has_zeros:
        zeros = torch.randint(0, 2**fmt.bits, (shape.rows, num_groups), dtype=torch.uint8, device=device)
    perm = torch.randperm(shape.cols, device=device) if fmt.has_perm else None
    return qweight, scales, zeros, perm


def _time_quantized_shape(shape: MatmulShape, width: int, weights: list[tuple], device, dtype) -> Timing:
    from pt2serve.kernels import quant_linear_triton as kernels

    fmt = shape.quant
    x = torch.randn(width, shape.cols, device=device, dtype=dtype)
    configs = kernels.tuning_candidates(width, shape.rows, shape.cols, fmt.bits, kernels.sm_count(x.device))
    times = _time_configs(configs, weights, lambda config, w: kernels.launch_small_m(
        x, *w, fmt.bits, fmt.group_size, config))
    best = min(times, key=times.get, default=None)
    default = configs[0]  # what the operator runs without a choice
    return Timing(shape, width, dtype, times.get(default, float("inf")), best, times.get(best, float("inf")),
                  baseline=f"default {default.name}")


def describe(model: Transformer, timings: list[Timing]) -> dict:
    """The metadata record: every timing, and per width the weight matmuls of one step as an untuned export
    runs them (cuBLAS, quantized weights' default configs) and with the chosen kernels (milliseconds, from
    the same timings)."""
    calls = model_matmuls(model)
    per_width: dict[int, list[float]] = {}
    for timing in timings:
        totals = per_width.setdefault(timing.width, [0.0, 0.0])
        totals[0] += calls[timing.shape] * timing.baseline_ms
        totals[1] += calls[timing.shape] * timing.chosen_ms
    return {
        "timings": [t.to_dict() for t in timings],
        "step_matmuls_ms": {str(width): {"untuned": round(untuned, 4), "tuned": round(tuned, 4)}
                            for width, (untuned, tuned) in sorted(per_width.items())},
    }
