"""Tracing each artifact method with torch.export: its module, example inputs and dynamic dims."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import Dim

from pt2serve.contract import (
    ACCEPT_DRAFTS,
    ACCEPT_DRAFTS_SAMPLED,
    DRAFT_CONTEXT,
    FORWARD_OTHERS,
    SAMPLE,
    SAMPLE_ARGMAX,
    SCRATCH_CELL,
    draft_name,
    forward_name,
)
from pt2serve.model.dflash import DraftBlockMethod, DraftContextMethod
from pt2serve.model.kv_fp8 import kv_pool_dtype
from pt2serve.model.model import Transformer
from pt2serve.model.sampling import ArgmaxSampler, Sampler
from pt2serve.model.verify import GreedyAcceptor, SampledAcceptor


@dataclass(frozen=True)
class MethodSpec:
    """One method to build: a static forward of `width` tokens, forward_others, a sampler, or a draft method."""

    name: str
    width: int | None = None  # static forwards only
    num_entries: int | None = None  # static forwards and draft_S: fixed seq_cells length
    num_seqs: int | None = None  # draft_S only: the sequences it drafts for


def draft_specs(draft_sizes: tuple[int, ...], entries_for) -> list[MethodSpec]:
    """The DFlash draft methods: the context writer, then one static block method per sequence count."""
    blocks = [MethodSpec(draft_name(n), num_entries=entries_for(n), num_seqs=n)
              for n in sorted(draft_sizes, reverse=True)]
    return blocks + [MethodSpec(DRAFT_CONTEXT)]


def method_specs(forward_sizes: tuple[int, ...], entries_for) -> list[MethodSpec]:
    """All methods of an artifact, the slowest to compile (widest static) first."""
    specs = [MethodSpec(forward_name(n), n, entries_for(n)) for n in sorted(forward_sizes, reverse=True)]
    samplers = [SAMPLE, SAMPLE_ARGMAX, ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED]
    return specs + [MethodSpec(FORWARD_OTHERS)] + [MethodSpec(name) for name in samplers]


def example_step(num_tokens: int, num_seqs: int, num_entries: int, num_cells: int, device) -> tuple:
    """A valid step: sequence 0 holds all tokens but one per other sequence, each at position 0.

    Valid data matters: AOTInductor benchmarks kernels on these inputs on the GPU.
    """
    lengths = [num_tokens - (num_seqs - 1)] + [1] * (num_seqs - 1)
    tokens = torch.arange(num_tokens, device=device) % 7
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    write_cells = torch.arange(1, num_tokens + 1, device=device)
    token_seq = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
    seq_indptr = torch.tensor([0] + lengths, device=device).cumsum(0)
    seq_cells = torch.full((num_entries,), SCRATCH_CELL, device=device)
    seq_cells[:num_tokens] = write_cells
    logit_rows = seq_indptr[1:] - 1
    assert num_cells > num_tokens
    return tokens, positions, write_cells, token_seq, seq_indptr, seq_cells, logit_rows


def trace_forward(model: Transformer, spec: MethodSpec, max_step_tokens: int, max_cells: int):
    """torch.export one forward method; pools are inputs mutated in place."""
    cfg = model.config
    device = model.norm.weight.device
    static = spec.width is not None
    # forward_others takes up to max_step_tokens real tokens plus the one padding token the runtime adds.
    max_tokens = max_step_tokens + 1
    num_tokens = spec.width if static else max(3, min(max_tokens, 80))
    num_seqs = num_tokens if static else 2
    num_entries = spec.num_entries if static else num_tokens + 5
    num_cells = max(num_tokens + 2, 8)
    step = example_step(num_tokens, num_seqs, num_entries, num_cells, device)
    pool_shape = (num_cells, cfg.num_kv_heads, cfg.head_dim)
    pool_dtype = kv_pool_dtype(model)
    k_pools = [torch.zeros(pool_shape, device=device, dtype=pool_dtype) for _ in range(cfg.num_layers)]
    v_pools = [torch.zeros(pool_shape, device=device, dtype=pool_dtype) for _ in range(cfg.num_layers)]
    # The pool's cell count is dynamic even for static widths: the runtime sizes the pool at load.
    cells = Dim("cells", min=2, max=max_cells + 1)
    pool_dims = [{0: cells} for _ in range(cfg.num_layers)]
    if static:
        token_dims = indptr_dims = entry_dims = row_dims = None
    else:
        # Min 2 (a size-1 example would specialize); the runtime may still run T = 1 on it.
        tokens_dim = Dim("tokens", min=2, max=max_tokens)
        token_dims = {0: tokens_dim}
        indptr_dims = {0: Dim("seqs_plus_one", min=3, max=max_tokens + 1)}
        entry_dims = {0: Dim("entries", min=2)}
        row_dims = {0: Dim("rows", min=2, max=max_tokens)}
    dynamic_shapes = (
        token_dims, token_dims, token_dims, token_dims, indptr_dims, entry_dims, row_dims, pool_dims, pool_dims,
    )
    with torch.no_grad():
        return torch.export.export(
            model, (*step, k_pools, v_pools), dynamic_shapes=dynamic_shapes, strict=False
        ), (*step, k_pools, v_pools)


def trace_sampler(spec: MethodSpec, vocab_size: int, device):
    """torch.export `sample` or `sample_argmax` over a dynamic number of rows."""
    rows = Dim("rows", min=2)
    logits = torch.randn(3, vocab_size, device=device)
    if spec.name == SAMPLE_ARGMAX:
        args = (logits,)
        module, dynamic_shapes = ArgmaxSampler(), ({0: rows},)
    else:
        args = (
            logits,
            torch.tensor([0.0, 0.7, 1.0], device=device),
            torch.tensor([1.0, 0.9, 0.5], device=device),
            torch.tensor([0, 5, 0], device=device),
            torch.tensor([0.1, 0.5, 0.9], device=device),
        )
        module, dynamic_shapes = Sampler(), ({0: rows}, {0: rows}, {0: rows}, {0: rows}, {0: rows})
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False), args


def trace_acceptor(spec: MethodSpec, vocab_size: int, device):
    """torch.export `accept_drafts` or `accept_drafts_sampled` over dynamic logit rows, sequences and draft width."""
    rows, seqs, width = Dim("rows", min=2), Dim("seqs", min=2), Dim("draft_width", min=2)
    logits = torch.randn(8, vocab_size, device=device)
    # Valid data: two sequences of 3 rows (2 drafts and 1), padded to width 3 by repeating a real row.
    row_index = torch.tensor([[0, 1, 2], [3, 4, 4]], device=device)
    drafts = torch.tensor([[5, 6, 0], [7, 0, 0]], device=device)
    num_drafts = torch.tensor([2, 1], device=device)
    args = (logits, row_index, drafts, num_drafts)
    dynamic_shapes = ({0: rows}, {0: seqs, 1: width}, {0: seqs, 1: width}, {0: seqs})
    if spec.name == ACCEPT_DRAFTS:
        module = GreedyAcceptor()
    else:
        module = SampledAcceptor()
        args += (
            torch.tensor([0.0, 0.7], device=device),
            torch.tensor([1.0, 0.9], device=device),
            torch.tensor([0, 5], device=device),
            torch.rand(2, 3, device=device),
            torch.rand(2, 3, device=device),
        )
        dynamic_shapes += ({0: seqs}, {0: seqs}, {0: seqs}, {0: seqs, 1: width}, {0: seqs, 1: width})
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False), args


def trace_draft_context(model: Transformer, max_step_tokens: int, max_draft_cells: int):
    """torch.export `draft_context` over a dynamic token count (every forward's width) and draft pool size."""
    draft = model.draft
    layers = draft.config.layers
    device, dtype = draft.norm.weight.device, draft.norm.weight.dtype
    num_tokens = 5
    taps = torch.randn(num_tokens, draft.fc.in_features, device=device, dtype=dtype)
    positions = torch.arange(num_tokens, device=device)
    write_cells = torch.arange(1, num_tokens + 1, device=device)
    pool_shape = (num_tokens + 3, layers.num_kv_heads, layers.head_dim)
    k_pools = [torch.zeros(pool_shape, device=device, dtype=dtype) for _ in range(layers.num_layers)]
    v_pools = [torch.zeros(pool_shape, device=device, dtype=dtype) for _ in range(layers.num_layers)]
    tokens = Dim("tokens", min=2, max=max_step_tokens + 1)
    cells = Dim("cells", min=2, max=max_draft_cells)
    pool_dims = [{0: cells} for _ in range(layers.num_layers)]
    args = (taps, positions, write_cells, k_pools, v_pools)
    dynamic_shapes = ({0: tokens}, {0: tokens}, {0: tokens}, pool_dims, pool_dims)
    with torch.no_grad():
        return torch.export.export(DraftContextMethod(model), args, dynamic_shapes=dynamic_shapes, strict=False), args


def trace_draft_block(model: Transformer, spec: MethodSpec, max_draft_cells: int):
    """torch.export one static `draft_S` method (S = spec.num_seqs sequences of one block each)."""
    draft = model.draft
    layers, block = draft.config.layers, draft.config.block_size
    device, dtype = draft.norm.weight.device, draft.norm.weight.dtype
    num_seqs, num_entries = spec.num_seqs, spec.num_entries
    # Valid data: each sequence has 2 context cells then its block cells, all distinct.
    lengths = [2 + block] * num_seqs
    assert sum(lengths) <= num_entries
    seq_indptr = torch.tensor([0] + lengths, device=device).cumsum(0)
    seq_cells = torch.full((num_entries,), SCRATCH_CELL, device=device)
    seq_cells[: sum(lengths)] = torch.arange(1, sum(lengths) + 1, device=device)
    last_tokens = torch.arange(num_seqs, device=device) % 7
    pool_shape = (sum(lengths) + 2, layers.num_kv_heads, layers.head_dim)
    k_pools = [torch.zeros(pool_shape, device=device, dtype=dtype) for _ in range(layers.num_layers)]
    v_pools = [torch.zeros(pool_shape, device=device, dtype=dtype) for _ in range(layers.num_layers)]
    cells = Dim("cells", min=2, max=max_draft_cells)
    pool_dims = [{0: cells} for _ in range(layers.num_layers)]
    args = (last_tokens, seq_indptr, seq_cells, k_pools, v_pools)
    dynamic_shapes = (None, None, None, pool_dims, pool_dims)
    with torch.no_grad():
        return torch.export.export(DraftBlockMethod(model), args, dynamic_shapes=dynamic_shapes, strict=False), args
