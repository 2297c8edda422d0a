"""Acceptance of drafted tokens as plain modules, traced into the artifact's `accept_drafts` (greedy) and
`accept_drafts_sampled` methods.

A speculating sequence runs its pending token and k drafted tokens d1..dk as one chunk; the forward returns a
logit row for each of them. Row j scores the token after the chunk's j-th token, so it judges draft d(j+1),
and the row after the last draft gives one more token whatever happens:

    chunk:   pending  d1   d2  ...  dk
    row:     r0       r1   r2  ...  rk
    judges:  d1       d2   d3  ...  (bonus)

Shapes are static per call: every sequence gets K1 rows (the call's largest k, plus one); `row_index` [S, K1]
names each sequence's rows in the logits (padding repeats a real row), `drafts` [S, K1] holds each sequence's
drafts from column 0 (padding anything), `num_drafts` [S] masks the rest. Output: the number of drafts each
sequence accepted, a, and ids [S, K1] whose first a + 1 entries are what the sequence emits (the accepted
drafts, then the correction or bonus token); the caller ignores the rest.

Sampled acceptance is speculative sampling with deterministic drafts (a proposal that puts all its mass on
the drafted token x): x is accepted with probability p(x), and on rejection the token is drawn from p with x
removed, renormalised, which leaves every emitted token distributed exactly as p (Leviathan et al., 2023).
`accept_with_proposal` is the general rule, min(1, p(x) / q(x)) and the residual max(0, p - q), for a drafter
that samples from a distribution q; the exported method uses the deterministic case, which needs no [S, K1, V]
proposal input. Each row takes two uniform draws, one for the acceptance test and one for its sample, both
from the request's own counter-based stream (keyed by position), so results never depend on the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from pt2serve.model.sampling import blocked_cumsum, kept_sorted_probs


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor) -> torch.Tensor:
    """The distribution the sampler draws each row's token from, in vocabulary order: [R, V] fp32 summing to 1.
    A greedy row (temperature <= 0) is one-hot at its argmax, as sample_argmax picks it."""
    kept, sorted_ids = kept_sorted_probs(logits, temperature, top_p, top_k)
    sampled = torch.zeros_like(kept).scatter(1, sorted_ids, kept / kept.sum(dim=-1, keepdim=True))
    greedy = torch.zeros_like(kept).scatter(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where((temperature <= 0)[:, None], greedy, sampled)


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of [R, V] non-negative weights (any total > 0), drawn with `uniform` [R] in [0, 1)."""
    cdf = blocked_cumsum(probs)
    target = uniform[:, None] * cdf[:, -1:]
    vocab_ids = torch.arange(probs.shape[-1], device=probs.device)
    # Never past the last token with weight: float rounding may put the target at the very top.
    last = torch.where(probs > 0, vocab_ids[None, :], 0).amax(dim=-1)
    return torch.minimum((cdf <= target).sum(dim=-1), last)


def num_leading(accepted: torch.Tensor) -> torch.Tensor:
    """Per row of [S, K1] booleans, how many lead before the first False (at most K1; no scan needed)."""
    columns = torch.arange(accepted.shape[-1], device=accepted.device)
    return torch.where(accepted, accepted.shape[-1], columns[None, :]).amin(dim=-1)


def accept_with_proposal(
    p: torch.Tensor,  # [S, K1, V] target probabilities per row
    q: torch.Tensor,  # [S, K1, V] the drafter's probabilities per row (one-hot for a deterministic draft)
    drafts: torch.Tensor,  # [S, K1] int64
    num_drafts: torch.Tensor,  # [S] int64, each < K1
    accept_uniform: torch.Tensor,  # [S, K1] fp32 in [0, 1)
    sample_uniform: torch.Tensor,  # [S, K1] fp32 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept x with probability min(1, p(x) / q(x)); on rejection draw from
    norm(max(0, p - q)); after the last draft draw from p. Returns (num_accepted [S], ids [S, K1])."""
    num_seqs, width, vocab = p.shape
    columns = torch.arange(width, device=p.device)
    is_draft = columns[None, :] < num_drafts[:, None]
    p_x = p.gather(2, drafts[:, :, None]).squeeze(2)
    q_x = q.gather(2, drafts[:, :, None]).squeeze(2)
    # u < p/q without dividing: q(x) > 0 for a token the drafter proposed.
    accepted = is_draft & (accept_uniform * q_x < p_x)
    residual = torch.where(is_draft[:, :, None], (p - q).clamp(min=0), p)
    # p == q leaves no residual; such a row is never rejected, but keep its draw well defined.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    sampled = inverse_cdf(residual.reshape(num_seqs * width, vocab), sample_uniform.reshape(-1))
    num_accepted = num_leading(accepted)
    ids = torch.where(columns[None, :] < num_accepted[:, None], drafts, sampled.reshape(num_seqs, width))
    return num_accepted, ids


class GreedyAcceptor(nn.Module):
    """Greedy verification: a draft is accepted while it equals the target's argmax."""

    def forward(
        self,
        logits: torch.Tensor,  # [R, V] fp32, the forward's logit rows
        row_index: torch.Tensor,  # [S, K1] int64, rows of `logits`
        drafts: torch.Tensor,  # [S, K1] int64
        num_drafts: torch.Tensor,  # [S] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [S] int64, ids [S, K1] int64
        target = logits.argmax(dim=-1)[row_index]
        columns = torch.arange(drafts.shape[-1], device=drafts.device)
        matches = (drafts == target) & (columns[None, :] < num_drafts[:, None])
        return num_leading(matches), target


class SampledAcceptor(nn.Module):
    """Speculative sampling of deterministic drafts under each sequence's temperature / top-p / top-k (greedy
    sequences, temperature 0, are verified as GreedyAcceptor does)."""

    def forward(
        self,
        logits: torch.Tensor,  # [R, V] fp32
        row_index: torch.Tensor,  # [S, K1] int64
        drafts: torch.Tensor,  # [S, K1] int64
        num_drafts: torch.Tensor,  # [S] int64
        temperature: torch.Tensor,  # [S] fp32
        top_p: torch.Tensor,  # [S] fp32
        top_k: torch.Tensor,  # [S] int64
        accept_uniform: torch.Tensor,  # [S, K1] fp32
        sample_uniform: torch.Tensor,  # [S, K1] fp32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs, width = row_index.shape
        vocab = logits.shape[-1]
        per_row = [t[:, None].expand(num_seqs, width).reshape(-1) for t in (temperature, top_p, top_k)]
        p = target_probs(logits.index_select(0, row_index.reshape(-1)), *per_row)
        flat_drafts = drafts.reshape(-1)
        is_draft = (torch.arange(width, device=drafts.device)[None, :] < num_drafts[:, None]).reshape(-1)
        p_x = p.gather(1, flat_drafts[:, None]).squeeze(1)
        accepted = is_draft & (accept_uniform.reshape(-1) < p_x)
        # The residual of a deterministic draft x: p without x (rows past the drafts: p itself).
        vocab_ids = torch.arange(vocab, device=logits.device)
        residual = torch.where(is_draft[:, None] & (vocab_ids[None, :] == flat_drafts[:, None]), 0.0, p)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
        sampled = inverse_cdf(residual, sample_uniform.reshape(-1)).reshape(num_seqs, width)
        num_accepted = num_leading(accepted.reshape(num_seqs, width))
        columns = torch.arange(width, device=drafts.device)
        return num_accepted, torch.where(columns[None, :] < num_accepted[:, None], drafts, sampled)
