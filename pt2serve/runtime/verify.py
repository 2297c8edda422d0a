"""Verifying drafted tokens: the inputs of the artifact's acceptance methods for a call's verifying chunks, in
two host arrays (one upload each), and reading the accepted tokens back.

A verifying chunk's logit rows sit consecutively after the call's sampled rows (step.pack); here every chunk
gets K1 = (the call's most drafts) + 1 columns, the padding columns repeating the chunk's last row:

    chunk s with k_s drafts:  row_index[s] = [o_s, o_s + 1, ..., o_s + k_s, o_s + k_s, ...]   (K1 entries)
                              drafts[s]    = [d1, ..., d(k_s), 0, ...],  num_drafts[s] = k_s

Only what each sequence emits comes back: its accepted drafts and one more token (see model/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pt2serve.runtime.step import Chunk, region_offsets, regions


@dataclass(frozen=True)
class AcceptanceInputs:
    """Packed inputs of one acceptance call: int64 and fp32 regions, each laid out by step.region_offsets."""

    num_seqs: int
    width: int  # K1
    ints: np.ndarray  # [ row_index S*K1 | drafts S*K1 | num_drafts S | top_k S ]
    floats: np.ndarray  # [ temperature S | top_p S | accept_uniform S*K1 | sample_uniform S*K1 ]
    is_greedy: bool  # every sequence greedy: the greedy method, which needs only the first three int regions

    @property
    def int_sizes(self) -> tuple[int, ...]:
        cells = self.num_seqs * self.width
        return (cells, cells, self.num_seqs, self.num_seqs)

    @property
    def float_sizes(self) -> tuple[int, ...]:
        cells = self.num_seqs * self.width
        return (self.num_seqs, self.num_seqs, cells, cells)


def acceptance_inputs(chunks: list[Chunk]) -> AcceptanceInputs:
    """The acceptance inputs for `chunks` (verifying chunks, in the order of their logit rows)."""
    num_seqs = len(chunks)
    counts = np.array([len(c.drafts) for c in chunks], dtype=np.int64)
    width = int(counts.max()) + 1
    first_rows = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    columns = np.arange(width)
    is_greedy = all(c.sampling.is_greedy for c in chunks)
    int_sizes = (num_seqs * width, num_seqs * width, num_seqs, num_seqs)
    ints = np.zeros(region_offsets(int_sizes)[1], dtype=np.int64)
    row_index, drafts, num_drafts, top_k = regions(ints, int_sizes)
    row_index[:] = (first_rows[:, None] + np.minimum(columns[None, :], counts[:, None])).reshape(-1)
    drafts.reshape(num_seqs, width)[columns[None, :] < counts[:, None]] = [t for c in chunks for t in c.drafts]
    num_drafts[:] = counts
    top_k[:] = [c.sampling.top_k for c in chunks]
    float_sizes = (num_seqs, num_seqs, num_seqs * width, num_seqs * width)
    floats = np.zeros(region_offsets(float_sizes)[1], dtype=np.float32)
    temperature, top_p, accept_uniform, sample_uniform = regions(floats, float_sizes)
    temperature[:] = [c.sampling.temperature for c in chunks]
    top_p[:] = [c.sampling.top_p for c in chunks]
    if not is_greedy:  # (a chunk behind a verify: the draws for all of that one's drafts accepted, see Chunk)
        accept_uniform.reshape(num_seqs, width)[columns[None, :] < counts[:, None]] = [
            u for c in chunks for u in c.accept_uniforms[c.draw_window:]]
        sample_uniform.reshape(num_seqs, width)[columns[None, :] <= counts[:, None]] = [
            u for c in chunks for u in c.sample_uniforms[c.draw_window:]]
    return AcceptanceInputs(num_seqs, width, ints, floats, is_greedy)


def emitted_tokens(num_accepted: list[int], ids: list[list[int]]) -> list[tuple[int, ...]]:
    """Per sequence, the tokens it emits: its accepted drafts and the token after them."""
    return [tuple(row[:count + 1]) for count, row in zip(num_accepted, ids)]
