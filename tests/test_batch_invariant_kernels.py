"""The kernels of deterministic artifacts: a row's result is the same bits whatever else the call holds.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (conftest.py), in fp32; on a GPU the same tests
run there (bf16 too, marked cuda). The CPU formulation of the linear layers is checked through Inductor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pt2serve.kernels import cell_attention as ops  # noqa: E402
from conftest import triton_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels():
    return triton_kernels("pt2serve.kernels.batch_invariant_triton")


def interpreted_dots_keep_rows() -> bool:
    """Whether this CPU's numpy gives a row of a [64, 64] @ [64, 64] product the same bits at every place in
    the tile. Triton's interpreter runs tl.dot through numpy's BLAS, and OpenBLAS picks its micro-kernels by
    CPU: on some, a tile's edge rows are summed in another order, so the interpreter cannot show bit-for-bit
    row independence there (on a GPU these tests run compiled, where the probe does not apply)."""
    import numpy as np

    if DEVICE == "cuda":
        return True
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 64, 64), dtype=np.float32)
    product = a @ b
    return all(np.array_equal((np.roll(a, -place, axis=0) @ b)[0], product[place]) for place in range(64))


def needs_row_keeping_dots():
    if not interpreted_dots_keep_rows():
        pytest.skip("this CPU's numpy sums a tile's rows in different orders (OpenBLAS micro-kernels), so "
                    "Triton's interpreter cannot show bit-for-bit row independence here; compiled on a GPU, they can")


def rows_with_company(row: torch.Tensor, num_rows: int, place: int, seed: int) -> torch.Tensor:
    """num_rows random rows with `row` at index `place`."""
    others = torch.randn(num_rows, row.shape[-1], generator=torch.Generator().manual_seed(seed)).to(row)
    others[place] = row
    return others


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])
def test_linear_rows_do_not_depend_on_the_others(kernels, dtype):
    """K split in two (k_splits of a 64-row weight of 1,100 inputs), one tile for every M: a row alone, first,
    last, in a partial tile and past the first tile gives the same bits, and F.linear's values."""
    needs_row_keeping_dots()
    n, k = 64, 1100
    assert kernels.k_splits(n, k) == 2
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    row = torch.randn(1, k, generator=generator).to(DEVICE, dtype)
    alone = kernels.batch_invariant_linear(row, weight)[0]
    for num_rows, place in ((3, 0), (3, 2), (64, 63), (65, 64), (130, 70)):
        x = rows_with_company(row[0], num_rows, place, seed=num_rows)
        assert torch.equal(kernels.batch_invariant_linear(x, weight)[place], alone), (num_rows, place)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.float(), F.linear(row, weight)[0].float(), rtol=tolerance, atol=tolerance)


def test_rms_norm_rows_do_not_depend_on_the_others(kernels):
    """Two chunks of the hidden size (1,024 then 476): each row alone or among others, the model's values."""
    from pt2serve.model.model import RMSNorm

    hidden = 1500
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=torch.Generator().manual_seed(1)))
    row = torch.randn(1, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    alone = kernels.batch_invariant_rms_norm(row, norm.weight, norm.eps)[0]
    for num_rows, place in ((2, 1), (33, 17)):
        x = rows_with_company(row[0], num_rows, place, seed=num_rows)
        assert torch.equal(kernels.batch_invariant_rms_norm(x, norm.weight, norm.eps)[place], alone)
    torch.testing.assert_close(alone, norm(row)[0].detach(), rtol=1e-5, atol=1e-5)


def test_cpu_linear_rows_do_not_depend_on_the_others():
    """The CPU formulation compiled by Inductor, static at several M and dynamic: the same bits per row
    (F.linear, a BLAS call, differs between one row and eight)."""
    from pt2serve.kernels.batch_invariant import linear

    generator = torch.Generator().manual_seed(3)
    weight, row = torch.randn(160, 64, generator=generator), torch.randn(1, 64, generator=generator)
    static, dynamic = torch.compile(linear, dynamic=False), torch.compile(linear, dynamic=True)
    alone = static(row, weight)[0]
    for num_rows in (2, 8, 31, 33):
        x = rows_with_company(row[0], num_rows, num_rows - 1, seed=num_rows)
        assert torch.equal(static(x, weight)[-1], alone), num_rows
        assert torch.equal(dynamic(x, weight)[-1], alone), num_rows
    torch.testing.assert_close(alone, F.linear(row, weight)[0])


# -- attention ------------------------------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, NUM_CELLS = 8, 2, 64, 1024
TARGET_POSITION = 300  # the target row's position: 5 segments of 64 cells


@dataclasses.dataclass
class Sequence:
    cells: list[int]  # one per position
    start: int  # the chunk's first position
    q: torch.Tensor  # [tokens, H, D]


def attention_row(pool, sequences: list[Sequence], target: int, config: ops.LaunchConfig) -> torch.Tensor:
    """The output row of sequence `target`'s last token in a step of these sequences' chunks."""
    k_pool, v_pool = pool
    q = torch.cat([s.q for s in sequences])
    positions = torch.cat([torch.arange(s.start, s.start + s.q.shape[0]) for s in sequences])
    token_seq = torch.cat([torch.full((s.q.shape[0],), i) for i, s in enumerate(sequences)])
    seq_indptr = torch.tensor([0] + [len(s.cells) for s in sequences]).cumsum(0)
    seq_cells = torch.tensor([c for s in sequences for c in s.cells] + [0] * 5)
    num_tokens, num_seqs = q.shape[0], len(sequences)
    query_indptr = ops.query_indptr(token_seq, num_seqs)
    block_seq_end = ops.block_sequence_ends(query_indptr, config.num_blocks(num_tokens, num_seqs), config.block_q)
    inputs = [t.to(DEVICE) for t in (q, k_pool, v_pool, positions, token_seq, query_indptr, seq_indptr, seq_cells,
                                     block_seq_end)]
    out = ops.launch_cell_attention(*inputs, config)
    return out[int(query_indptr[target + 1]) - 1].cpu()


def test_attention_row_is_the_same_at_every_call_site_decode_or_prefill():
    """One row (position 300: 5 segments of 64) as a decode alone and beside others, through a static width's
    config (one program per segment, merged) and forward_others' (one program folds them), and as the last
    token of prefill chunks of 21 and 101 tokens: the same bits, and the reference's values; with the default
    configs a decode and a chunk's row differ."""
    triton_kernels("pt2serve.kernels.cell_attention")
    needs_row_keeping_dots()
    generator = torch.Generator().manual_seed(4)
    pool = (torch.randn(NUM_CELLS, KV_HEADS, HEAD_DIM, generator=generator),
            torch.randn(NUM_CELLS, KV_HEADS, HEAD_DIM, generator=generator))
    cells = torch.randperm(NUM_CELLS - 1, generator=generator)[:TARGET_POSITION + 1].add(1).tolist()
    queries = torch.randn(101, HEADS, HEAD_DIM, generator=generator)

    def target(tokens: int) -> Sequence:
        return Sequence(cells, TARGET_POSITION + 1 - tokens, queries[-tokens:])

    def other(seed: int, length: int, tokens: int) -> Sequence:
        g = torch.Generator().manual_seed(seed)
        return Sequence(torch.randint(1, NUM_CELLS, (length,), generator=g).tolist(), length - tokens,
                        torch.randn(tokens, HEADS, HEAD_DIM, generator=g))

    static = dataclasses.replace(ops.LaunchConfig.deterministic(True, HEADS, KV_HEADS, 512), segment=64,
                                 min_split=64, max_splits=8)
    dynamic = dataclasses.replace(static, max_splits=1)
    ways = {
        "decode alone, static": attention_row(pool, [target(1)], 0, static),
        "decode alone, dynamic": attention_row(pool, [target(1)], 0, dynamic),
        "decode after others, static": attention_row(pool, [other(5, 40, 1), other(6, 500, 1), target(1)], 2, static),
        "decode before a chunk, dynamic": attention_row(pool, [target(1), other(7, 90, 30)], 0, dynamic),
        "chunk of 21, dynamic": attention_row(pool, [target(21)], 0, dynamic),
        "chunk of 21, static": attention_row(pool, [other(8, 3, 1), target(21)], 1, static),
        "chunk of 101, dynamic": attention_row(pool, [other(9, 200, 64), target(101)], 1, dynamic),
    }
    first = ways["decode alone, static"]
    assert {name: torch.equal(row, first) for name, row in ways.items()} == {name: True for name in ways}
    mask = torch.ones(1, TARGET_POSITION + 1, dtype=torch.bool)
    reference = ops.masked_cell_attention(queries[-1:].double(), pool[0].double(), pool[1].double(),
                                          torch.tensor(cells), mask)[0]
    torch.testing.assert_close(first.double(), reference, rtol=1e-5, atol=1e-5)
    # The default launch configs (split by the width's sequences, prefill tiles for forward_others) differ.
    split_decode = attention_row(pool, [target(1)], 0, ops.LaunchConfig.for_call(1, 1, HEADS, KV_HEADS))
    prefill_chunk = attention_row(pool, [target(21)], 0, ops.LaunchConfig.for_call(None, 1, HEADS, KV_HEADS))
    assert not torch.equal(split_decode, prefill_chunk)


def test_rope_and_store_rows_do_not_depend_on_the_others():
    """With qk norms (Qwen3's), a token's rotated q and its K/V cells alone and as row 17 of 20 tokens."""
    triton_kernels("pt2serve.kernels.rope_store")  # registers the operator

    heads, kv_heads, head_dim = 4, 2, 64
    generator = torch.Generator().manual_seed(5)
    norms = [(torch.rand(head_dim, generator=generator) + 0.5).to(DEVICE) for _ in range(2)]
    width = (heads + 2 * kv_heads) * head_dim
    row = torch.randn(1, width, generator=generator)
    angles = torch.rand(20, head_dim, generator=generator)

    def run(num_tokens: int, place: int):
        qkv = rows_with_company(row[0], num_tokens, place, seed=num_tokens).to(DEVICE)
        step_angles = torch.cat([angles[:num_tokens - 1], angles[-1:]]) if num_tokens > 1 else angles[-1:]
        step_angles = step_angles.roll(place - (num_tokens - 1), 0).to(DEVICE)
        cells = torch.arange(1, num_tokens + 1, device=DEVICE)
        pools = [torch.zeros(32, kv_heads, head_dim, device=DEVICE) for _ in range(2)]
        q = torch.ops.pt2serve.rope_and_store(qkv, step_angles.cos(), step_angles.sin(), cells, *pools, *norms, 1e-6,
                                              heads, kv_heads, None, None, True)
        return q[place], [pool[place + 1] for pool in pools]

    alone_q, alone_kv = run(1, 0)
    q, kv = run(20, 17)
    assert torch.equal(q, alone_q) and all(torch.equal(a, b) for a, b in zip(kv, alone_kv))
