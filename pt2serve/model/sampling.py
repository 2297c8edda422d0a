"""On-device sampling as plain modules, traced into the artifact's `sample` and `sample_argmax` methods.

Sampling is a pure function of the logits, each row's parameters and one uniform draw per row. The draw
comes from the request's own seeded generator (host side), so a request's tokens never depend on what
else shares its step.
"""

from __future__ import annotations

import torch
from torch import nn


SCAN_BLOCK = 256


def blocked_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum over the last dim of [rows, width], as triangular matmuls over blocks of 256.

    Same result as x.cumsum(-1) up to float rounding. Written without a scan on purpose: Inductor on
    torch 2.11 fails to generate code for a long scan over a vocabulary-sized dim with a dynamic row
    count (its split-scan path), and two small matmuls cost nothing next to the sort.
    """
    rows, width = x.shape
    num_blocks = (width + SCAN_BLOCK - 1) // SCAN_BLOCK
    blocks = torch.nn.functional.pad(x, (0, num_blocks * SCAN_BLOCK - width)).view(rows, num_blocks, SCAN_BLOCK)
    upper = torch.ones(SCAN_BLOCK, SCAN_BLOCK, device=x.device, dtype=x.dtype).triu()
    within = torch.matmul(blocks, upper)  # within[.., j] = sum of the block's first j + 1 entries
    totals = within[:, :, -1]
    strictly_upper = torch.ones(num_blocks, num_blocks, device=x.device, dtype=x.dtype).triu(diagonal=1)
    offsets = torch.matmul(totals, strictly_upper)  # mass of all earlier blocks
    return (within + offsets[:, :, None]).reshape(rows, num_blocks * SCAN_BLOCK)[:, :width]


def kept_sorted_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities in descending order with only its top-k / top-p tokens kept (not renormalised),
    and the token id at each rank. [R, V] logits, per-row parameters -> ([R, V] fp32, [R, V] int64)."""
    vocab = logits.shape[-1]
    is_greedy = temperature <= 0
    scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature)[:, None]
    # Stable descending sort: equal logits keep index order, which a host reference can reproduce.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    mass_before = blocked_cumsum(probs) - probs
    # Keep the top k, and of those the shortest prefix whose mass reaches top_p (rank 0 always).
    keep = (rank[None, :] < k[:, None]) & ((mass_before < top_p[:, None]) | (rank[None, :] == 0))
    return probs * keep, sorted_ids


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [R, V] fp32
        temperature: torch.Tensor,  # [R] fp32; <= 0 means greedy
        top_p: torch.Tensor,  # [R] fp32 in (0, 1]
        top_k: torch.Tensor,  # [R] int64; <= 0 means no limit
        uniform: torch.Tensor,  # [R] fp32 in [0, 1)
    ) -> torch.Tensor:  # [R] int64
        kept, sorted_ids = kept_sorted_probs(logits, temperature, top_p, top_k)
        cdf = blocked_cumsum(kept)
        target = uniform[:, None] * cdf[:, -1:]
        # Inverse CDF: the first rank whose cumulative mass passes the draw, never past the kept ones.
        choice = torch.minimum((cdf <= target).sum(dim=-1), (kept > 0).sum(dim=-1) - 1)
        sampled = sorted_ids.gather(1, choice[:, None]).squeeze(1)
        return torch.where(temperature <= 0, logits.argmax(dim=-1), sampled)


class ArgmaxSampler(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
        return logits.argmax(dim=-1)
