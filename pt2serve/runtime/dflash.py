"""DFlash drafting at run time: the draft's cell pool, its context written with every forward, and blocks
drafted for the speculating sequences in static calls (captured in CUDA graphs on the GPU). The executor
drafts as it launches a verifying step, and the drafts stay on the device (drafter.py).

The draft pool (see contract.py) mirrors the target's cells, then holds block_size block cells per slot of
the widest draft method:

    draft cells:  [ 0 .. target cells - 1: context of the position whose target cell has that id | slot 0's
                    block | slot 1's block | ... ]

Every forward's taps go through `draft_context` into the cells the forward wrote (executor.py calls
`write_context` right after it, inside the same graph for static widths). Rejected drafts' cells are freed
by the scheduler like the target's, and their draft context is rewritten when the position is computed
again. A drafting call for S sequences packs, per sequence, its newest known token and its context cells
followed by its slot's block cells:

    [ last_tokens S | seq_indptr S+1 | seq_cells E ]    one int64 host array, regions as in step.py

Padding slots have no context: they read and write only their own block cells. The last tokens are copied
in on the device (a sequence's may be the sample of the step in flight); a sequence planned behind a verify
in flight lists its context for all of that verify's drafts accepted, and the call's index is laid out again
on the device once the verify's shortfall is known there (`_shorten`).
"""

from __future__ import annotations

import numpy as np
import torch

from pt2serve.contract import DRAFT_CONTEXT, SCRATCH_CELL, draft_name
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.artifact import Artifact
from pt2serve.runtime.cells import allocate_kv_pools
from pt2serve.runtime.drafter import DraftRequest
from pt2serve.runtime.graphs import CapturedForward
from pt2serve.runtime.step import region_offsets, regions


class DFlashDrafter:
    """The artifact's DFlash draft on the device: owns its cell pool and its captured draft methods."""

    def __init__(self, artifact: Artifact, num_target_cells: int, use_cuda_graphs: bool) -> None:
        meta = artifact.metadata
        draft = meta.draft
        if draft is None:
            raise Pt2ServeError("this artifact has no DFlash draft: export it with --draft DIR (a DFlash draft "
                                "checkpoint) to speculate with dflash, or use --speculate ngram")
        self.artifact = artifact
        self.block_size: int = draft["block_size"]
        self.sizes: tuple[int, ...] = tuple(draft["sizes"])
        self.num_entries = {n: meta.raw["methods"][draft_name(n)]["num_entries"] for n in self.sizes}
        self.first_block_cell = num_target_cells
        num_cells = num_target_cells + max(self.sizes) * self.block_size
        cache = draft["cache"]
        self._storage, k_pools, v_pools = allocate_kv_pools(
            cache["num_layers"], num_cells, cache["num_kv_heads"], cache["head_dim"], meta.kv_dtype, artifact.device)
        self.pools = [*k_pools, *v_pools]
        graph_pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None
        self._methods = {}
        for num_seqs in sorted(self.sizes, reverse=True):  # widest first: the graphs share one memory pool
            host, sizes = self._pack([], num_seqs)
            self._methods[num_seqs] = CapturedForward(artifact.run, draft_name(num_seqs), host, sizes, self.pools,
                                                      artifact.device, graph_pool)

    @property
    def pool_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, write_cells: torch.Tensor) -> None:
        """Project a forward's tapped hidden states into the draft cells of its tokens (queued, in place)."""
        self.artifact.run(DRAFT_CONTEXT, [taps, positions, write_cells, *self.pools])

    def draft_on_device(self, requests: list[DraftRequest], last_tokens: torch.Tensor,
                        shortfall: torch.Tensor | None) -> torch.Tensor:
        """Each request's block drafted: [len(requests), block_size - 1], the argmax of its block's positions
        1 .. block_size - 1, on the device (queued; nothing waits for it). See drafter.DeviceDrafter."""
        outputs, at = [], 0
        for group in self._groups(requests):
            num_seqs = self._size_for(group)
            method = self._methods[num_seqs]
            host, _ = self._pack(group, num_seqs)
            method.load(host)
            method.inputs[0][:len(group)].copy_(last_tokens[at:at + len(group)])
            if shortfall is not None:
                self._shorten(method.inputs, group, num_seqs, shortfall[at:at + len(group)])
            # Under a graph the output is a fixed buffer that the next replay overwrites: keep a copy.
            outputs.append(method.run()[: len(group)].clone())
            at += len(group)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _shorten(self, inputs: list[torch.Tensor], group: list[DraftRequest], num_seqs: int,
                 shortfall: torch.Tensor) -> None:
        """Lay a loaded call's index out again on the device, each context `shortfall` cells shorter (<= 0): the
        same layout as _pack, from the listed cells."""
        _, indptr, seq_cells = inputs
        block = self.block_size
        width = max(num_seqs, max(len(r.cells) for r in group))
        table = np.zeros((num_seqs + 1, width), dtype=np.int64)  # each slot's listed cells; then their counts
        for slot, request in enumerate(group):
            table[slot, :len(request.cells)] = request.cells
            table[num_seqs, slot] = len(request.cells)
        table = torch.from_numpy(table)
        if seq_cells.device.type == "cuda":
            table = table.pin_memory().to(seq_cells.device, non_blocking=True)
        context = table[num_seqs, :num_seqs].clone()
        context[:len(group)] += shortfall
        ends = torch.cumsum(context + block, 0)
        indptr[1:].copy_(ends)
        entry = torch.arange(seq_cells.shape[0], device=seq_cells.device)
        slot = torch.searchsorted(ends, entry, right=True).clamp(max=num_seqs - 1)
        local = entry - (ends[slot] - block - context[slot])
        in_context = local < context[slot]
        cells = torch.where(in_context, table[slot, local.clamp(0, width - 1)],
                            self.first_block_cell + slot * block + local - context[slot])
        seq_cells.copy_(torch.where(entry < ends[-1], cells, SCRATCH_CELL))

    def _groups(self, requests: list[DraftRequest]) -> list[list[DraftRequest]]:
        """Consecutive groups, each as many sequences as one call holds (by slots and by entry capacity)."""
        groups, rest = [], list(requests)
        while rest:
            take = min(len(rest), max(self.sizes))
            while take > 1 and not self._fits(rest[:take]):
                take -= 1
            groups.append(rest[:take])
            rest = rest[take:]
        return groups

    def _size_for(self, group: list[DraftRequest]) -> int:
        return min(n for n in self.sizes if n >= len(group))

    def _fits(self, group: list[DraftRequest]) -> bool:
        num_seqs = self._size_for(group)
        return sum(len(r.cells) for r in group) + num_seqs * self.block_size <= self.num_entries[num_seqs]

    def _pack(self, group: list[DraftRequest], num_seqs: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """The packed inputs of one `draft_{num_seqs}` call for `group` (slots past it are padding)."""
        block = self.block_size
        sizes = (num_seqs, num_seqs + 1, self.num_entries[num_seqs])
        host = np.zeros(region_offsets(sizes)[1], dtype=np.int64)
        _, indptr, seq_cells = regions(host, sizes)  # (the last tokens are copied in on the device)
        at = 0
        for slot in range(num_seqs):
            context = group[slot].cells if slot < len(group) else ()
            seq_cells[at:at + len(context)] = context
            at += len(context)
            seq_cells[at:at + block] = np.arange(block) + self.first_block_cell + slot * block
            at += block
            indptr[slot + 1] = at
        seq_cells[at:] = SCRATCH_CELL
        return host, sizes
