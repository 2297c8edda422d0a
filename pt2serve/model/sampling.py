"""On-device sampling as plain modules, traced into the artifact's `sample` and `sample_argmax` methods.

Sampling is a pure function of the logits, each row's parameters and one uniform draw per row. The draw
comes from the request's own seeded generator (host side), so a request's tokens never depend on what
else shares its step.
"""

from __future__ import annotations

import torch
from torch import nn


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,  # [R, V] fp32
        temperature: torch.Tensor,  # [R] fp32; <= 0 means greedy
        top_p: torch.Tensor,  # [R] fp32 in (0, 1]
        top_k: torch.Tensor,  # [R] int64; <= 0 means no limit
        uniform: torch.Tensor,  # [R] fp32 in [0, 1)
    ) -> torch.Tensor:  # [R] int64
        vocab = logits.shape[-1]
        is_greedy = temperature <= 0
        scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature)[:, None]
        # Stable descending sort: equal logits keep index order, which a host reference can reproduce.
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(dim=-1)
        rank = torch.arange(vocab, device=logits.device)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the top k, and of those the shortest prefix whose mass reaches top_p (rank 0 always).
        keep = (rank[None, :] < k[:, None]) & ((mass_before < top_p[:, None]) | (rank[None, :] == 0))
        cdf = (probs * keep).cumsum(dim=-1)
        target = uniform[:, None] * cdf[:, -1:]
        # Inverse CDF: the first rank whose cumulative mass passes the draw, never past the kept ones.
        choice = torch.minimum((cdf <= target).sum(dim=-1), keep.sum(dim=-1) - 1)
        sampled = sorted_ids.gather(1, choice[:, None]).squeeze(1)
        return torch.where(is_greedy, logits.argmax(dim=-1), sampled)


class ArgmaxSampler(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
        return logits.argmax(dim=-1)
