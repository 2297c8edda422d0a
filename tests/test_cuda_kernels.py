"""The Triton operators compiled for the GPU at the 8B's shapes, against their PyTorch references.

- cell attention with llama-3.1-8b's heads (32 query, 8 KV, head dim 128) in bf16 and fp32, cells in random
  pool order: a mixed step, 64 decodes at 4k context, a 2,048-token chunk behind a 12k prefix, 1 and 8 decodes
  at 16k; both call-site
  configs (static width, dynamic width). tests/test_cell_attention.py covers small shapes in the interpreter.
- the quantized linear (int8 per row, int4 in groups of 128 with zero points) on the 8B's four layer shapes at
  the small-M widths and a wide one.

Marked `cuda`: skipped without a GPU. scripts/device/run.py's cuda-tests chain runs them; the kernels' speed
is scripts/device/attention_tune.py's and scripts/device/quant_kernels.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cuda

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ATTENTION_STEPS = {  # name: (cells already computed, new tokens) per sequence
    "mixed step": [(0, 5), (3, 1), (200, 1), (0, 70), (129, 2), (1000, 1)],
    "64 decodes at 4k": [(4095, 1)] * 64,
    "2048 chunk behind 12k": [(12288, 2048)],
    "1 decode at 16k (64 splits)": [(16000, 1)],
    "8 decodes at 16k": [(16000, 1)] * 8,
}
# Relative error (norm) against the reference computed in fp32 from the same inputs.
ATTENTION_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def attention_step(seed: int, chunks: list[tuple[int, int]], dtype: torch.dtype):
    """The operator's inputs but the block table for (before, count) chunks, cells in random pool order."""
    from pt2serve.kernels import cell_attention as ops

    num_cells = sum(b + c for b, c in chunks) + 16
    rng = np.random.default_rng(seed)
    order = torch.from_numpy(rng.permutation(np.arange(1, num_cells)))
    taken, seq_cells, indptr, positions, token_seq = 0, [], [0], [], []
    for seq, (before, count) in enumerate(chunks):
        length = before + count
        seq_cells.append(order[taken:taken + length])
        taken += length
        indptr.append(indptr[-1] + length)
        positions.append(torch.arange(before, length))
        token_seq.append(torch.full((count,), seq))
    generator = torch.Generator(device="cuda").manual_seed(seed)
    num_tokens = sum(count for _, count in chunks)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, device="cuda", generator=generator, dtype=dtype)
    k = torch.randn(num_cells, KV_HEADS, HEAD_DIM, device="cuda", generator=generator, dtype=dtype)
    v = torch.randn(num_cells, KV_HEADS, HEAD_DIM, device="cuda", generator=generator, dtype=dtype)
    token_seq = torch.cat(token_seq).cuda()
    seq_indptr = torch.tensor(indptr, device="cuda")
    return (q, k, v, torch.cat(positions).cuda(), token_seq, ops.query_indptr(token_seq, len(chunks)), seq_indptr,
            torch.cat(seq_cells).cuda())


@pytest.mark.parametrize("call_site", ["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(ATTENTION_STEPS))
def test_cell_attention_at_the_8b_heads_matches_the_masked_reference(name, dtype, call_site):
    from pt2serve.kernels import cell_attention as ops

    step = attention_step(7, ATTENTION_STEPS[name], dtype)
    q, k, v, positions, token_seq, query_indptr, seq_indptr, seq_cells = step
    num_seqs = seq_indptr.shape[0] - 1
    config = ops.LaunchConfig.for_call(q.shape[0] if call_site == "static" else None, num_seqs, HEADS, KV_HEADS)
    block_seq_end = ops.block_sequence_ends(query_indptr, config.num_blocks(q.shape[0], num_seqs), config.block_q)
    out = ops.launch_cell_attention(*step, block_seq_end, config)
    mask = ops.visibility_mask(positions, token_seq, seq_indptr, seq_cells.shape[0])
    ref = ops.masked_cell_attention(q.float(), k.float(), v.float(), seq_cells, mask)
    assert torch.isfinite(out).all()
    error = float((out.float() - ref).norm() / ref.norm())
    assert error < ATTENTION_TOLERANCE[dtype], error


LAYER_SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
                "down_proj": (4096, 14336)}
# Of the reference's largest output (dequantize, then one bf16 matmul): the kernels accumulate in fp32 and round
# the output once; on the H200 every launch config came within 3-6e-3 (docs/benchmarks.md).
QUANT_TOLERANCE = 1e-2


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4g128"])
@pytest.mark.parametrize("layer", list(LAYER_SHAPES))
def test_quant_linear_at_the_8b_shapes_matches_the_reference(layer, bits):
    from pt2serve.kernels import quant_linear_triton  # noqa: F401  (registers torch.ops.pt2serve.quant_linear)
    from pt2serve.kernels.quant_format import pack, reference_quant_linear

    n, k = LAYER_SHAPES[layer]
    group_size = k if bits == 8 else 128
    gen = torch.Generator(device="cuda").manual_seed(n + k + bits)
    q = torch.randint(0, 2**bits, (n, k), device="cuda", generator=gen)
    num_groups = -(-k // group_size)
    scales = (torch.rand(n, num_groups, device="cuda", generator=gen) * 0.01 + 1e-3).bfloat16()
    zeros = None if bits == 8 else torch.randint(0, 16, (n, num_groups), device="cuda", generator=gen).to(torch.uint8)
    qweight = pack(q, bits)
    for m in (1, 16, 64, 1024):
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        ref = reference_quant_linear(x, qweight, scales, zeros, None, bits, group_size).float()
        out = torch.ops.pt2serve.quant_linear(x, qweight, scales, zeros, None, bits, group_size).float()
        error = float((out - ref).abs().max() / ref.abs().max())
        assert error < QUANT_TOLERANCE, (m, error)
