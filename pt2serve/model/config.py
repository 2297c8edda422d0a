"""Model configuration: the fields the decoder needs, parsed from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pt2serve.errors import Pt2ServeError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_scaling.rope_type == "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise Pt2ServeError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3')")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _refuse_sliding_window(hf: dict[str, Any], architecture: str, source: str) -> None:
    window = hf.get("sliding_window")
    # Qwen configs carry a window that only applies when use_sliding_window is true.
    applies = hf.get("use_sliding_window", architecture == "MistralForCausalLM")
    if window is not None and applies:
        raise Pt2ServeError(
            f"{source}: sliding_window={window} is set, but pt2serve implements full attention only; "
            "use a checkpoint without a sliding window (set sliding_window to null if the model was trained without one)"
        )
