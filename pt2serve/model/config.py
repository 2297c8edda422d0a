"""Model configuration: the fields the decoder needs, parsed from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pt2serve.errors import Pt2ServeError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


# The rope_scaling types implemented (transformers' names); "default" (or no rope_scaling) is plain rope.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies stretch past the pretraining context (config.json's rope_scaling).

    Each type reads the fields its comment names; model.rope_inv_freq turns them into transformers' numbers.
    """

    factor: float
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    # The pretraining context: llama3's and yarn's own field; dynamic's is config.json's max_position_embeddings.
    original_max_position_embeddings: int | None = None
    # Last and "llama3" unless told: artifacts and presets made when llama3 was the only type carry no type.
    rope_type: str = "llama3"
    beta_fast: float = 32.0  # yarn: rotations over the pretraining context above which a frequency is kept
    beta_slow: float = 1.0  # yarn: rotations below which it is divided by the factor (a ramp between)
    truncate: bool = True  # yarn: the ramp starts and ends at whole dimensions
    attention_factor: float = 1.0  # yarn: multiplies cos and sin, so q and k (resolved from mscale when parsed)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise Pt2ServeError(
                f"rope_scaling type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        needs = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "yarn": ("original_max_position_embeddings",),
                 "dynamic": ("original_max_position_embeddings",)}.get(self.rope_type, ())
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise Pt2ServeError(f"rope_scaling type {self.rope_type!r} needs {', '.join(missing)}")

    def to_hf(self) -> dict[str, Any]:
        """The config.json rope_scaling that parses back to this one (and that transformers reads the same)."""
        fields: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            fields.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                          original_max_position_embeddings=self.original_max_position_embeddings)
        if self.rope_type == "yarn":
            fields.update(original_max_position_embeddings=self.original_max_position_embeddings,
                          beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
                          attention_factor=self.attention_factor)
        return fields


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise Pt2ServeError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise Pt2ServeError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def context_length(self) -> int:
        """The longest context the model is for: max_position_embeddings, stretched by linear and dynamic
        scaling (whose configs keep the pretraining length there) and by yarn (its original length times the
        factor), as vLLM reads them. llama3 configs already give the stretched length."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type == "llama3":
            return self.max_position_embeddings
        if scaling.rope_type == "yarn":
            stretched = scaling.original_max_position_embeddings * scaling.factor
        else:
            stretched = self.max_position_embeddings * scaling.factor
        return max(self.max_position_embeddings, int(stretched))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        fields = dict(data)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return cls(**fields)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config.json; refuse what the decoder does not implement."""
        architectures = hf.get("architectures") or []
        if len(architectures) != 1:
            raise Pt2ServeError(
                f"{source}: expected one entry in 'architectures', got {architectures!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise Pt2ServeError(
                f"{source}: unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _refuse_sliding_window(hf, architecture, source)
        if hf.get("mlp_bias"):
            raise Pt2ServeError(f"{source}: mlp_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise Pt2ServeError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            head_dim = hf.get("head_dim") or hidden_size // num_heads
            return cls(
                architecture=architecture,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(_rope_theta(hf)),
                rope_scaling=_rope_scaling(hf, source),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
                qk_norm=architecture == "Qwen3ForCausalLM",
            )
        except KeyError as missing:
            raise Pt2ServeError(f"{source}: missing field {missing.args[0]!r}") from None

    @property
    def weight_count(self) -> int:
        """Number of parameters (embeddings counted once when tied)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * self.head_dim
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


def _rope_theta(hf: dict[str, Any]) -> float:
    if "rope_theta" in hf:
        return hf["rope_theta"]
    # Newer transformers releases nest it under rope_parameters.
    return (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)


def _rope_scaling(hf: dict[str, Any], source: str) -> RopeScaling | None:
    # Older configs name the dict rope_scaling and its type "type"; newer ones rope_parameters and "rope_type".
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise Pt2ServeError(
            f"{source}: rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    max_positions = int(hf.get("max_position_embeddings", 2048))
    # As transformers: llama3 and yarn without their own pretraining context take max_position_embeddings.
    original = int(scaling.get("original_max_position_embeddings") or max_positions)
    if kind == "linear":
        return RopeScaling(float(scaling["factor"]), rope_type=kind)
    if kind == "dynamic":
        return RopeScaling(float(scaling["factor"]), original_max_position_embeddings=max_positions, rope_type=kind)
    if kind == "llama3":
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    # yarn, as transformers: a null factor is the ratio of the two contexts; a null or 0 beta_fast is 32, beta_slow 1.
    factor = float(scaling.get("factor") or max_positions / original)
    return RopeScaling(
        factor,
        original_max_position_embeddings=original,
        rope_type=kind,
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        truncate=bool(scaling.get("truncate", True)),
        attention_factor=_yarn_attention_factor(scaling, factor),
    )


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin multiplier: the config's attention_factor, else the paper's 0.1 ln(factor) + 1 (DeepSeek's
    mscale / mscale_all_dim ratio of two such terms where both are set), as transformers computes it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _refuse_sliding_window(hf: dict[str, Any], architecture: str, source: str) -> None:
    window = hf.get("sliding_window")
    # Qwen configs carry a window that only applies when use_sliding_window is true.
    applies = hf.get("use_sliding_window", architecture == "MistralForCausalLM")
    if window is not None and applies:
        raise Pt2ServeError(
            f"{source}: sliding_window={window} is set, but pt2serve implements full attention only; "
            "use a checkpoint without a sliding window (set sliding_window to null if the model was trained without one)"
        )
