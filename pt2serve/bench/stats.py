"""Small summaries: median and percentiles (linear interpolation), None for an empty sample."""

from __future__ import annotations

from typing import Iterable

import numpy as np

PERCENTILES = (50, 90, 99)


def median(values: Iterable[float]) -> float | None:
    data = [v for v in values if v is not None]
    return float(np.median(data)) if data else None


def summary(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max of the values that are not None."""
    data = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if data.size == 0:
        return {"count": 0, "mean": None, "min": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    result: dict[str, float | int | None] = {"count": int(data.size), "mean": float(data.mean()), "min": float(data.min())}
    for p in PERCENTILES:
        result[f"p{p}"] = float(np.percentile(data, p))
    result["max"] = float(data.max())
    return result
