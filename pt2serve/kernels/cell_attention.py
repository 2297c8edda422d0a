"""Attention over the cell pool: a Triton operator that reads only each token's own cells, and the plain
PyTorch reference it must agree with.

A step holds T tokens of R sequences (see model/attention.py for the step data). The operator takes one
more derived array, `query_indptr` [R+1]: sequence r's tokens are rows query_indptr[r] .. query_indptr[r+1]
of q (a step's chunks are consecutive runs of tokens, one sequence each).

Work is cut into programs of (query block, KV head, split):
- a query block is up to BLOCK_Q consecutive tokens of ONE sequence, times the GROUP query heads that share
  a KV head, stacked as BLOCK_M = BLOCK_Q * GROUP rows, so each K/V cell is loaded once per KV head;
- the grid's first axis is an upper bound on the number of query blocks, T // BLOCK_Q + R (each sequence
  adds at most one partial block); `block_seq_end` says which sequence each block belongs to (derived once per
  step by `block_sequence_ends`, so a program finds its work in one load), so nothing about the step's layout
  comes from host shapes and a CUDA graph can replay any step;
- a sequence with at most BLOCK_Q tokens (decodes, short chunks) splits its KV walk over up to
  `num_splits` programs (flash-decoding), so one long sequence still fills the GPU; their partial results
  are merged by a second kernel. Longer chunks walk their KV in one program per block (flash attention
  tiles), causal inside the chunk.
Every program only reads the cells at positions 0 .. its last token's position.

Deterministic artifacts (`LaunchConfig.deterministic`, `segment` > 0) compute each row the same way at every
call site, decode or prefill, alone or beside others: one tile config everywhere; the row's cells cut into
segments of `segment` cells at fixed multiples of it (so how many a row has depends on its own position alone),
each walked from its start in BLOCK_N steps; the segments' (max, sum, output) folded in segment order by one
formula (`_fold`), whether one program walks them all (forward_others, whose blocks fill the GPU) or one
program walks each and the merge kernel folds them (static widths, so a lone long decode still spreads). A
block of a prefill chunk walks past a row's position; those entries are -inf for that row, and a block or a
segment a row sees nothing of changes its sums by exactly nothing (alpha = exp2(0) = 1, p = 0).

FP8 pools (model/kv_fp8.py): cells hold e4m3 K/V divided by a scale per KV head (k_scale, v_scale [KVH]).
The kernel widens the e4m3 values as it loads them and folds the scales into per-program scalars: K's into
the softmax scale, V's into the output. With a bf16 q its dots run in fp16 (q converted once per program):
Hopper widens e4m3 pairs to fp16 in one instruction (cvt.rn.f16x2.e4m3x2) where bf16 takes a second conversion,
and that took 10% off 64 decodes at 4k on the H200 (285 -> 256 us a layer; bf16 cells 252). Both conversions
are exact (e4m3 fits fp16; a bf16 q loses no mantissa in fp16, only range past 65,504, far beyond a projected
query's values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton is needed to build GPU artifacts (and to run the kernels under TRITON_INTERPRET=1 on a CPU).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
# A static width lets each of its sequences split its KV walk until sequences x KV heads x splits reach
# TARGET_PROGRAMS, so a step whose every sequence is long fills the GPU whatever its width. Measured per layer
# on the H200 (llama-3.1-8b heads, docs/benchmarks.md): 32 decodes at 4k 158.6 us unsplit, 148.6 in 4 splits;
# 8 at 16k 431.8 unsplit, 168.5 in 8, 143.6 in 16; one at 16k 28.9 in 32, 30.9 in 64. A width that fills
# TARGET_PROGRAMS / 2 programs unsplit does not split (64 decodes at 4k: 248 us unsplit, 279 in 2; at 512:
# 37.8 against 49.3) and skips the merge kernel's launch.
TARGET_PROGRAMS = 1024
# The fewest cells a split walks: 128, or 256 from a width of TARGET_PROGRAMS / 4 programs unsplit up (32
# decodes at 512 in 2 splits: 30.7 us, in 4: 32.7).
MIN_SPLIT, WIDE_MIN_SPLIT = 128, 256
# Deterministic artifacts cut every row's KV walk at multiples of one segment length, at least this many cells
# and at most MAX_SPLITS segments for the max context.
MIN_SEGMENT = 256


def is_available() -> bool:
    return triton is not None


# Both step tables below end in a cumsum on purpose: Inductor stores a scan's result once, while a pointwise
# op after it (a cat, a "- 1") would be recomputed into a fresh buffer for every layer's kernel call that
# reads it (measured: 64 extra kernels in an 8B decode step).


def query_indptr(token_seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[R+1]: where each sequence's tokens start in the step (tokens of one sequence are consecutive)."""
    counts = torch.zeros(num_seqs + 1, dtype=token_seq.dtype, device=token_seq.device)
    counts = counts.scatter_add(0, token_seq + 1, torch.ones_like(token_seq))
    return counts.cumsum(0)


def block_sequence_ends(query_indptr: torch.Tensor, num_blocks: int, block_q: int) -> torch.Tensor:
    """[num_blocks]: 1 + the sequence each query block belongs to (blocks past the last real one: the last
    sequence), so the kernel's sequence is this minus one.

    Sequence r's blocks start at query_indptr[r] // block_q + r, a strictly increasing number, so marking
    each start and counting the marks up to a block gives its sequence + 1.
    """
    num_seqs = query_indptr.shape[0] - 1
    first_block = query_indptr[:-1] // block_q + torch.arange(num_seqs, device=query_indptr.device)
    marks = torch.zeros(num_blocks, dtype=query_indptr.dtype, device=query_indptr.device)
    marks = marks.index_put((first_block,), torch.ones_like(first_block))
    return marks.cumsum(0)


# -- the plain PyTorch reference (the CPU implementation) ---------------------------------------------------


def visibility_mask(
    positions: torch.Tensor, token_seq: torch.Tensor, seq_indptr: torch.Tensor, num_entries: int
) -> torch.Tensor:
    """[T, E] bool: may token t attend to entry e of seq_cells."""
    entry = torch.arange(num_entries, device=positions.device, dtype=seq_indptr.dtype)
    num_seqs = seq_indptr.shape[0] - 1
    # The sequence of entry e is the last r with seq_indptr[r] <= e. Searched over the whole indptr, not
    # a slice of it: Inductor's GPU searchsorted ignores a sliced boundary tensor's offset (silently off
    # by one; pytorch/pytorch#182343).
    entry_seq = (torch.searchsorted(seq_indptr, entry, right=True) - 1).clamp(min=0, max=num_seqs - 1)
    entry_pos = entry - seq_indptr[entry_seq]
    is_used = entry < seq_indptr[-1]
    same_seq = token_seq[:, None] == entry_seq[None, :]
    is_causal = entry_pos[None, :] <= positions[:, None]
    return same_seq & is_causal & is_used[None, :]


def masked_cell_attention(
    q: torch.Tensor,  # [T, H, D]
    k_pool: torch.Tensor,  # [C, KVH, D]
    v_pool: torch.Tensor,  # [C, KVH, D]
    seq_cells: torch.Tensor,  # [E]
    mask: torch.Tensor,  # [T, E] from visibility_mask
    k_scale: torch.Tensor | None = None,  # [KVH] fp32: an FP8 pool's K = cell * k_scale
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Attention of each token over the cells its mask allows: gathers every entry, so it costs O(T * E).

    Written as explicit matmuls rather than scaled_dot_product_attention: SDPA's GPU kernels pad the
    mask's last dim, which puts guards on the dynamic entry count that torch.export cannot discharge.
    Query heads sharing a KV head are stacked, so K/V are gathered once per KV head (no repeat).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    k = k_pool.index_select(0, seq_cells).transpose(0, 1).to(q.dtype)  # [KVH, E, D]
    v = v_pool.index_select(0, seq_cells).transpose(0, 1).to(q.dtype)
    q = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, T, D]
    q = q.reshape(num_kv_heads, group * num_tokens, head_dim)
    scores = torch.matmul(q, k.transpose(1, 2)) * (head_dim**-0.5)  # [KVH, G*T, E]
    if k_scale is not None:
        scores = scores * k_scale[:, None, None]
    # The most negative finite value, not -inf: a row that sees nothing (never a real token's) then
    # stays finite, so no NaN can reach the pool and spread through 0 * NaN to other tokens' rows.
    scores = scores.view(num_kv_heads, group, num_tokens, -1).masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(num_kv_heads, group * num_tokens, -1), v)  # [KVH, G*T, D]
    if v_scale is not None:
        out = (out * v_scale[:, None, None]).to(q.dtype)
    return out.view(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)


def window_cell_attention(
    q: torch.Tensor,  # [T, H, D]
    k_pool: torch.Tensor,  # [C, KVH, D]
    v_pool: torch.Tensor,
    positions: torch.Tensor,  # [T]
    token_seq: torch.Tensor,  # [T]
    seq_indptr: torch.Tensor,  # [R+1]
    seq_cells: torch.Tensor,  # [E]
    window: int,  # the artifact's max context: the same in every method
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, D]
    """The deterministic CPU implementation: each token attends over window slots 0 .. window - 1 that are
    its own sequence's positions (slots past its position hidden), so every sum a row takes runs over the same
    slots in the same order whatever shares the step, however many entries the step lists and wherever its
    sequence's entries start. masked_cell_attention's sums run over the step's whole entry list instead, and
    where a sequence's entries start in it (after those of the sequences before it) can move its terms to other
    lanes of the vectorised sums.

    The products are summed by Inductor-generated loops, not a BLAS call, for the reason kernels/batch_invariant.py
    gives. A step costs T x window whatever its context, which suits the CPU's small test contexts.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, dtype = k_pool.shape[1], q.dtype
    group = num_heads // num_kv_heads
    slot = torch.arange(window, device=q.device, dtype=seq_indptr.dtype)
    entry = (seq_indptr.index_select(0, token_seq)[:, None] + slot[None, :]).clamp(max=seq_cells.shape[0] - 1)
    cells = seq_cells[entry]  # [T, W]: slot j of token t is its sequence's position j (clamped past the end)
    k = k_pool[cells].transpose(1, 2).float()  # [T, KVH, W, D], read inside the sum, never stored
    v = v_pool[cells].transpose(1, 2).float()
    q = q.float().view(num_tokens, num_kv_heads, group, 1, head_dim)
    scores = (q * k[:, :, None]).sum(-1) * (head_dim**-0.5)  # [T, KVH, G, W]
    if k_scale is not None:
        scores = scores * k_scale.float()[None, :, None, None]
    visible = slot[None, :] <= positions[:, None]  # [T, W]; slot 0 always: a token sees its sequence's first cell
    scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * v[:, :, None]).sum(-2)  # [T, KVH, G, D]
    if v_scale is not None:
        out = out * v_scale.float()[None, :, None, None]
    return out.reshape(num_tokens, num_heads, head_dim).to(dtype)


# -- the Triton operator --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes, split rule and launch shape of one call site (fixed when the method is traced)."""

    block_q: int  # tokens of one sequence per program
    block_m: int  # rows per program: block_q tokens x the query heads of one KV head, at least 16 for tl.dot
    block_n: int  # cells per step of the KV walk
    max_splits: int  # programs that may share one short sequence's KV walk
    min_split: int  # cells a split walks at least: fewer would cost more in merging than they save
    num_warps: int
    num_stages: int
    # Walk the blocks every row sees whole without masks, then the diagonal's masked. Prefill tiles gain
    # (T=4096: 228 -> 275 TFLOP/s, H200); decode tiles lose (64 decodes at 4k: 12.8 -> 15.3 ms a step), so
    # static widths walk one masked loop.
    unmasked_bulk: bool = False
    # Deterministic artifacts: the cells of a row's fixed segments (the module docstring); 0 elsewhere.
    segment: int = 0

    @classmethod
    def deterministic(cls, static: bool, num_heads: int, num_kv_heads: int, max_context: int) -> "LaunchConfig":
        """The one tile config of a deterministic artifact (prefill-sized: 64 rows, so wide steps load each
        cell once per 64 rows; a decode leaves rows of it idle). Static widths walk one segment per program
        (max_splits segments at the max context); forward_others folds a block's segments in one program. No
        unmasked bulk: its blocks skip the masking, which may let the compiler fuse the scale and the shift
        into other instructions than the masked walk's."""
        group = num_heads // num_kv_heads
        rows = max(64, triton.next_power_of_2(group))
        segment = max(MIN_SEGMENT, triton.cdiv(triton.cdiv(max_context, MAX_SPLITS), 64) * 64)
        segments = triton.cdiv(max_context, segment)
        return cls(rows // group, rows, 64, segments if static else 1, segment, num_warps=4, num_stages=3,
                   segment=segment)

    @classmethod
    def for_call(cls, num_tokens: int | None, num_seqs: int, num_heads: int, num_kv_heads: int,
                 fp8_cells: bool = False) -> "LaunchConfig":
        """Small query tiles and enough splits to fill the GPU where the width is static (decode-sized steps);
        flash-attention tiles where it is dynamic (num_tokens None: prefill-sized steps), with a few splits so
        one long decode in a wide step does not become its tail, at the cost of a few programs that exit at
        once."""
        # Chosen on the H200 (scripts/device/attention_tune.py, llama-3.1-8b heads, bf16; docs/benchmarks.md):
        # three pipeline stages pay at every width (64 decodes at 4k context: 302 -> 247 us); 64-row tiles at
        # 4 warps prefill as fast as 128-row ones at 8 (228 vs 216 TFLOP/s at T=4096) and win on mixed steps.
        group = num_heads // num_kv_heads
        if num_tokens is None:
            rows = max(64, triton.next_power_of_2(group))
            return cls(rows // group, rows, 64, 4, 256, num_warps=4, num_stages=3, unmasked_bulk=True)
        # Programs unsplit count sequences, not the grid's query blocks: the grid's bound on blocks doubles
        # them for decodes (each sequence may add a partial block), and counting those kept 32 decodes at 4k
        # to one program per (sequence, KV head).
        rows = max(16, triton.next_power_of_2(group))
        unsplit = num_seqs * num_kv_heads
        splits = 1 if unsplit >= TARGET_PROGRAMS // 2 else max(1, min(MAX_SPLITS, TARGET_PROGRAMS // unsplit))
        min_split = WIDE_MIN_SPLIT if unsplit >= TARGET_PROGRAMS // 4 else MIN_SPLIT
        # e4m3 cells halve the bytes but not the latency of each block's cell-index load and gather: 128-cell
        # blocks halve the loads (H100, 32 / 64 decodes at 4k: 157 -> 125 / 267 -> 227 us; more splits were
        # slower), where bf16 cells already stream at the copy bandwidth with 64.
        block_n = 128 if fp8_cells else 64
        return cls(rows // group, rows, block_n, splits, min_split, num_warps=4, num_stages=3)

    def num_blocks(self, num_tokens, num_seqs):
        """The grid's upper bound on query blocks: each sequence adds at most one partial block."""
        return num_tokens // self.block_q + num_seqs


if triton is not None:

    @triton.jit
    def _num_splits(num_queries, num_entries, max_splits, BLOCK_Q: tl.constexpr, MIN_SPLIT: tl.constexpr):
        """How many programs share one sequence's KV walk (the same rule in both kernels)."""
        splits = tl.cdiv(num_entries, MIN_SPLIT)
        splits = tl.minimum(tl.maximum(splits, 1), max_splits)
        return tl.where(num_queries > BLOCK_Q, 1, splits)

    @triton.jit
    def _fold(m, segment_m):
        """Deterministic artifacts: the running max after one more segment, and the factors the running sums
        and the segment's are multiplied by before they are added (the same formula in both kernels). A
        segment a row saw nothing of (-inf) gives factors 1 and 0: the sums stay exactly as they were."""
        m_new = tl.maximum(m, segment_m)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, tl.math.exp2(m - shift), tl.math.exp2(segment_m - shift)

    @triton.jit
    def _attend_block(
        acc, m_i, l_i, q, position, start, hi, cells_ptr, k_pool_ptr, v_pool_ptr, kv_head, dims, dim_ok, scale_log2,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """One BLOCK_N step of the online softmax over entries start .. start + BLOCK_N of the sequence (cells_ptr:
        its index). MASKED: entries past `hi` or past a row's position are hidden; else every row sees them all."""
        entry = start + tl.arange(0, BLOCK_N)
        entry_ok = entry < hi
        if MASKED:
            cell = tl.load(cells_ptr + entry, mask=entry_ok, other=0)
            kv_mask = entry_ok[:, None] & dim_ok[None, :]
        else:
            cell = tl.load(cells_ptr + entry)
            kv_mask = dim_ok[None, :]
        kv_offsets = (cell * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_pool_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_pool_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASKED:
            visible = entry_ok[None, :] & (entry[None, :] <= position[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        if MASKED:
            # A row that has seen nothing yet keeps m = -inf; shift by 0 there so no -inf - -inf = NaN appears.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            shift = m_new  # finite: every row saw this block's entries
        p = tl.math.exp2(scores - shift[:, None])
        alpha = tl.math.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _cell_attention_kernel(
        out_ptr,  # [T, H, D], q's dtype
        partial_out_ptr,  # [T, H, S, D] fp32: unnormalised partial outputs of split walks
        partial_stats_ptr,  # [T, H, S, 2] fp32: running max (log2 units) and sum of each split
        q_ptr,  # [T, H, D]
        k_pool_ptr,  # [C, KVH, D]
        v_pool_ptr,
        k_scale_ptr,  # [KVH] fp32 with HAS_KV_SCALES (FP8 pools), else never read
        v_scale_ptr,
        positions_ptr,  # [T]
        query_indptr_ptr,  # [R+1]
        seq_indptr_ptr,  # [R+1]
        seq_cells_ptr,  # [E]
        block_seq_end_ptr,  # [grid's query blocks]: 1 + each block's sequence
        max_splits,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_SPLIT: tl.constexpr,
        SCALE_LOG2: tl.constexpr,  # softmax scale * log2(e): exp2 instead of exp
        PRECISION: tl.constexpr,
        HAS_KV_SCALES: tl.constexpr,
        FP16_DOTS: tl.constexpr,  # FP8 pools under a bf16 q: both dots in fp16 (the module docstring says why)
        UNMASKED_BULK: tl.constexpr,
        SEGMENT: tl.constexpr,  # deterministic: cells per segment (0: the split rule)
        FOLD_SEGMENTS: tl.constexpr,  # deterministic: this program walks and folds all its block's segments
    ):
        GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
        block = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        seq = tl.load(block_seq_end_ptr + block) - 1
        query_start = tl.load(query_indptr_ptr + seq)
        num_queries = tl.load(query_indptr_ptr + seq + 1) - query_start
        first_query = (block - (query_start // BLOCK_Q + seq)) * BLOCK_Q
        if first_query >= num_queries:
            return  # the grid is an upper bound on the number of query blocks
        entry_start = tl.load(seq_indptr_ptr + seq)
        num_entries = tl.load(seq_indptr_ptr + seq + 1) - entry_start
        if SEGMENT == 0:
            splits = _num_splits(num_queries, num_entries, max_splits, BLOCK_Q, MIN_SPLIT)
            if split >= splits:
                return

        # Rows: BLOCK_Q tokens x GROUP heads of this KV head, token-major.
        rows = tl.arange(0, BLOCK_M)
        query = first_query + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (query < num_queries)
        token = (query_start + query).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_offsets = (token * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if FP16_DOTS:
            q = q.to(tl.float16)  # _attend_block widens K and V to q's dtype
        position = tl.load(positions_ptr + token, mask=row_ok, other=0)

        # This block sees entries 0 .. its last token's position (never past its sequence's own entries);
        # a split takes a BLOCK_N-aligned share of them.
        last_query = tl.minimum(num_queries, first_query + BLOCK_Q) - 1
        entry_end = tl.minimum(tl.load(positions_ptr + query_start + last_query) + 1, num_entries)
        if SEGMENT > 0:
            splits = tl.cdiv(entry_end, SEGMENT)
            if split >= splits:
                return
            per_split = SEGMENT
        else:
            per_split = tl.cdiv(tl.cdiv(entry_end, splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(entry_end, lo + per_split)

        scale_log2 = SCALE_LOG2
        if HAS_KV_SCALES:
            scale_log2 = SCALE_LOG2 * tl.load(k_scale_ptr + kv_head)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if FOLD_SEGMENTS:
            # Each segment from fresh sums, folded into the row's running ones in order (_fold).
            for segment in range(0, splits):
                seg_lo = segment * SEGMENT
                seg_hi = tl.minimum(entry_end, seg_lo + SEGMENT)
                seg_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                seg_l = tl.zeros([BLOCK_M], dtype=tl.float32)
                seg_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                for start in range(seg_lo, seg_hi, BLOCK_N):
                    seg_acc, seg_m, seg_l = _attend_block(
                        seg_acc, seg_m, seg_l, q, position, start, seg_hi, seq_cells_ptr + entry_start, k_pool_ptr,
                        v_pool_ptr, kv_head, dims, dim_ok, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, PRECISION,
                        MASKED=True)
                if HAS_KV_SCALES:  # per segment, as the partials the merge kernel folds
                    seg_acc = seg_acc * tl.load(v_scale_ptr + kv_head)
                m_i, alpha, beta = _fold(m_i, seg_m)
                l_i = l_i * alpha + seg_l * beta
                acc = acc * alpha[:, None] + seg_acc * beta[:, None]
            splits = 1
            lo = hi  # walked above
        # UNMASKED_BULK: blocks every row sees whole (below the block's first position, inside [lo, hi)) skip the
        # masks; only the diagonal's blocks and a last partial one pay for them.
        unmasked_end = lo
        if UNMASKED_BULK:
            first_position = tl.load(positions_ptr + query_start + first_query)
            unmasked_end = lo + tl.maximum(tl.minimum(hi, first_position + 1) - lo, 0) // BLOCK_N * BLOCK_N
            for start in range(lo, unmasked_end, BLOCK_N):
                acc, m_i, l_i = _attend_block(
                    acc, m_i, l_i, q, position, start, hi, seq_cells_ptr + entry_start, k_pool_ptr, v_pool_ptr,
                    kv_head, dims, dim_ok, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, PRECISION, MASKED=False)
        for start in range(unmasked_end, hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, position, start, hi, seq_cells_ptr + entry_start, k_pool_ptr, v_pool_ptr, kv_head,
                dims, dim_ok, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, PRECISION, MASKED=True)

        if HAS_KV_SCALES and not FOLD_SEGMENTS:
            acc = acc * tl.load(v_scale_ptr + kv_head)
        out_mask = row_ok[:, None] & dim_ok[None, :]
        if splits == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            slot = (token * NUM_HEADS + head) * max_splits + split
            tl.store(partial_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
            tl.store(partial_stats_ptr + slot * 2, m_i, mask=row_ok)
            tl.store(partial_stats_ptr + slot * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,  # [T, H, D]
        partial_out_ptr,  # [T, H, S, D]
        partial_stats_ptr,  # [T, H, S, 2]
        token_seq_ptr,  # [T]
        query_indptr_ptr,
        seq_indptr_ptr,
        positions_ptr,  # [T] (deterministic artifacts)
        max_splits,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        MIN_SPLIT: tl.constexpr,
        SEGMENT: tl.constexpr,
    ):
        """One (token, head): combine its splits' partial results; tokens walked by one program are done."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        seq = tl.load(token_seq_ptr + token)
        query_start = tl.load(query_indptr_ptr + seq)
        num_queries = tl.load(query_indptr_ptr + seq + 1) - query_start
        num_entries = tl.load(seq_indptr_ptr + seq + 1) - tl.load(seq_indptr_ptr + seq)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        if SEGMENT > 0:
            # The segments of the token's query block (the main kernel's count), folded in order.
            first_query = (token - query_start) // BLOCK_Q * BLOCK_Q
            last_query = tl.minimum(num_queries, first_query + BLOCK_Q) - 1
            entry_end = tl.minimum(tl.load(positions_ptr + query_start + last_query) + 1, num_entries)
            segments = tl.cdiv(entry_end, SEGMENT)
            if segments == 1:
                return
            m = tl.full([1], float("-inf"), dtype=tl.float32)
            l = tl.zeros([1], dtype=tl.float32)
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for segment in range(0, segments):
                slot = (token * NUM_HEADS + head) * max_splits + segment
                seg_m = tl.load(partial_stats_ptr + slot * 2 + tl.zeros([1], dtype=tl.int64))
                seg_l = tl.load(partial_stats_ptr + slot * 2 + 1 + tl.zeros([1], dtype=tl.int64))
                seg_acc = tl.load(partial_out_ptr + slot * HEAD_DIM + dims, mask=dim_ok, other=0.0)
                m, alpha, beta = _fold(m, seg_m)
                l = l * alpha + seg_l * beta
                acc = acc * alpha + seg_acc * beta
            out = acc / l
            tl.store(out_ptr + (token * NUM_HEADS + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty),
                     mask=dim_ok)
            return
        splits = _num_splits(num_queries, num_entries, max_splits, BLOCK_Q, MIN_SPLIT)
        if splits == 1:
            return
        index = tl.arange(0, BLOCK_S)
        split_ok = index < splits
        slot = (token * NUM_HEADS + head) * max_splits + index
        m = tl.load(partial_stats_ptr + slot * 2, mask=split_ok, other=float("-inf"))
        l = tl.load(partial_stats_ptr + slot * 2 + 1, mask=split_ok, other=0.0)
        m_max = tl.max(m, 0)  # finite: split 0 always holds entry 0, which every token sees
        weight = tl.where(split_ok, tl.math.exp2(m - m_max), 0.0)
        total = tl.sum(weight * l, 0)
        partial = tl.load(partial_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :],
                          mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
        out = tl.sum(partial * weight[:, None], 0) / total
        tl.store(out_ptr + (token * NUM_HEADS + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    def launch_cell_attention(
        q, k_pool, v_pool, positions, token_seq, query_indptr, seq_indptr, seq_cells, block_seq_end,
        config: LaunchConfig, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run both kernels with an explicit launch config (the operator picks one per call site)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_pool.shape[1]
        splits = config.max_splits
        block_d = triton.next_power_of_2(head_dim)
        out = torch.empty_like(q)
        partial_out = q.new_empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32)
        partial_stats = q.new_empty((num_tokens, num_heads, splits, 2), dtype=torch.float32)
        torch.library.wrap_triton(_cell_attention_kernel)[(block_seq_end.shape[0], num_kv_heads, splits)](
            out, partial_out, partial_stats, q, k_pool, v_pool,
            k_scale if k_scale is not None else q, v_scale if v_scale is not None else q,  # q: never read
            positions, query_indptr, seq_indptr, seq_cells, block_seq_end, splits,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_Q=config.block_q, BLOCK_M=config.block_m, BLOCK_N=config.block_n, MIN_SPLIT=config.min_split,
            SCALE_LOG2=head_dim**-0.5 * LOG2E,
            # fp32 artifacts are compared token for token with fp32 references: no tf32 in their dots.
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_KV_SCALES=k_scale is not None,
            FP16_DOTS=k_scale is not None and q.dtype == torch.bfloat16,
            UNMASKED_BULK=config.unmasked_bulk, SEGMENT=config.segment,
            FOLD_SEGMENTS=config.segment > 0 and splits == 1, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if splits > 1:
            torch.library.wrap_triton(_merge_splits_kernel)[(num_tokens, num_heads)](
                out, partial_out, partial_stats, token_seq, query_indptr, seq_indptr, positions, splits,
                NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
                BLOCK_Q=config.block_q, MIN_SPLIT=config.min_split, SEGMENT=config.segment, num_warps=4,
            )
        return out

    @torch.library.triton_op("pt2serve::cell_attention", mutates_args=())
    def cell_attention(
        q: torch.Tensor,  # [T, H, D]
        k_pool: torch.Tensor,  # [C, KVH, D]
        v_pool: torch.Tensor,
        positions: torch.Tensor,  # [T]
        token_seq: torch.Tensor,  # [T]
        query_indptr: torch.Tensor,  # [R+1]
        seq_indptr: torch.Tensor,  # [R+1]
        seq_cells: torch.Tensor,  # [E]
        block_seq_end: torch.Tensor,  # [query blocks], from block_sequence_ends with this config
        block_q: int,  # the LaunchConfig fields, in order: fixed in the traced graph, never re-derived
        block_m: int,
        block_n: int,
        max_splits: int,
        min_split: int,
        num_warps: int,
        num_stages: int,
        unmasked_bulk: bool,
        segment: int,
        k_scale: torch.Tensor | None = None,  # [KVH] fp32: an FP8 pool's scales (both or neither)
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Each token attends over its own sequence's cells at positions 0 .. its own position."""
        config = LaunchConfig(block_q, block_m, block_n, max_splits, min_split, num_warps, num_stages, unmasked_bulk,
                              segment)
        return launch_cell_attention(
            q, k_pool, v_pool, positions, token_seq, query_indptr, seq_indptr, seq_cells, block_seq_end, config,
            k_scale, v_scale,
        )


def call_site_config(num_tokens, num_seqs, num_heads: int, num_kv_heads: int,
                     deterministic_context: int | None = None, fp8_cells: bool = False) -> LaunchConfig:
    """The config of a call site: a static method's width is an int when it is traced, forward_others' is
    symbolic; a deterministic artifact's (deterministic_context: its max context) walks every row alike;
    fp8_cells: the pools hold e4m3 cells."""
    static_width = num_tokens if isinstance(num_tokens, int) else None
    if deterministic_context is not None:
        return LaunchConfig.deterministic(static_width is not None, num_heads, num_kv_heads, deterministic_context)
    return LaunchConfig.for_call(static_width, num_seqs, num_heads, num_kv_heads, fp8_cells)
