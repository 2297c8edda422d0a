"""Per-request sampling parameters and the request's own random stream.

Penalties, logit_bias and min_tokens change the logits before sampling (on the device: logits.py).

The device sampler (the artifact's `sample` method) is a pure function of logits, parameters and one
uniform draw per row; the draws come from here, keyed by the request's seed and the token's position, so a
request's tokens do not depend on what else shares its steps.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from pt2serve.errors import Pt2ServeError

MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None  # None: drawn from the OS
    presence_penalty: float = 0.0  # subtracted from a token's logit once it was generated
    frequency_penalty: float = 0.0  # subtracted once per time it was generated
    repetition_penalty: float = 1.0  # a prompt or generated token's logit divided (> 0) or multiplied (< 0) by it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, value added to its logit)
    min_tokens: int = 0  # stop tokens are masked out until this many tokens were generated

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise Pt2ServeError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise Pt2ServeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise Pt2ServeError(f"top_k must be >= 0 (0 means no limit), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise Pt2ServeError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise Pt2ServeError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise Pt2ServeError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
        if any(not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS for _, value in self.logit_bias):
            raise Pt2ServeError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
        if self.min_tokens < 0:
            raise Pt2ServeError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Its logits depend on the tokens so far (the device keeps its counts)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class DrawPurpose(enum.IntEnum):
    """What a uniform draw decides; each purpose is its own stream, so uses never share a draw."""

    SAMPLE = 0  # the token sampled at a position (plain sampling, or a correction / bonus after drafts)
    ACCEPT = 1  # whether the draft at a position is accepted


_MASK_64 = (1 << 64) - 1
_UNIFORM_BITS = 24  # an fp32 holds every multiple of 2**-24 in [0, 1) exactly, so a draw never rounds up to 1


def _mix64(value: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit integers whose output bits all depend on every input bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK_64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK_64
    return value ^ (value >> 31)


class RequestRandom:
    """A request's own random draws, counter-based: uniform(position, purpose) is a pure function of the seed,
    the token position it decides and its purpose. So a request's tokens do not depend on what shared its
    steps nor on how many tokens a step produced for it (speculation emits several at once)."""

    def __init__(self, seed: int | None) -> None:
        self._key = _mix64((seed if seed is not None else random.SystemRandom().getrandbits(64)) & _MASK_64)

    def uniform(self, position: int, purpose: DrawPurpose = DrawPurpose.SAMPLE) -> float:
        """A draw in [0, 1) for the token at `position` (its index in the request's tokens)."""
        counter = _mix64(self._key ^ _mix64(position * 2 + int(purpose)))
        return (counter >> (64 - _UNIFORM_BITS)) / (1 << _UNIFORM_BITS)
