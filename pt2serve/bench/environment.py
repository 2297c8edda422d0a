"""Where a benchmark ran: the machine, the device and the software versions, for the JSON report."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import numpy as np
import torch

import pt2serve


def machine_info(device: str | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu_name": None,
        "gpu_count": 0,
    }
    if torch.cuda.is_available():
        index = torch.device(device).index if device and device.startswith("cuda") else None
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_name"] = torch.cuda.get_device_name(index or 0)
    return info


def versions() -> dict[str, Any]:
    return {
        "pt2serve": pt2serve.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
    }


def artifact_summary(path: str | None, raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """The artifact's metadata, with the per-weight list and the tokenizer reduced to counts."""
    if raw is None:
        return None
    meta = {key: value for key, value in raw.items() if key not in ("weights", "tokenizer")}
    meta["num_weights"] = len(raw.get("weights", []))
    meta["has_tokenizer"] = bool(raw.get("tokenizer"))
    return {"path": path, "metadata": meta}
