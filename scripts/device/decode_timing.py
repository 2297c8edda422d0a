"""On a GPU: decode step time of an artifact at a few widths, next to eager PyTorch and the bandwidth floor.

Usage: python scripts/device/decode_timing.py ARTIFACT.pt2 PRESET
       python scripts/device/decode_timing.py --eager-only PRESET   (the eager PyTorch peer alone)
"""

from __future__ import annotations

import sys
import time

import torch

from pt2serve.model.eager import EagerSequence
from pt2serve.model.presets import build_preset_model
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk

CONTEXT = 64
STEPS = 30


def copy_bandwidth() -> float:
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 5 / (time.perf_counter() - started)


def decode_ms(executor: Executor, width: int) -> float:
    greedy = SamplingParams()
    seqs = []
    for i in range(width):
        cells = executor.allocator.allocate(CONTEXT + STEPS + 5)
        executor.step([Chunk(cells, tuple(range(1, CONTEXT + 1)), 0, None)])
        seqs.append(cells)
    position = CONTEXT
    times = []
    for _ in range(STEPS):
        chunks = [Chunk(cells, (7,), position, greedy) for cells in seqs]
        started = time.perf_counter()
        result = executor.step(chunks)  # ends with the token ids on the host: a full sync
        times.append(time.perf_counter() - started)
        assert result.calls[0].method == f"forward_{width}", result.calls
        position += 1
    for cells in seqs:
        executor.allocator.free(cells)
    times.sort()
    return 1000 * times[len(times) // 2]


def eager_decode_ms(preset: str, dtype: torch.dtype) -> float:
    model = build_preset_model(preset, dtype, "cuda").eval()
    seq = EagerSequence(model, CONTEXT + STEPS + 5)
    seq.extend(list(range(1, CONTEXT + 1)))
    times = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        seq.extend([7])[-1].argmax().item()
        times.append(time.perf_counter() - started)
    times.sort()
    return 1000 * times[len(times) // 2]


def main() -> None:
    path, preset = sys.argv[1], sys.argv[2]
    if path == "--eager-only":
        print(f"eager PyTorch {preset} bf16 T=1 (context {CONTEXT}): {eager_decode_ms(preset, torch.bfloat16):.2f} ms/step")
        return
    bandwidth = copy_bandwidth()
    artifact = load_artifact(path)
    executor = Executor(artifact, ExecutorConfig(num_cells=65536))
    mem = executor.memory
    print(f"load {artifact.report.load_seconds:.1f} s; capture {mem.capture_seconds:.1f} s; weights "
          f"{mem.weight_bytes / 1e9:.2f} GB, pool {mem.pool_bytes / 1e9:.2f} GB, graphs {mem.graph_bytes / 1e9:.2f} GB; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    floor_ms = 1000 * mem.weight_bytes / bandwidth
    rows = [(width, decode_ms(executor, width)) for width in (1, 8, 32, 64)]
    del executor, artifact
    torch.cuda.empty_cache()
    eager = eager_decode_ms(preset, torch.bfloat16)
    print(f"{'T':>3} {'ms/step':>8} {'tok/s':>8} {'floor ms':>8} {'of floor':>8}")
    for width, ms in rows:
        print(f"{width:>3} {ms:8.2f} {width * 1000 / ms:8.0f} {floor_ms:8.2f} {floor_ms / ms:8.0%}")
    print(f"eager PyTorch T=1: {eager:.2f} ms/step")


if __name__ == "__main__":
    main()
