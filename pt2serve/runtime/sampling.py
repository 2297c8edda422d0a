"""Per-request sampling parameters and the request's own random stream.

The device sampler (the artifact's `sample` method) is a pure function of logits, parameters and one
uniform draw per row; the draws come from here, one generator per request, so a request's tokens do not
depend on what else shares its steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pt2serve.errors import Pt2ServeError

MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None  # None: drawn from the OS

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise Pt2ServeError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise Pt2ServeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise Pt2ServeError(f"top_k must be >= 0 (0 means no limit), got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class RequestRandom:
    """A request's own stream of uniform draws in [0, 1), one per sampled token."""

    def __init__(self, seed: int | None) -> None:
        self._random = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))

    def next_uniform(self) -> float:
        return self._random.random()
