#!/usr/bin/env python3
"""Which ways of cutting a step change one sequence's logits, bit for bit? (the groundwork of a deterministic mode)

    python scripts/batch_invariance.py ARTIFACT [--seed 0]

One sequence's row is computed many ways: a decode alone at each static width, beside other decodes (before
and after it), through forward_others with and without company, and its prompt prefilled whole, in chunks, or
with all but its last token computed earlier (what a prefix-cache hit does). Every way is compared with the first
and the second way of its table; last, whether the K/V cells a prompt's prefill writes are the same bits however
it was chunked.

The pool starts as random context (cells the sequence reads but did not write are the same in every run), so a
difference comes from the arithmetic alone: which kernels ran and in what order each row's sums were taken.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.cells import allocate_kv_pools
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, pack

NUM_CELLS = 8192
PROMPT_TOKENS = 41  # the sequence's prompt: cells 1..41
OTHERS_FROM = 100  # other sequences' cells start here, 70 apiece


class Runs:
    """Runs one method call at a time on a copy (or a given state) of one random pool."""

    def __init__(self, path: str, seed: int) -> None:
        self.artifact = load_artifact(path)
        meta = self.artifact.metadata
        cache = meta.cache
        self.device = self.artifact.device
        self.storage, k_pools, v_pools = allocate_kv_pools(cache["num_layers"], NUM_CELLS, cache["num_kv_heads"],
                                                           cache["head_dim"], meta.kv_dtype, self.device)
        self.views = [(p.stride(), p.storage_offset(), p.shape) for p in (*k_pools, *v_pools)]
        random = torch.randn(self.storage.shape, generator=torch.Generator().manual_seed(seed))
        self.storage.copy_(random.to(self.device))
        self.rng = np.random.default_rng(seed)
        self.vocab = meta.raw["vocab_size"]

    def pools(self, storage: torch.Tensor) -> list[torch.Tensor]:
        return [storage.as_strided(shape, stride, offset) for stride, offset, shape in self.views]

    def logits(self, chunks: list[Chunk], width: int | None, storage: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled chunks' logit rows, in order; `storage` is written in place when given."""
        method = "forward_others" if width is None else f"forward_{width}"
        call = pack(list(enumerate(chunks)), method, width)
        if width is not None:
            call = call.padded(self.artifact.metadata.entries_of(width))
        state = self.storage.clone() if storage is None else storage
        out = self.artifact.run(method, [*call.device_inputs(self.device), *self.pools(state)])[0]
        return out[:len(call.sampled_chunks)].float().cpu()

    def others(self, count: int) -> list[Chunk]:
        """`count` decodes of other sequences at random positions over random context."""
        return [decode(OTHERS_FROM + 70 * i, int(self.rng.integers(5, 60)), int(self.rng.integers(0, self.vocab)))
                for i in range(count)]


def decode(first_cell: int, position: int, token: int) -> Chunk:
    return prompt_chunk(first_cell, position, [token])


def prompt_chunk(first_cell: int, start: int, tokens: list[int], sample: bool = True) -> Chunk:
    cells = np.arange(first_cell, first_cell + start + len(tokens), dtype=np.int64)
    return Chunk(cells, tuple(tokens), start, SamplingParams() if sample else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = Runs(args.artifact, args.seed)
    widths = runs.artifact.metadata.forward_sizes
    target = decode(1, PROMPT_TOKENS - 1, 7)  # reads cells 1..40 of random context
    rows: dict[str, torch.Tensor] = {}
    for width in widths:
        rows[f"decode alone, forward_{width}"] = runs.logits([target], width)[0]
        if width > 1:
            rows[f"decode first of {width}, forward_{width}"] = runs.logits([target, *runs.others(width - 1)], width)[0]
            rows[f"decode last of {width}, forward_{width}"] = runs.logits([*runs.others(width - 1), target], width)[-1]
    rows["decode alone, forward_others"] = runs.logits([target], None)[0]
    rows["decode first of 4, forward_others"] = runs.logits([target, *runs.others(3)], None)[0]

    prompt = [int(t) for t in runs.rng.integers(0, runs.vocab, PROMPT_TOKENS)]
    prompts, written = {}, {}
    for name, cuts in (("whole", [PROMPT_TOKENS]), ("17 + 24", [17, 24]), ("40 + 1 (a cached prefix)", [40, 1])):
        state, start = runs.storage.clone(), 0
        for number, length in enumerate(cuts):
            last = number == len(cuts) - 1
            row = runs.logits([prompt_chunk(1, start, prompt[start:start + length], sample=last)], None, state)
            start += length
        prompts[f"prompt {name}"], written[name] = row[0], state

    print(table("a decode at position 40", rows))
    print(table("the logits after a 41-token prompt, forward_others", prompts))
    cells = slice(1, PROMPT_TOKENS + 1)
    for name, state in written.items():
        same = all(torch.equal(a[cells], b[cells]) for a, b in zip(runs.pools(written["whole"]), runs.pools(state)))
        print(f"the prompt's K/V cells, prefilled {name}: {'the same bits' if same else 'different'} as whole")


def table(what: str, rows: dict[str, torch.Tensor]) -> str:
    """Each row against the first and the second: bitwise equal, and the largest difference."""
    names = list(rows)
    first, second = rows[names[0]], rows[names[min(1, len(names) - 1)]]
    lines = [f"\n{what}", f"| way | = {names[0]} | max abs diff | = {names[min(1, len(names) - 1)]} |",
             "|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {torch.equal(row, first)} | {(row - first).abs().max().item():.2e} | "
                     f"{torch.equal(row, second)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
