"""Attention over the off-graph cell pool, described entirely by step data.

A step holds T tokens from R sequences. Every sequence's context is a list of cells, one per position,
concatenated into `seq_cells` and delimited by `seq_indptr` (CSR):

    seq_indptr = [0, 5, 7, ...]           sequence r owns seq_cells[seq_indptr[r] : seq_indptr[r+1]]
    seq_cells  = [c0 c1 c2 c3 c4 | d0 d1 | pad pad ...]
                  positions 0..4   0..1    entries past seq_indptr[R] are padding

Token t belongs to sequence token_seq[t] and sits at positions[t]; it sees that sequence's cells at
positions 0..positions[t] (its own K/V was written to its cell before attention runs). Everything is data,
so one compiled graph of fixed shapes serves any mix of sequences and lengths.

Two implementations read this description (pt2serve/kernels/cell_attention.py):
- KERNEL, the Triton operator: each token reads only its own sequence's cells, so a static method's
  entry capacity bounds an index buffer, not compute (GPU artifacts);
- MASKED, plain PyTorch: gathers every entry and masks, so its cost grows with the entry capacity
  (CPU artifacts, and the reference the kernel is tested against).
Deterministic artifacts (`export --deterministic`, `deterministic_context` set to the max context) take each
one's batch-invariant form: the kernel's launch config that walks a token's cells in the same segments and
blocks at every call site, and, for MASKED, a window of the token's own positions.
Whatever the step needs beyond the per-layer tensors is derived once per step, here, not in every layer.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

import torch

from pt2serve.kernels import cell_attention as ops


class AttentionImpl(str, Enum):
    KERNEL = "kernel"
    MASKED = "masked"


class StepAttention:
    """One step's attention: built once from the step data, called by every layer with its q and pools."""

    def __init__(
        self,
        impl: AttentionImpl,
        num_heads: int,
        num_kv_heads: int,
        positions: torch.Tensor,  # [T]
        token_seq: torch.Tensor,  # [T]
        seq_indptr: torch.Tensor,  # [R+1]
        seq_cells: torch.Tensor,  # [E]
        deterministic_context: int | None = None,  # the max context of a deterministic artifact, else None
        fp8_cells: bool = False,  # the pools hold e4m3 cells (their kernel config differs)
    ) -> None:
        self.impl = impl
        self.positions, self.token_seq, self.seq_indptr, self.seq_cells = positions, token_seq, seq_indptr, seq_cells
        self.deterministic_context = deterministic_context
        if impl is AttentionImpl.KERNEL:
            num_seqs = seq_indptr.shape[0] - 1
            self.query_indptr = ops.query_indptr(token_seq, num_seqs)
            self.config = ops.call_site_config(positions.shape[0], num_seqs, num_heads, num_kv_heads,
                                               deterministic_context, fp8_cells)
            self.block_seq_end = ops.block_sequence_ends(
                self.query_indptr, self.config.num_blocks(positions.shape[0], num_seqs), self.config.block_q
            )
        elif deterministic_context is None:
            self.mask = ops.visibility_mask(positions, token_seq, seq_indptr, seq_cells.shape[0])

    def __call__(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]; FP8 pools come with their per-KV-head scales (model/kv_fp8.py)."""
        if self.impl is AttentionImpl.KERNEL:
            return torch.ops.pt2serve.cell_attention(
                q, k_pool, v_pool, self.positions, self.token_seq, self.query_indptr, self.seq_indptr,
                self.seq_cells, self.block_seq_end, *dataclasses.astuple(self.config), k_scale, v_scale,
            )
        if self.deterministic_context is not None:
            return ops.window_cell_attention(q, k_pool, v_pool, self.positions, self.token_seq, self.seq_indptr,
                                             self.seq_cells, self.deterministic_context, k_scale, v_scale)
        return ops.masked_cell_attention(q, k_pool, v_pool, self.seq_cells, self.mask, k_scale, v_scale)
