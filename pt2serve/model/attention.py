"""Attention over the off-graph cell pool, described entirely by step data.

A step holds T tokens from R sequences. Every sequence's context is a list of cells, one per position,
concatenated into `seq_cells` and delimited by `seq_indptr` (CSR):

    seq_indptr = [0, 5, 7, ...]           sequence r owns seq_cells[seq_indptr[r] : seq_indptr[r+1]]
    seq_cells  = [c0 c1 c2 c3 c4 | d0 d1 | pad pad ...]
                  positions 0..4   0..1    entries past seq_indptr[R] are padding

Token t belongs to sequence token_seq[t] and sits at positions[t]; it sees that sequence's cells at
positions 0..positions[t] (its own K/V was written to its cell before attention runs). Everything is data,
so one compiled graph of fixed shapes serves any mix of sequences and lengths.

This is the plain PyTorch path: it gathers every entry and masks, so its cost grows with the entry
capacity. A kernel that reads the same description and loops only over visible cells can replace
`cell_attention` without changing the contract.
"""

from __future__ import annotations

import torch


def visibility_mask(
    positions: torch.Tensor, token_seq: torch.Tensor, seq_indptr: torch.Tensor, num_entries: int
) -> torch.Tensor:
    """[T, E] bool: may token t attend to entry e of seq_cells."""
    entry = torch.arange(num_entries, device=positions.device, dtype=seq_indptr.dtype)
    num_seqs = seq_indptr.shape[0] - 1
    # The sequence of entry e is the last r with seq_indptr[r] <= e. Searched over the whole indptr, not
    # a slice of it: Inductor's GPU searchsorted ignores a sliced boundary tensor's offset (silently off
    # by one; pytorch/pytorch#182343).
    entry_seq = (torch.searchsorted(seq_indptr, entry, right=True) - 1).clamp(min=0, max=num_seqs - 1)
    entry_pos = entry - seq_indptr[entry_seq]
    is_used = entry < seq_indptr[-1]
    same_seq = token_seq[:, None] == entry_seq[None, :]
    is_causal = entry_pos[None, :] <= positions[:, None]
    return same_seq & is_causal & is_used[None, :]


def cell_attention(
    q: torch.Tensor,  # [T, H, D]
    k_pool: torch.Tensor,  # [C, KVH, D]
    v_pool: torch.Tensor,  # [C, KVH, D]
    seq_cells: torch.Tensor,  # [E]
    mask: torch.Tensor,  # [T, E] from visibility_mask
) -> torch.Tensor:  # [T, H, D]
    """Attention of each token over the cells its mask allows.

    Written as explicit matmuls rather than scaled_dot_product_attention: SDPA's GPU kernels pad the
    mask's last dim, which puts guards on the dynamic entry count that torch.export cannot discharge.
    Query heads sharing a KV head are stacked, so K/V are gathered once per KV head (no repeat).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    k = k_pool.index_select(0, seq_cells).transpose(0, 1)  # [KVH, E, D]
    v = v_pool.index_select(0, seq_cells).transpose(0, 1)
    q = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, T, D]
    q = q.reshape(num_kv_heads, group * num_tokens, head_dim)
    scores = torch.matmul(q, k.transpose(1, 2)) * (head_dim**-0.5)  # [KVH, G*T, E]
    # The most negative finite value, not -inf: a row that sees nothing (never a real token's) then
    # stays finite, so no NaN can reach the pool and spread through 0 * NaN to other tokens' rows.
    scores = scores.view(num_kv_heads, group, num_tokens, -1).masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(num_kv_heads, group * num_tokens, -1), v)  # [KVH, G*T, D]
    return out.view(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)
