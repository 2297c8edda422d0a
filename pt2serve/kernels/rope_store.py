"""Rotary embedding and the K/V write into the cells as one kernel (GPU artifacts).

Between a layer's qkv matmul and its attention, the plain path runs rope on q, rope on k, a scatter of k
into its cells and a scatter of v: three or four small kernels a layer, each a fixed few microseconds in a
decode step of a few milliseconds. This operator does all of it in one pass over the qkv rows: program
(b, h) rotates query head h of a block of tokens into q, or, for the last KV-head programs, rotates key head
h and writes it and the value head into each token's cell. With per-head RMSNorm on q and k (Qwen3) the norm runs
first, in the same program.

Every rounding follows the plain path in model/model.py, its reference: norm in fp32, cast, times the
weight in the model's dtype; rope in fp32 on the cast values, cast back to the model's dtype, then to the
pool's. An FP8 pool (model/kv_fp8.py) gets each head divided by its scale in fp32 first, clamped to e4m3's
range.
"""

from __future__ import annotations

import torch

try:  # Triton is needed to build GPU artifacts (and to run the kernel under TRITON_INTERPRET=1 on a CPU).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


if triton is not None:

    @triton.jit
    def _normed(x1, x2, norm_ptr, eps, half, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
        """Halves [BLOCK_T, D/2] of one head after its RMSNorm (when it has one), as fp32 of model-dtype values."""
        if HAS_NORM:
            dtype = x1.dtype
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            scale = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)[:, None]
            weight1 = tl.load(norm_ptr + half).to(tl.float32)[None, :]
            weight2 = tl.load(norm_ptr + half + HEAD_DIM // 2).to(tl.float32)[None, :]
            x1 = (weight1 * (a * scale).to(dtype).to(tl.float32)).to(dtype)
            x2 = (weight2 * (b * scale).to(dtype).to(tl.float32)).to(dtype)
        return x1.to(tl.float32), x2.to(tl.float32)

    @triton.jit
    def _to_pool(x, scale_ptr, kv_head, model_dtype: tl.constexpr, pool_dtype: tl.constexpr,
                 HAS_KV_SCALES: tl.constexpr):
        """fp32 values of one K or V head -> the pool's dtype, through the model's (and the head's scale)."""
        x = x.to(model_dtype)
        if HAS_KV_SCALES:
            x = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr + kv_head), -448.0, 448.0)  # e4m3's finite range
        return x.to(pool_dtype)

    @triton.jit
    def _rope_and_store_kernel(
        qkv_ptr, cos_ptr, sin_ptr, cells_ptr, q_norm_ptr, k_norm_ptr, q_ptr, k_pool_ptr, v_pool_ptr,
        k_scale_ptr, v_scale_ptr, num_tokens, stride_qkv, stride_rope, eps,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
        BLOCK_T: tl.constexpr, HAS_KV_SCALES: tl.constexpr,
    ):
        """Program (b, h): tokens b*BLOCK_T.., query head h (h < NUM_HEADS), else key/value head h - NUM_HEADS."""
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = (tokens < num_tokens)[:, None]
        head = tl.program_id(1)
        half = tl.arange(0, HEAD_DIM // 2)
        # cos/sin rows hold the angles twice (cat(freqs, freqs)): the first half serves both halves.
        cos = tl.load(cos_ptr + tokens[:, None] * stride_rope + half[None, :], mask=ok, other=0)
        sin = tl.load(sin_ptr + tokens[:, None] * stride_rope + half[None, :], mask=ok, other=0)
        rows = qkv_ptr + tokens[:, None] * stride_qkv
        first, second = half[None, :], HEAD_DIM // 2 + half[None, :]
        if head < NUM_HEADS:
            src = rows + head * HEAD_DIM
            x1, x2 = _normed(tl.load(src + first, mask=ok, other=0), tl.load(src + second, mask=ok, other=0),
                             q_norm_ptr, eps, half, HEAD_DIM, HAS_NORM)
            dst = q_ptr + (tokens[:, None] * NUM_HEADS + head) * HEAD_DIM
            tl.store(dst + first, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + second, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=ok)
        else:
            kv_head = head - NUM_HEADS
            key = rows + (NUM_HEADS + kv_head) * HEAD_DIM
            x1, x2 = _normed(tl.load(key + first, mask=ok, other=0), tl.load(key + second, mask=ok, other=0),
                             k_norm_ptr, eps, half, HEAD_DIM, HAS_NORM)
            model_dtype = q_ptr.dtype.element_ty
            pool_dtype = k_pool_ptr.dtype.element_ty
            cells = tl.load(cells_ptr + tokens, mask=tokens < num_tokens, other=0)
            # Names apart from the query branch's: Triton types a name across both branches of an if.
            cell_offset = (cells[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(k_pool_ptr + cell_offset + first,
                     _to_pool(x1 * cos - x2 * sin, k_scale_ptr, kv_head, model_dtype, pool_dtype, HAS_KV_SCALES),
                     mask=ok)
            tl.store(k_pool_ptr + cell_offset + second,
                     _to_pool(x2 * cos + x1 * sin, k_scale_ptr, kv_head, model_dtype, pool_dtype, HAS_KV_SCALES),
                     mask=ok)
            values = rows + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            full = tl.arange(0, HEAD_DIM)[None, :]
            value = tl.load(values + full, mask=ok, other=0).to(tl.float32)
            tl.store(v_pool_ptr + cell_offset + full,
                     _to_pool(value, v_scale_ptr, kv_head, model_dtype, pool_dtype, HAS_KV_SCALES), mask=ok)

    def launch_rope_and_store(
        qkv, cos, sin, write_cells, k_pool, v_pool, q_norm_weight, k_norm_weight, eps: float, num_heads: int,
        num_kv_heads: int, block_t: int, k_scale=None, v_scale=None,
    ) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        head_dim = k_pool.shape[-1]
        q = qkv.new_empty((num_tokens, num_heads, head_dim))
        has_norm = q_norm_weight is not None
        grid = (triton.cdiv(num_tokens, block_t), num_heads + num_kv_heads)
        torch.library.wrap_triton(_rope_and_store_kernel)[grid](
            qkv, cos, sin, write_cells,
            q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,  # qkv: never read
            q, k_pool, v_pool,
            k_scale if k_scale is not None else qkv, v_scale if v_scale is not None else qkv,  # qkv: never read
            num_tokens, qkv.stride(0), cos.stride(0), eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm, BLOCK_T=block_t,
            HAS_KV_SCALES=k_scale is not None,
            num_warps=1 if block_t * head_dim <= 128 else 4,
        )
        return q

    @torch.library.triton_op("pt2serve::rope_and_store", mutates_args={"k_pool", "v_pool"})
    def rope_and_store(
        qkv: torch.Tensor,  # [T, (H + 2 KVH) D]: q, k, v heads of each token, rows contiguous
        cos: torch.Tensor,  # [T, D] fp32
        sin: torch.Tensor,
        write_cells: torch.Tensor,  # [T] int64
        k_pool: torch.Tensor,  # [C, KVH, D], written in place
        v_pool: torch.Tensor,
        q_norm_weight: torch.Tensor | None,  # [D]: per-head RMSNorm weights (Qwen3), or None
        k_norm_weight: torch.Tensor | None,
        eps: float,
        num_heads: int,
        num_kv_heads: int,
        k_scale: torch.Tensor | None = None,  # [KVH] fp32: an FP8 pool's scales (both or neither)
        v_scale: torch.Tensor | None = None,
        deterministic: bool = False,  # one tile at every width (a deterministic artifact)
    ) -> torch.Tensor:  # q [T, H, D], rotated
        """Rope on q and k (after their norms), k and v written into each token's cell."""
        return launch_rope_and_store(qkv.contiguous(), cos.contiguous(), sin.contiguous(), write_cells, k_pool,
                                     v_pool, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads,
                                     tokens_per_program(qkv.shape[0], deterministic), k_scale, v_scale)


def tokens_per_program(num_tokens, deterministic: bool = False) -> int:
    """A static width (an int when traced) has few tokens: one per program spreads them widest. A dynamic
    one (forward_others, symbolic) may hold thousands: 16 per program keeps the programs few. A deterministic
    artifact takes 16 everywhere: the tile (and its warps) decides the order of a head's norm sum."""
    if deterministic:
        return 16
    return 1 if isinstance(num_tokens, int) and num_tokens <= 64 else 16

