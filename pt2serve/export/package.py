"""Writing the .pt2: every method's AOTInductor files, each weight once, metadata and tokenizer.

The file appears at the output path only when complete: it is written beside it under a temporary name
and renamed, so an interrupted export leaves nothing half-written there.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.export.pt2_archive._package import PT2ArchiveWriter, _package_aoti_files

from pt2serve.contract import METADATA_RECORD, TOKENIZER_RECORD, WEIGHTS_PREFIX, content_hash

_EXTRA_DIR = "extra/"


def weights_hash(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> str:
    """The artifact's content hash (contract.CONTENT_HASH_SCHEME): one sha256 per weight, in parallel."""

    def digest(name: str) -> tuple[str, tuple[int, ...], str]:
        tensor = weights[name]
        return dtype_name(tensor.dtype), tuple(tensor.shape), hashlib.sha256(tensor_bytes(tensor)).hexdigest()

    # hashlib releases the GIL on large buffers, so threads hash weights side by side.
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        digests = dict(zip(weights, pool.map(digest, weights)))
    return content_hash(config, digests)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def weight_entries(weights: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [
        {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
         "record": WEIGHTS_PREFIX + name}
        for name, t in sorted(weights.items())
    ]


def write_package(
    output: Path,
    aoti_files: dict[str, list],
    weights: dict[str, torch.Tensor],
    metadata: dict[str, Any],
    tokenizer_json: str | None,
) -> None:
    """Write the package atomically at `output`."""
    fd, tmp_name = tempfile.mkstemp(dir=output.parent or ".", prefix=f".{output.stem}.", suffix=".pt2")
    os.close(fd)
    try:
        with PT2ArchiveWriter(tmp_name) as writer:
            _package_aoti_files(writer, aoti_files)
            for name, tensor in sorted(weights.items()):
                writer.write_bytes(WEIGHTS_PREFIX + name, bytes(tensor_bytes(tensor)))
            writer.write_string(_EXTRA_DIR + METADATA_RECORD, json.dumps(metadata, indent=1))
            if tokenizer_json is not None:
                writer.write_string(_EXTRA_DIR + TOKENIZER_RECORD, tokenizer_json)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp made it private; give it a normal file's mode
        os.replace(tmp_name, output)
    finally:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)
