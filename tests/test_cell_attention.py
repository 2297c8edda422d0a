"""The Triton cell-attention operator against the masked PyTorch reference.

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py), in fp32, against
the reference computed in fp64. Steps are random mixes of decodes and chunks with their cells scattered in
random pool order.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fresh_process import run_without_interpreter
from pt2serve.kernels import cell_attention as ops
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.checkpoint import load_model

pytestmark = pytest.mark.skipif(not ops.is_available(), reason="needs the triton package")

NUM_CELLS = 2048


@dataclasses.dataclass
class RandomStep:
    q: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    positions: torch.Tensor
    token_seq: torch.Tensor
    seq_indptr: torch.Tensor
    seq_cells: torch.Tensor

    def reference(self) -> torch.Tensor:
        mask = ops.visibility_mask(self.positions, self.token_seq, self.seq_indptr, self.seq_cells.shape[0])
        return ops.masked_cell_attention(
            self.q.double(), self.k_pool.double(), self.v_pool.double(), self.seq_cells, mask
        )

    def kernel(self, config: ops.LaunchConfig | None = None) -> torch.Tensor:
        """The operator (its own config for this width), or the kernels launched with `config`."""
        num_tokens, num_heads, _ = self.q.shape
        num_seqs = self.seq_indptr.shape[0] - 1
        query_indptr = ops.query_indptr(self.token_seq, num_seqs)
        own = ops.call_site_config(num_tokens, num_seqs, num_heads, self.k_pool.shape[1])
        chosen = config or own
        block_seq_end = ops.block_sequence_ends(query_indptr, chosen.num_blocks(num_tokens, num_seqs), chosen.block_q)
        args = (self.q, self.k_pool, self.v_pool, self.positions, self.token_seq, query_indptr,
                self.seq_indptr, self.seq_cells, block_seq_end)
        if config is None:
            return ops.cell_attention(*args, *dataclasses.astuple(own))
        return ops.launch_cell_attention(*args, config)


def random_step(
    seed: int, chunks: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, padding: int = 0
) -> RandomStep:
    """chunks: (cells already computed, new tokens) per sequence; `padding` unused entries at the end."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.arange(1, NUM_CELLS))
    taken, seq_cells, seq_indptr, positions, token_seq = 0, [], [0], [], []
    for seq, (before, count) in enumerate(chunks):
        length = before + count
        seq_cells += order[taken:taken + length].tolist()
        taken += length
        seq_indptr.append(seq_indptr[-1] + length)
        positions += range(before, length)
        token_seq += [seq] * count
    seq_cells += [0] * padding
    generator = torch.Generator().manual_seed(seed)
    pool_shape = (NUM_CELLS, num_kv_heads, head_dim)
    return RandomStep(
        q=torch.randn(len(positions), num_heads, head_dim, generator=generator),
        k_pool=torch.randn(pool_shape, generator=generator),
        v_pool=torch.randn(pool_shape, generator=generator),
        positions=torch.tensor(positions),
        token_seq=torch.tensor(token_seq),
        seq_indptr=torch.tensor(seq_indptr),
        seq_cells=torch.tensor(seq_cells),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


MIXES = {
    "one decode, one cell": [(0, 1)],
    "decodes, short and long (split walks)": [(0, 1), (1, 1), (62, 1), (300, 1), (700, 1)],
    "chunk behind a prefix, not a block multiple": [(37, 45)],
    "mixed step": [(0, 5), (3, 1), (200, 1), (0, 70), (129, 2)],
    "long chunk behind a long prefix (unmasked blocks, then the diagonal's)": [(200, 150), (500, 1)],
}
HEADS = [(4, 4, 64), (8, 2, 128), (16, 2, 64)]  # GQA ratios 1, 4, 8; head_dim 64 and 128


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-kv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("call_site", ["static", "dynamic"])
def test_kernel_matches_masked_reference(mix, heads, call_site):
    num_heads, num_kv_heads, head_dim = heads
    step = random_step(len(mix) + head_dim, MIXES[mix], num_heads, num_kv_heads, head_dim, padding=7)
    num_tokens = step.q.shape[0] if call_site == "static" else None
    config = launch_config(num_tokens, step.seq_indptr.shape[0] - 1, num_heads, num_kv_heads)
    assert relative_error(step.kernel(config), step.reference()) < 1e-5


@pytest.mark.parametrize("mix", ["mixed step", "long chunk behind a long prefix (unmasked blocks, then the diagonal's)"])
def test_decode_tiles_walk_the_unmasked_bulk_as_the_reference(mix):
    """Small query tiles (4 tokens x 4 heads) through the prefill tiles' two loops: a block's unmasked walk
    must end exactly where its first row stops seeing every entry (one entry too far showed here)."""
    step = random_step(len(mix) + 64, MIXES[mix], 16, 2, 64, padding=7)
    config = launch_config(step.q.shape[0], step.seq_indptr.shape[0] - 1, 16, 2)
    assert relative_error(step.kernel(dataclasses.replace(config, unmasked_bulk=True)), step.reference()) < 1e-5


@pytest.mark.parametrize("call_site", ["static", "dynamic"])
def test_long_sequences_sharing_cells_behind_a_stale_index(call_site):
    """Two sequences over a 2,500-cell prefix they share (as prefix-cache clones list it), 3,000 and 3,600
    entries long, beside a short decode; the index goes on past the step with stale entries of real cells (as
    a graph buffer holds after a longer step): the kernel reads each sequence's own entries only, as the
    masked reference does."""
    num_heads, num_kv_heads, head_dim, num_cells = 8, 2, 128, 4096
    rng = np.random.default_rng(31)
    order = rng.permutation(np.arange(1, num_cells))
    prefix = order[:2500].tolist()
    contexts = [prefix + order[2500:3000].tolist(), prefix + order[3000:3600].tolist(), order[3600:3700].tolist()]
    counts = [1, 8, 1]  # a decode, an 8-token chunk ending the second context, a decode
    positions = [p for cells, n in zip(contexts, counts) for p in range(len(cells) - n, len(cells))]
    generator = torch.Generator().manual_seed(31)
    step = RandomStep(
        q=torch.randn(len(positions), num_heads, head_dim, generator=generator),
        k_pool=torch.randn(num_cells, num_kv_heads, head_dim, generator=generator),
        v_pool=torch.randn(num_cells, num_kv_heads, head_dim, generator=generator),
        positions=torch.tensor(positions),
        token_seq=torch.tensor([seq for seq, n in enumerate(counts) for _ in range(n)]),
        seq_indptr=torch.tensor(np.cumsum([0] + [len(cells) for cells in contexts])),
        seq_cells=torch.tensor(sum(contexts, []) + order[:1000].tolist()),  # then 1,000 stale entries
    )
    num_tokens = step.q.shape[0] if call_site == "static" else None
    config = launch_config(num_tokens, len(contexts), num_heads, num_kv_heads)
    assert relative_error(step.kernel(config), step.reference()) < 1e-5


@pytest.mark.parametrize("mix", ["decodes, short and long (split walks)", "mixed step"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_reads_fp8_cells_with_their_scales(mix, q_dtype):
    """e4m3 pools with a scale per KV head: the kernel, split walks and one-program walks alike, computes the
    reference's attention over the dequantized cells (scales far from 1, so one left out shows). Under a bf16 q
    the dots run in fp16: what error remains is the fp16 probabilities' and the bf16 output's rounding."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    step = random_step(5, MIXES[mix], num_heads, num_kv_heads, head_dim, padding=3)
    step.q = step.q.to(q_dtype)
    k_scale, v_scale = torch.tensor([0.01, 0.3]), torch.tensor([2.0, 0.05])
    step.k_pool = (step.k_pool * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    step.v_pool = (step.v_pool * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    if torch.cuda.is_available():  # compiled for the GPU there, in the interpreter here
        step = RandomStep(*(t.cuda() for t in dataclasses.astuple(step)))
        k_scale, v_scale = k_scale.cuda(), v_scale.cuda()
    num_seqs = step.seq_indptr.shape[0] - 1
    query_indptr = ops.query_indptr(step.token_seq, num_seqs)
    for num_tokens in (step.q.shape[0], None):
        config = launch_config(num_tokens, num_seqs, num_heads, num_kv_heads, fp8_cells=True)
        assert config.block_n == (128 if num_tokens is not None else 64)  # FP8 pools' decode blocks
        block_seq_end = ops.block_sequence_ends(query_indptr, config.num_blocks(step.q.shape[0], num_seqs),
                                                config.block_q)
        got = ops.launch_cell_attention(step.q, step.k_pool, step.v_pool, step.positions, step.token_seq,
                                        query_indptr, step.seq_indptr, step.seq_cells, block_seq_end, config,
                                        k_scale, v_scale)
        mask = ops.visibility_mask(step.positions, step.token_seq, step.seq_indptr, step.seq_cells.shape[0])
        dequantized = [(pool.double() * scale[None, :, None]) for pool, scale in
                       ((step.k_pool, k_scale), (step.v_pool, v_scale))]
        want = ops.masked_cell_attention(step.q.double(), *dequantized, step.seq_cells, mask)
        if q_dtype == torch.float32:
            assert relative_error(got, want) < (1e-5 if got.is_cpu else 1e-3)  # tf32 dots on the GPU
            scaled = ops.masked_cell_attention(step.q, step.k_pool, step.v_pool, step.seq_cells, mask, k_scale,
                                               v_scale)
            assert relative_error(scaled, want) < 1e-5  # the reference's own scaled path
        else:  # fp16 products and probabilities, the output rounded to bf16 (2^-9)
            assert got.dtype == torch.bfloat16 and relative_error(got, want) < 5e-3


def launch_config(num_tokens, num_seqs: int, num_heads: int, num_kv_heads: int,
                  fp8_cells: bool = False) -> ops.LaunchConfig:
    """The operator's config for a static width or (num_tokens None) a dynamic one, with at most 4 splits
    so the interpreter's run stays short (the split count is data to the kernels)."""
    config = ops.LaunchConfig.for_call(num_tokens, num_seqs, num_heads, num_kv_heads, fp8_cells)
    return dataclasses.replace(config, max_splits=min(config.max_splits, 4))


def test_step_tables():
    # Sequences of 5, 0, 1 and 9 tokens in blocks of 4, on a grid of 15 // 4 + 4 = 7 blocks. Each sequence's
    # blocks start at query_indptr[r] // 4 + r: 0, 2, 3, 4. Block 2 belongs to the empty sequence 1 (its program
    # finds no token and exits).
    token_seq = torch.tensor([0] * 5 + [2] + [3] * 9)
    query_indptr = ops.query_indptr(token_seq, 4)
    assert query_indptr.tolist() == [0, 5, 5, 6, 15]
    blocks = ops.block_sequence_ends(query_indptr, 15 // 4 + 4, 4)
    assert (blocks - 1).tolist() == [0, 0, 1, 2, 3, 3, 3]


@torch.library.custom_op("pt2serve_test::read_tables", mutates_args=())
def _read_tables(x: torch.Tensor, query_indptr: torch.Tensor, block_seq_end: torch.Tensor) -> torch.Tensor:
    return x + query_indptr.sum() + block_seq_end.sum()


@_read_tables.register_fake
def _(x, query_indptr, block_seq_end):
    return torch.empty_like(x)


def test_step_tables_are_computed_once_for_every_layer():
    """Each layer's attention call reads the step's tables: the compiled step must build them once, not once per
    reader (a pointwise op at their end would be recomputed into a buffer per call)."""
    from torch._inductor.utils import run_and_get_code

    def step(x, token_seq):
        query_indptr = ops.query_indptr(token_seq, 3)
        block_seq_end = ops.block_sequence_ends(query_indptr, 7, 4)
        for _ in range(4):  # layers
            x = _read_tables(x, query_indptr, block_seq_end)
        return x

    token_seq = torch.tensor([0, 0, 1, 2, 2])
    _, (code,) = run_and_get_code(torch.compile(step, backend="inductor"), torch.zeros(2), token_seq)
    table_buffers = [line for line in code.splitlines() if "empty_strided_cpu((7, )" in line
                     or "empty_strided_cpu((4, )" in line]
    assert len(table_buffers) <= 2, table_buffers


def test_launch_configs_per_call_site():
    static = ops.LaunchConfig.for_call(1, 1, 32, 8)
    assert (static.block_q, static.block_m) == (4, 16)
    assert static.max_splits == ops.MAX_SPLITS  # one decode: split its walk over many programs
    # Splits per sequence fill TARGET_PROGRAMS (1,024) with sequences x KV heads x splits: 8 long decodes split
    # in 16, 32 in 4 (of at least 256 cells); 64 fill half of it unsplit, so forward_64 launches no merge kernel.
    configs = [ops.LaunchConfig.for_call(n, n, 32, 8) for n in (8, 16, 32, 64)]
    assert [(c.max_splits, c.min_split) for c in configs] == [(16, 128), (8, 128), (4, 256), (1, 256)]
    dynamic = ops.LaunchConfig.for_call(None, 3, 32, 8)
    assert (dynamic.block_q, dynamic.block_m) == (16, 64)
    assert dynamic.unmasked_bulk and not static.unmasked_bulk


def test_operator_with_its_own_config_and_every_split():
    # A decode over 1,900 cells: 15 splits of the walk, merged; next to a chunk that is walked whole.
    step = random_step(3, [(1900, 1), (0, 20)], 8, 2, 64)
    assert relative_error(step.kernel(), step.reference()) < 1e-5


def test_rows_past_their_sequence_read_nothing():
    # Sequence 1 lists no entries; its token must not read sequence 2's (or any) cells, and stays finite.
    step = random_step(5, [(4, 1)], 8, 2, 64)
    step.q = torch.cat([step.q, torch.randn(1, 8, 64)])
    step.positions = torch.cat([step.positions, torch.tensor([0])])
    step.token_seq = torch.cat([step.token_seq, torch.tensor([1])])
    step.seq_indptr = torch.cat([step.seq_indptr, step.seq_indptr[-1:]])
    out = step.kernel(launch_config(2, 2, 8, 2))
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert relative_error(out[:1], step.reference()[:1]) < 1e-5


def model_step(cfg, num_cells: int, seed: int):
    """Inputs of one forward over three sequences (a decode, a chunk behind a prefix, a fresh prompt)."""
    rng = np.random.default_rng(seed)
    chunks = [(9, 1), (20, 13), (0, 6)]
    order = rng.permutation(np.arange(1, num_cells))
    seq_cells, indptr, positions, token_seq, write_cells, taken = [], [0], [], [], [], 0
    for seq, (before, count) in enumerate(chunks):
        cells = order[taken:taken + before + count].tolist()
        taken += before + count
        seq_cells += cells
        indptr.append(indptr[-1] + len(cells))
        positions += range(before, before + count)
        token_seq += [seq] * count
        write_cells += cells[before:]
    num_tokens = len(positions)
    tokens = torch.tensor(rng.integers(0, cfg.vocab_size, num_tokens))
    logit_rows = torch.tensor([0, 13, num_tokens - 1])
    generator = torch.Generator().manual_seed(seed)
    pools = [torch.randn(num_cells, cfg.num_kv_heads, cfg.head_dim, generator=generator)
             for _ in range(2 * cfg.num_layers)]
    t = torch.tensor
    return (tokens, t(positions), t(write_cells), t(token_seq), t(indptr), t(seq_cells), logit_rows), pools


def run_model(model, step, pools):
    pools = [p.clone() for p in pools]
    half = len(pools) // 2
    with torch.no_grad():
        logits = model(*step, pools[:half], pools[half:])
    return logits, pools


@pytest.fixture(scope="module")
def tiny_models():
    masked = load_model(None, "tiny-random", torch.float32, "cpu", AttentionImpl.MASKED).model
    kernel = load_model(None, "tiny-random", torch.float32, "cpu", AttentionImpl.KERNEL).model
    return masked, kernel


def test_model_with_kernel_attention_matches_masked(tiny_models):
    masked, kernel = tiny_models
    step, pools = model_step(masked.config, 256, seed=11)
    ref_logits, ref_pools = run_model(masked, step, pools)
    logits, out_pools = run_model(kernel, step, pools)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for got, want in zip(out_pools, ref_pools):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


EXPORT_SCRIPT = """
import sys, torch
from pt2serve.export.methods import MethodSpec, trace_forward
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.checkpoint import load_model
model = load_model(None, "tiny-random", torch.float32, "cpu", AttentionImpl.KERNEL).model
for spec in (MethodSpec("forward_64", 64, 300), MethodSpec("forward_others")):
    program, _ = trace_forward(model, spec, max_step_tokens=128, max_cells=512)
    torch.export.save(program, f"{sys.argv[1]}/{spec.name}.pt2")
"""


@pytest.fixture(scope="module")
def exported_with_kernel(tmp_path_factory) -> Path:
    """forward_64 and forward_others of `tiny-random` with the kernel, traced in a process without TRITON_INTERPRET
    (under the interpreter, export would trace into the kernel instead of keeping the operator)."""
    folder = tmp_path_factory.mktemp("kernel-programs")
    run_without_interpreter(EXPORT_SCRIPT, str(folder))
    return folder


@pytest.mark.parametrize("method", ["forward_64", "forward_others"])
def test_exported_methods_with_the_kernel_match_masked(tiny_models, exported_with_kernel, method):
    """The traced program (the operator inside it, query_indptr derived in the graph) runs the step right.

    AOTInductor cannot compile a Triton operator for the CPU; compiling it is checked on the GPU (the cuda
    tests export toy-greedy for cuda; tests/test_cuda_kernels.py checks the operator at the 8B's shapes)."""
    masked, _ = tiny_models
    program = torch.export.load(exported_with_kernel / f"{method}.pt2")
    targets = [str(node.target) for node in program.graph.nodes]
    assert any("pt2serve.cell_attention" in t for t in targets)
    assert any("pt2serve.rope_and_store" in t for t in targets)  # rope and the K/V write: one operator
    step, pools = model_step(masked.config, 256, seed=12)
    if method == "forward_64":  # a static method: pad to its width and entry capacity as the runtime does
        step = pad_step(step, 64, 300)
    ref_logits, ref_pools = run_model(masked, step, pools)
    logits, out_pools = run_model(program.module(), step, pools)
    torch.testing.assert_close(logits[:3], ref_logits[:3], atol=1e-4, rtol=1e-4)
    for got, want in zip(out_pools, ref_pools):
        torch.testing.assert_close(got[1:], want[1:], atol=1e-5, rtol=1e-5)  # cell 0 is the scratch cell


def pad_step(step, width: int, num_entries: int):
    """Padding tokens in their own sequence at position 0, writing and seeing only the scratch cell."""
    tokens, positions, write_cells, token_seq, indptr, seq_cells, logit_rows = step
    num_pad = width - tokens.shape[0]
    num_seqs = indptr.shape[0] - 1
    zeros = torch.zeros(num_pad, dtype=torch.int64)
    entries = torch.zeros(num_entries, dtype=torch.int64)
    entries[: seq_cells.shape[0]] = seq_cells
    indptr = torch.cat([indptr, torch.full((width + 1 - indptr.shape[0],), int(indptr[-1]) + 1)])
    rows = torch.cat([logit_rows, torch.full((width - logit_rows.shape[0],), width - 1)])
    return (torch.cat([tokens, zeros]), torch.cat([positions, zeros]), torch.cat([write_cells, zeros]),
            torch.cat([token_seq, torch.full((num_pad,), num_seqs)]), indptr, entries, rows)
