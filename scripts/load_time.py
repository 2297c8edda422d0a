"""How fast an artifact's weights load: the serial loader that came before (one sha256 stream, a bytearray copy
and a synchronous copy per weight) against the runtime's `_load_weights`, on the same file in one run.

Usage: python scripts/load_time.py [--mb 512] [--device cpu|cuda] [--repeats 3] [--artifact A.pt2]
Without --artifact it writes a synthetic package of weight records shaped like a small decoder (two big
embedding-like weights, then layers of projections) into a temporary folder: no compile needed. With one, it
times that artifact's weights. Prints seconds and GB/s per loader (median of the repeats, after one serial
load that brings the file into the page cache) and the ratio. Run from the repository root with PYTHONPATH=.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from pt2serve.contract import WEIGHTS_PREFIX, ContentHasher, content_hash
from pt2serve.runtime.archive import locate_weights as _locate_weights
from pt2serve.runtime.artifact import read_metadata
from pt2serve.runtime.metadata import WEIGHT_DTYPES as _DTYPES, Metadata
from pt2serve.runtime.weights import load_weights as _load_weights

CONFIG = {"architecture": "synthetic", "hidden_size": 1024}


def write_synthetic(path: Path, total_mb: int) -> None:
    """A zip of stored bf16 weight records adding up to about `total_mb` MB, and the metadata that lists them."""
    rng = np.random.default_rng(0)
    hidden = 1024
    shapes = {"embed.weight": [8192, hidden], "lm_head.weight": [8192, hidden]}
    layer_bytes = 2 * hidden * hidden * 12  # q, k, v, o + three 2x-wide MLP projections + two norms (bf16)
    num_layers = max(1, (total_mb * 10**6 - 2 * 2 * 8192 * hidden) // layer_bytes)
    for layer in range(num_layers):
        for proj, shape in (("q", [hidden, hidden]), ("k", [hidden // 4, hidden]), ("v", [hidden // 4, hidden]),
                            ("o", [hidden, hidden]), ("gate", [4 * hidden, hidden]), ("up", [4 * hidden, hidden]),
                            ("down", [hidden, 4 * hidden]), ("norm", [hidden])):
            shapes[f"layers.{layer:02d}.{proj}.weight"] = shape
    entries, digests = [], {}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, shape in sorted(shapes.items()):
            data = rng.integers(0, 256, size=2 * int(np.prod(shape)), dtype=np.uint8).tobytes()
            archive.writestr(f"model/{WEIGHTS_PREFIX}{name}", data)
            entries.append({"name": name, "dtype": "bfloat16", "shape": shape, "record": WEIGHTS_PREFIX + name})
            digests[name] = ("bfloat16", tuple(shape), hashlib.sha256(data).hexdigest())
        meta = {"model_config": CONFIG, "weights": entries, "content_hash": content_hash(CONFIG, digests),
                "content_hash_scheme": 2}
        archive.writestr("model/extra/pt2serve.json", json.dumps(meta))


def serial_load(path: Path, metadata: Metadata, device: torch.device) -> dict[str, torch.Tensor]:
    """The loader before the thread pool, as it was: scheme-1 hash, bytearray copy, then .to(device)."""
    located = {r.name: r for r in _located(path, metadata)}
    hasher = ContentHasher(metadata.raw["model_config"])
    weights = {}
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        for name in sorted(located):
            record = located[name]
            data = memoryview(mapped)[record.offset:record.offset + record.num_bytes]
            host = bytearray(data)
            data.release()
            hasher.update(name, record.dtype_name, record.shape, host)
            weights[name] = torch.frombuffer(host, dtype=torch.uint8).view(record.dtype).reshape(record.shape).to(device)
    hasher.hexdigest()  # (its metadata holds the scheme-2 hash: the work, not the comparison, is what is timed)
    return weights


def _located(path: Path, metadata: Metadata):
    with zipfile.ZipFile(path) as archive:
        by_suffix = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    records = {entry["name"]: by_suffix[entry["record"]] for entry in metadata.raw["weights"]}
    return _locate_weights(path, metadata, records)


def parallel_load(path: Path, metadata: Metadata, device: torch.device) -> dict[str, torch.Tensor]:
    weights, _ = _load_weights(path, metadata, _located(path, metadata), device, True, False)
    return weights


def timed(load, path: Path, metadata: Metadata, device: torch.device, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        load(path, metadata, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", type=Path, help="time this artifact's weights (default: a synthetic one)")
    parser.add_argument("--mb", type=int, default=512, help="size of the synthetic package's weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as folder:
        path = args.artifact
        if path is None:
            path = Path(folder) / "synthetic.pt2"
            write_synthetic(path, args.mb)
        metadata = read_metadata(path) if args.artifact else Metadata(
            json.loads(zipfile.ZipFile(path).read("model/extra/pt2serve.json")))
        num_bytes = sum(_DTYPES[e["dtype"]].itemsize * int(np.prod(e["shape"])) for e in metadata.raw["weights"])
        print(f"{path}: {len(metadata.raw['weights'])} weights, {num_bytes / 1e9:.3f} GB, device {device}, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        serial_load(path, metadata, device)  # warm-up: the file into the page cache, and the device
        before = timed(serial_load, path, metadata, device, args.repeats)
        after = timed(parallel_load, path, metadata, device, args.repeats)
    print("| loader | seconds | GB/s |")
    print("|---|---:|---:|")
    for name, seconds in (("serial (before: one sha256 stream, bytearray, .to)", before),
                          ("thread pool (after: sha256 per weight, read in place)", after)):
        print(f"| {name} | {seconds:.3f} | {num_bytes / seconds / 1e9:.2f} |")
    print(f"speed-up: {before / after:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
