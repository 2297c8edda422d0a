"""Log probabilities of tokens, computed on the device from a step's logits, for the rows that ask.

A step's logits exist on the device only between its forward and its sampling (Executor.launch); the rows
whose request asked for log probabilities are scored there: log_softmax, the target token's value and the
`top` most likely tokens. Those few numbers come back with the sampled ids (PendingStep); the logits never
leave the device, and a step in which nobody asked runs none of this.

Two kinds of rows are scored: a sampled row (its target is the token just sampled, still on the device) and
a prompt row (its target is the prompt's next token, known on the host: `echo` with logprobs).

The values are those of the model's own distribution, log_softmax of the raw logits, before temperature,
penalties or masks (as OpenAI and vLLM report them): a request gets the same numbers at any temperature.

This runs as plain torch operations on the device (log_softmax, gather, topk: a few kernels, no host sync),
not as compiled artifact methods: they are the same for every model, need nothing from AOTInductor, and so
every artifact, old ones included, serves them (the artifact format is unchanged). The same holds for the
logits controls (logits.py) and grammar masks (grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this position and theirs, best first


@dataclass(frozen=True)
class ScoredRows:
    """One block of scored rows on the device: each row's chunk (in the step's chunk list) and its top count."""

    chunks: tuple[int, ...]
    tops: tuple[int, ...]
    chosen: torch.Tensor  # [rows] fp32
    top_values: torch.Tensor | None  # [rows, max(tops)] fp32, None when no row wants alternatives
    top_ids: torch.Tensor | None  # [rows, max(tops)] int64

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.chosen, self.top_values, self.top_ids) if t is not None]

    def read(self, host: list[torch.Tensor], targets: list[int]) -> list[TokenLogprob]:
        """The rows as host values, from `host` (copies of `tensors`) and each row's target token."""
        chosen = host[0].tolist()
        values = host[1].tolist() if len(host) > 1 else None
        ids = host[2].tolist() if len(host) > 1 else None
        rows = []
        for row, (target, top) in enumerate(zip(targets, self.tops)):
            alternatives = tuple(zip(ids[row][:top], values[row][:top])) if top else ()
            rows.append(TokenLogprob(target, chosen[row], alternatives))
        return rows


def score(logits: torch.Tensor, targets: torch.Tensor, chunks: list[int], tops: list[int]) -> ScoredRows:
    """Score `logits` [rows, V] at `targets` [rows] (device tensors), keeping max(tops) alternatives."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, targets[:, None]).squeeze(1)
    top = max(tops)
    values = ids = None
    if top:
        values, ids = logp.topk(top, dim=-1)  # sorted, best first
    return ScoredRows(tuple(chunks), tuple(tops), chosen, values, ids)

