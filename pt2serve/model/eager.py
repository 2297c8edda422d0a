"""Eager single-sequence use of the model: the reference that compiled artifacts are checked against."""

from __future__ import annotations

import torch

from pt2serve.model.model import Transformer


class EagerSequence:
    """One sequence with its own private pool; cell i holds position i."""

    def __init__(self, model: Transformer, max_len: int) -> None:
        cfg = model.config
        device, dtype = model.norm.weight.device, model.norm.weight.dtype  # the embedding may be quantized
        shape = (max_len, cfg.num_kv_heads, cfg.head_dim)
        self.model = model
        self.k_pools = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v_pools = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.length = 0

    @torch.no_grad()
    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens; returns the fp32 next-token logits after each of them, [len(tokens), vocab]."""
        device = self.k_pools[0].device
        num = len(tokens)
        positions = torch.arange(self.length, self.length + num, device=device)
        logits = self.model(
            torch.tensor(tokens, device=device),
            positions,
            positions,  # write cells: cell == position
            torch.zeros(num, dtype=torch.int64, device=device),
            torch.tensor([0, self.length + num], device=device),
            torch.arange(self.length + num, device=device),
            torch.arange(num, device=device),
            self.k_pools,
            self.v_pools,
        )
        self.length += num
        return logits


def greedy_generate(model: Transformer, prompt: list[int], num_new: int) -> list[int]:
    """The greedy continuation of `prompt`, one token at a time."""
    seq = EagerSequence(model, len(prompt) + num_new)
    logits = seq.extend(prompt)[-1]
    out: list[int] = []
    for _ in range(num_new):
        token = int(logits.argmax())
        out.append(token)
        logits = seq.extend([token])[-1]
    return out
