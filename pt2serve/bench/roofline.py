"""The physical limit of a step on this machine: measured memory bandwidth and matrix throughput.

Measured once per run on the device in use:
  - bandwidth: a large device-to-device copy (bytes read + bytes written, over the best time);
  - matrix throughput: a square matmul in the artifact's dtype (2 n^3 FLOPs over the best time); for an
    artifact whose linear layers are FP8, a square e4m3 torch._scaled_mm, which is what its wide steps run.
On a CPU the sizes are picked so each measurement takes well under a second.

A step's limit (see StepCost):
  bytes  = weight bytes read (once per compiled call) + KV cells moved: each sequence's earlier context
           read once and one cell written per new token; a KV cell = layers x 2 x kv_heads x head_dim x dtype bytes
  FLOPs  = 2 x matmul params x tokens (the output head only for the rows whose next token is sampled)
           + attention: 4 x layers x heads x head_dim per query-key pair (each token x its context)
  limit  = max(bytes / bandwidth, FLOPs / matrix throughput)
For a decode step each token is its own sequence, so the KV moved is each token's context length.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pt2serve.bench.timing import StepShape

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2, "uint8": 1, "int64": 8,
                "float8_e4m3fn": 1, "fp8": 1}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                 "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MachineLimits:
    device: str
    dtype: str
    memory_bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s
    copy_bytes: int  # size of the copied buffer
    matmul_size: int  # n of the n x n x n matmul
    seconds: float  # time spent measuring

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_limits(device: torch.device | str, dtype: str, fp8_matmuls: bool = False) -> MachineLimits:
    device = torch.device(device)
    torch_dtype = _TORCH_DTYPES[dtype]
    started = time.perf_counter()
    if device.type == "cuda":
        bandwidth, copy_bytes = _cuda_bandwidth(device)
        flops, size = _cuda_fp8_matmul(device) if fp8_matmuls else _cuda_matmul(device, torch_dtype)
        dtype = "fp8 e4m3" if fp8_matmuls else dtype
        torch.cuda.empty_cache()
    else:
        bandwidth, copy_bytes = _cpu_bandwidth(device)
        flops, size = _cpu_matmul(device, torch_dtype)
    return MachineLimits(str(device), dtype, bandwidth, flops, copy_bytes, size, time.perf_counter() - started)


def _cuda_best(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _cuda_bandwidth(device: torch.device) -> tuple[float, int]:
    free, _total = torch.cuda.mem_get_info(device)
    size = int(min(1 << 30, free // 8)) // 4096 * 4096
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _cuda_best(lambda: dst.copy_(src), repeats=10)
    del src, dst
    return 2 * size / seconds, size


def _cuda_matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    n = 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _cuda_best(lambda: torch.mm(a, b), repeats=10)
    del a, b
    return 2 * n ** 3 / seconds, n


def _cuda_fp8_matmul(device: torch.device) -> tuple[float, int]:
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    seconds = _cuda_best(lambda: torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b,
                                                  out_dtype=torch.bfloat16), repeats=10)
    del a, b
    return 2 * n ** 3 / seconds, n


def _cpu_best(fn, repeats: int, budget: float = 0.3) -> float:
    fn()
    best = float("inf")
    spent = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        took = time.perf_counter() - started
        best = min(best, took)
        spent += took
        if spent > budget:
            break
    return best


def _cpu_bandwidth(device: torch.device) -> tuple[float, int]:
    size = 128 << 20  # well beyond any cache; about 10-50 ms a copy
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _cpu_best(lambda: dst.copy_(src), repeats=5)
    return 2 * size / seconds, size


def _cpu_matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    n = 256
    while True:  # grow until one matmul takes ~50 ms (or n = 2048), so the rate is not dominated by overhead
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _cpu_best(lambda: torch.mm(a, b), repeats=3, budget=0.2)
        if seconds > 0.05 or n >= 2048:
            return 2 * n ** 3 / seconds, n
        n *= 2


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-call constants of the model, from the artifact's metadata."""

    weight_bytes: int  # all weights
    weight_bytes_per_call: int  # weights a compiled call reads (an untied input embedding is only gathered)
    matmul_params: int  # parameters used in matmuls per token (layers + output head)
    head_params: int  # output head parameters (hidden x vocab)
    kv_bytes_per_cell: int  # K and V of one token, all layers
    attention_flops_per_pair: int  # 4 x layers x heads x head_dim

    @classmethod
    def from_metadata(cls, raw: dict[str, Any]) -> "ModelCost":
        cfg = raw["model_config"]
        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        tied = bool(cfg.get("tie_word_embeddings", False))
        quantization = raw.get("quantization")
        # A quantized layer's parameters are its packed values (several per byte); its scales and zeros are
        # bytes to read but not parameters.
        values_per_byte = 8 // quantization["bits"] if quantization else 1
        total = embed = matmul = 0
        for entry in raw["weights"]:
            numel = 1
            for dim in entry["shape"]:
                numel *= dim
            nbytes = numel * _DTYPE_BYTES[entry["dtype"]]
            total += nbytes
            is_embedding = "embed_tokens" in entry["name"]
            if is_embedding:
                embed += nbytes
            if entry["name"].endswith((".scales", ".zeros")):
                continue
            if len(entry["shape"]) == 2 and (tied or not is_embedding):
                # linear layers, the output head, and the embedding when it is the head
                matmul += numel * (values_per_byte if entry["name"].endswith(".qweight") else 1)
        cache = raw["cache"]
        kv_cell = cache["num_layers"] * 2 * cache["num_kv_heads"] * cache["head_dim"] * _DTYPE_BYTES[cache["dtype"]]
        return cls(
            weight_bytes=total,
            weight_bytes_per_call=total - (0 if tied else embed),
            matmul_params=matmul,
            head_params=hidden * vocab,
            kv_bytes_per_cell=kv_cell,
            attention_flops_per_pair=4 * cfg["num_layers"] * cfg["num_heads"] * cfg["head_dim"],
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float
    memory_seconds: float
    compute_seconds: float
    kv_bytes: float = 0.0  # of `bytes`: the KV cells read and written (the rest: weights)
    attention_flops: float = 0.0  # of `flops`: attention's (the rest: matmuls)

    @property
    def limit_seconds(self) -> float:
        return max(self.memory_seconds, self.compute_seconds)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds >= self.compute_seconds else "compute"


def step_cost(shape: StepShape, num_calls: int, model: ModelCost, limits: MachineLimits) -> StepCost:
    kv_bytes = model.kv_bytes_per_cell * shape.context_cells
    moved = model.weight_bytes_per_call * max(1, num_calls) + kv_bytes
    body = model.matmul_params - model.head_params
    attention_flops = model.attention_flops_per_pair * shape.attention_pairs
    flops = 2 * body * shape.width + 2 * model.head_params * shape.num_sampled + attention_flops
    return StepCost(moved, flops, moved / limits.memory_bandwidth, flops / limits.matmul_flops, kv_bytes,
                    attention_flops)
