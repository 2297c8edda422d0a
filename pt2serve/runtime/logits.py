"""Sampling controls that change the logits before sampling, applied on the device: penalties, logit_bias and
min_tokens (stop tokens masked out).

    penalized = the token is in the prompt or was generated           (repetition_penalty r)
    logit     = logit / r where penalized and logit > 0, logit * r where penalized and logit <= 0
    logit    -= frequency_penalty * count + presence_penalty * (count > 0)   (count: times generated)
    logit    += logit_bias[token];   logit = -inf for stop tokens while fewer than min_tokens were generated

(vLLM's order and definitions.) The log probabilities a request asks for are of the raw logits, before this.

Penalties depend on every token generated so far, and with one step in flight the host does not know a
request's newest token when it plans the next step. So the counts live on the device: each penalized
request holds a slot, a row of `counts` [slots, V] (times generated) and of `in_prompt` [slots, V], set up
from its prompt at its first sample and bumped by each sampled id right after sampling, in stream order. No
token id makes a round trip through the host. A request's slot is released when it ends (the runner says
so); a step still in flight that samples for it runs before any later step sets the slot up for another.

Only rows that ask pay: a step without these controls returns its logits untouched, with no device work.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pt2serve.runtime.step import Chunk

INITIAL_SLOTS = 8


class LogitsProcessor:
    def __init__(self, vocab_size: int, device: torch.device, to_device: Callable[[np.ndarray], torch.Tensor]):
        self._vocab_size = vocab_size
        self._device = device
        self._to_device = to_device  # host array -> device tensor without waiting (Executor._to_device)
        self._slots: dict[int, int] = {}  # request id -> its row in the tables
        self._free: list[int] = []
        self.counts: torch.Tensor | None = None  # [slots, V] int32, allocated at the first penalized request
        self.in_prompt: torch.Tensor | None = None  # [slots, V] bool

    @property
    def num_slots_held(self) -> int:
        return len(self._slots)

    def apply(self, logits: torch.Tensor, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits to sample from for these rows (a new tensor, or `logits` when no row asks for anything)
        and the slot of each penalized row's request (for count(), None when none is penalized)."""
        penalized = [row for row, chunk in enumerate(chunks) if chunk.sampling.has_penalties]
        biased = [(row, token, value) for row, chunk in enumerate(chunks) for token, value in chunk.sampling.logit_bias]
        banned = [(row, token) for row, chunk in enumerate(chunks) for token in chunk.banned]
        if not (penalized or biased or banned):
            return logits, None
        out = logits.clone()
        slots = None
        if penalized:
            slots = self._penalize(out, [(row, chunks[row]) for row in penalized])
        if biased:
            rows, tokens, values = zip(*biased)
            index = self._to_device(np.array([rows, tokens], dtype=np.int64))
            out.index_put_((index[0], index[1]), self._to_device(np.array(values, dtype=np.float32)),
                           accumulate=True)
        if banned:
            index = self._to_device(np.array(banned, dtype=np.int64).T.copy())
            out.index_put_((index[0], index[1]), torch.tensor(float("-inf"), device=out.device))
        return out, slots

    def count(self, ids: torch.Tensor, chunks: list[Chunk], slots: torch.Tensor | None) -> None:
        """Count each penalized row's sampled id (still on the device) in its request's slot."""
        if slots is None:
            return
        rows = [row for row, chunk in enumerate(chunks) if chunk.sampling.has_penalties]
        row_index = self._to_device(np.array(rows, dtype=np.int64))
        ones = torch.ones(len(rows), dtype=torch.int32, device=ids.device)
        self.counts.index_put_((slots, ids.index_select(0, row_index)), ones, accumulate=True)

    def release(self, request_id: int) -> None:
        """The request ended: its slot may serve another (set up again in a later step)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _penalize(self, out: torch.Tensor, rows: list[tuple[int, Chunk]]) -> torch.Tensor:
        slots = [self._slot(chunk) for _, chunk in rows]
        index = self._to_device(np.array([[row for row, _ in rows], slots], dtype=np.int64))
        params = self._to_device(np.array([[c.sampling.repetition_penalty for _, c in rows],
                                           [c.sampling.frequency_penalty for _, c in rows],
                                           [c.sampling.presence_penalty for _, c in rows]], dtype=np.float32))
        counts = self.counts.index_select(0, index[1])
        generated = counts > 0
        logits = out.index_select(0, index[0])
        repetition = params[0][:, None]
        seen = generated | self.in_prompt.index_select(0, index[1])
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits = logits - params[1][:, None] * counts - params[2][:, None] * generated
        out.index_copy_(0, index[0], logits)
        return index[1]

    def _slot(self, chunk: Chunk) -> int:
        """The request's slot; a new one is set up from its prompt (its first sample: nothing generated yet)."""
        slot = self._slots.get(chunk.request_id)
        if slot is not None:
            return slot
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[chunk.request_id] = slot
        self.counts[slot] = 0
        self.in_prompt[slot] = False
        prompt = self._to_device(np.unique(np.array(chunk.penalty_prompt, dtype=np.int64)))
        self.in_prompt[slot].index_fill_(0, prompt, True)
        return slot

    def _grow(self) -> None:
        held = 0 if self.counts is None else self.counts.shape[0]
        size = max(INITIAL_SLOTS, 2 * held)
        counts = torch.zeros((size, self._vocab_size), dtype=torch.int32, device=self._device)
        in_prompt = torch.zeros((size, self._vocab_size), dtype=torch.bool, device=self._device)
        if held:
            counts[:held] = self.counts
            in_prompt[:held] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(size - 1, held - 1, -1))
