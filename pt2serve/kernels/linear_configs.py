"""The launch configs of the small-M matmul kernels, and the kinds of weight their choices are keyed by.

Plain data without Triton, below everything that uses it: the choice (linear_choice.py, which the model
imports on machines without Triton), the kernels that take a config as their arguments (small_m_linear.py,
quant_linear_triton.py, imported on first use on CUDA) and the tuning at export.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and launch shape of one small-M kernel call."""

    use_dot: bool  # tl.dot on tensor cores, or the gemv kernel's multiply and sum
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1

    @property
    def name(self) -> str:
        return (f"{'dot' if self.use_dot else 'gemv'} m{self.block_m} n{self.block_n} k{self.block_k} "
                f"w{self.num_warps} s{self.num_stages}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QuantLaunchConfig:
    """Tiles and launch shape of one call of the quantized small-M kernel (kernels/quant_linear_triton.py)."""

    use_dot: bool  # tl.dot on tensor cores, or the gemv kernel's multiply and sum
    block_m: int
    block_n: int
    block_bytes: int  # packed bytes of each weight row per step (int4: divides the format's 128-byte block)
    num_warps: int
    num_stages: int
    split_k: int = 1
    # One-row gemv only: each thread loads the x it multiplies straight from global memory (L1), instead of
    # x reaching the threads through shared memory and two barriers per run.
    x_direct: bool = False

    @property
    def name(self) -> str:
        kind = "dot" if self.use_dot else "gemv"
        return (f"{kind} m{self.block_m} n{self.block_n} b{self.block_bytes} w{self.num_warps} "
                f"s{self.num_stages} k{self.split_k}" + (" xd" if self.x_direct else ""))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QuantFormat:
    """What the quantized kernel is specialized on besides the shape: its choices are keyed by it."""

    bits: int
    group_size: int  # as the operator takes it: K for one group per row
    has_zeros: bool
    has_perm: bool

    @property
    def kind(self) -> str:
        """The choice key's kind, e.g. "int4g128-zeros" or "int8g4096"."""
        return f"int{self.bits}g{self.group_size}" + "-zeros" * self.has_zeros + "-perm" * self.has_perm


# FP8 weights (kernels/fp8_linear.py) run the same small-M kernels on e4m3 operands: their own kinds, since
# their timings differ from bf16's at the same shape.
FP8_LINEAR, FP8_SWIGLU = "fp8-linear", "fp8-swiglu"
DENSE_KINDS = ("linear", "swiglu", FP8_LINEAR, FP8_SWIGLU)
