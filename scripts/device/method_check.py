"""On a GPU: each compiled method against eager PyTorch on the same inputs, to find where they part.

Usage: python scripts/device/method_check.py ARTIFACT.pt2 PRESET (exported from the preset, --quantize or not)
Runs every forward method on a packed mixed step (three sequences with context, plus padding) with a
copy of the pools, and the eager model on another copy; then `sample_argmax` and `sample` against
their eager modules. Prints one row per method: max logit difference, pool difference, argmax agreement.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pt2serve.model.checkpoint import load_model
from pt2serve.model.quant import QuantScheme
from pt2serve.model.sampling import ArgmaxSampler, Sampler
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.cells import allocate_kv_pools
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, pack

NUM_CELLS = 1024


def mixed_step(width: int | None, entries: int | None, rng) -> list[tuple[int, Chunk]]:
    """Three sequences: decode at position 9, a chunk at 4..8, a new prompt; cells 1.. in order."""
    lengths = (1, 5, 3) if width is None or width >= 9 else (1,) * min(width, 3)
    starts = (9, 4, 0)
    chunks, next_cell = [], 1
    for index, (length, start) in enumerate(zip(lengths, starts)):
        cells = np.arange(next_cell, next_cell + start + length, dtype=np.int64)
        next_cell += start + length
        tokens = tuple(int(t) for t in rng.integers(0, 256, length))
        chunks.append((index, Chunk(cells, tokens, start, SamplingParams())))
    return chunks


def main() -> None:
    path, preset = sys.argv[1], sys.argv[2]
    artifact = load_artifact(path)
    meta = artifact.metadata
    device = artifact.device
    record = meta.raw.get("quantization")  # a quantized export is compared with the same quantized model
    scheme = None if record is None else QuantScheme(record["bits"], record["group_size"], record["lm_head"],
                                                     record["embedding"])
    model = load_model(None, preset, meta.kv_dtype, device, quantize=scheme).model
    cache = meta.cache
    rng = np.random.default_rng(0)
    print(f"{'method':>15} {'max |dlogit|':>12} {'max |dpool|':>11} {'argmax equal':>12}")
    for method in [f"forward_{n}" for n in meta.forward_sizes] + ["forward_others"]:
        width = None if method == "forward_others" else int(method.split("_")[1])
        entries = None if width is None else meta.entries_of(width)
        piece = mixed_step(width, entries, rng)
        call = pack(piece, method, width, entries)
        inputs = call.device_inputs(device)
        pools = []
        for _ in range(2):
            storage, k_pools, v_pools = allocate_kv_pools(cache["num_layers"], NUM_CELLS, cache["num_kv_heads"],
                                                          cache["head_dim"], meta.kv_dtype, device)
            storage.normal_(generator=torch.Generator(device).manual_seed(1))  # same random context in both
            pools.append((storage, k_pools, v_pools))
        compiled = artifact.run(method, [*inputs, *pools[0][1], *pools[0][2]])[0]
        with torch.no_grad():
            eager = model(*[t.clone() for t in inputs], pools[1][1], pools[1][2])
        rows = len(call.sampled_chunks)
        dlogit = (compiled[:rows] - eager[:rows]).abs().max().item()
        dpool = (pools[0][0].float() - pools[1][0].float()).abs().max().item()
        same = torch.equal(compiled[:rows].argmax(-1), eager[:rows].argmax(-1))
        print(f"{method:>15} {dlogit:12.2e} {dpool:11.2e} {str(same):>12}")
    for rows in (1, 2, 5):
        logits = torch.randn(rows, meta.vocab_size, device=device)
        got = artifact.run("sample_argmax", [logits])[0]
        print(f"{'sample_argmax':>15} rows={rows} equal: {torch.equal(got, ArgmaxSampler()(logits))}")
        params = [torch.full((rows,), 0.8, device=device), torch.full((rows,), 0.9, device=device),
                  torch.full((rows,), 20, device=device, dtype=torch.int64), torch.rand(rows, device=device)]
        got = artifact.run("sample", [logits, *params])[0]
        print(f"{'sample':>15} rows={rows} equal: {torch.equal(got, Sampler()(logits, *params))}")


if __name__ == "__main__":
    main()
