"""One sequence's logit row computed many ways, bit for bit: the measurement behind deterministic artifacts
(scripts/batch_invariance.py prints its table; tests/test_deterministic.py asserts on it).

Each way is one method call on a copy of (or on a given state of) one pool of random context, so the cells a
sequence reads but did not write are the same in every run, and a difference comes from the arithmetic alone:
which kernels ran and in what order each row's sums were taken.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.cells import allocate_kv_pools
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, pack

NUM_CELLS = 8192
OTHERS_FROM = 100  # other sequences' cells start here, 70 apiece (a sequence of ours keeps below)
OTHER_CELLS = 70


class PoolRuns:
    """Runs one method call at a time on a copy (or a given state) of one random pool."""

    def __init__(self, path: str | Path, seed: int) -> None:
        self.artifact = load_artifact(path)
        meta = self.artifact.metadata
        cache = meta.cache
        self.device = self.artifact.device
        self.storage, k_pools, v_pools = allocate_kv_pools(cache["num_layers"], NUM_CELLS, cache["num_kv_heads"],
                                                           cache["head_dim"], meta.kv_dtype, self.device)
        self.views = [(p.stride(), p.storage_offset(), p.shape) for p in (*k_pools, *v_pools)]
        random = torch.randn(self.storage.shape, generator=torch.Generator().manual_seed(seed))
        self.storage.copy_(random.to(self.storage.dtype).to(self.device))
        self.rng = np.random.default_rng(seed)
        self.vocab = meta.vocab_size

    def pools(self, storage: torch.Tensor) -> list[torch.Tensor]:
        return [storage.as_strided(shape, stride, offset) for stride, offset, shape in self.views]

    def fresh_state(self) -> torch.Tensor:
        """A copy of the random pool, for ways that write cells and read them back."""
        return self.storage.clone()

    def logits(self, chunks: list[Chunk], width: int | None, storage: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled chunks' logit rows, in order, from forward_{width} (None: forward_others); `storage` is
        written in place when given, else a copy of the random pool."""
        method = "forward_others" if width is None else f"forward_{width}"
        call = pack(list(enumerate(chunks)), method, width)
        if width is not None:
            call = call.padded(self.artifact.metadata.entries_of(width))
        state = self.fresh_state() if storage is None else storage
        out = self.artifact.run(method, [*call.device_inputs(self.device), *self.pools(state)])[0]
        return out[:len(call.sampled_chunks)].float().cpu()

    def others(self, count: int) -> list[Chunk]:
        """`count` decodes of other sequences at random positions over random context."""
        return [decode(OTHERS_FROM + OTHER_CELLS * i, int(self.rng.integers(5, OTHER_CELLS - 10)),
                       int(self.rng.integers(0, self.vocab))) for i in range(count)]

    def random_tokens(self, count: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab, count)]

    def prefill(self, prompt: list[int], cuts: list[int], width: int | None = None,
                state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt (cells 1 ..) prefilled in chunks of these lengths, in order, alone on forward_{width}:
        the last chunk's logit row and the pool state the chunks wrote."""
        assert sum(cuts) == len(prompt)
        state, start = (self.fresh_state() if state is None else state), 0
        for number, length in enumerate(cuts):
            last = number == len(cuts) - 1
            row = self.logits([prompt_chunk(1, start, prompt[start:start + length], sample=last)], width, state)
            start += length
        return row[0], state

    def cells_of(self, state: torch.Tensor, count: int) -> list[torch.Tensor]:
        """Cells 1 .. count of every pool: a prompt's K/V written in `state`."""
        return [pool[1:count + 1] for pool in self.pools(state)]


def decode(first_cell: int, position: int, token: int) -> Chunk:
    return prompt_chunk(first_cell, position, [token])


def prompt_chunk(first_cell: int, start: int, tokens: list[int], sample: bool = True) -> Chunk:
    """The chunk of a sequence whose positions 0 .. live in consecutive cells from first_cell."""
    cells = np.arange(first_cell, first_cell + start + len(tokens), dtype=np.int64)
    return Chunk(cells, tuple(tokens), start, SamplingParams() if sample else None)


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
