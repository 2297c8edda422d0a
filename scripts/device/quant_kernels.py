"""The quantized linear's kernels on the llama-3.1-8b shapes, next to bf16 torch.mm and the read floor.

Usage (GPU):  python scripts/device/quant_kernels.py [--widths 1,16,32,64,128,1024] [--configs]
       (CPU):  python scripts/device/quant_kernels.py --cpu-smoke   (tiny shapes in Triton's interpreter)

For each layer shape, bits (int8 per row, int4 group 128 with zero points) and width M it prints the
op's max error relative to the reference (dequantize then matmul), bf16 torch.mm's time, the op's time,
the floor (the bytes the op must read, over the device's read bandwidth), op/floor and op/mm. With
--configs it also times every small-M launch config (kernels/quant_linear_triton.py small_m_candidates,
the first one is the default) for the widths <= 64, so the default can be set to the winner. On the GPU it
also times torch's own weight-only kernels on the same weights, as a peer: `_weight_int4pack_mm` (tinygemm:
int4 with a float zero point per group) and `_weight_int8pack_mm` (int8 per row), where this torch has them
for CUDA. The plain run takes well under a minute on an H200; --configs compiles and times about fifty
configs per layer and bits (a few minutes: narrow it with --widths 1,16,64). --probe times, for the export's
tuning candidates at M = 1, a kernel that only streams the packed bytes with the same grid and tiles (each
byte loaded and added to an integer sum, nothing else): near the floor, the op's time beyond it is the
dequantizing arithmetic; far from it, the tiles or the grid cannot keep enough bytes in flight.

How it measures: a step of a decoder reads each weight once, from DRAM. Timing one weight in a loop of
CUDA-graph replays would serve it from L2 (50 MB on an H200 holds a whole int8 or int4 matrix), so each
measurement captures calls over enough copies of the weights that one pass reads 256 MB (the export's
tuning's rotation_copies), and divides the replay time by the number of copies. The floor's bandwidth is a
pure read (torch.sum over 1 GiB), not a copy's read + write.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

if "--cpu-smoke" in sys.argv:  # read when Triton is imported: before anything imports it
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pt2serve.export.linear_tuning import rotation_copies  # noqa: E402
from pt2serve.kernels import quant_linear_triton as kernels  # noqa: E402  (registers the op)
from pt2serve.kernels.graph_timing import graph_replay_ms  # noqa: E402
from pt2serve.kernels.quant_format import pack, reference_quant_linear, unpack  # noqa: E402

GPU_SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
              "down_proj": (4096, 14336)}
SMOKE_SHAPES = {"tiny": (72, 384)}  # N no multiple of a tile, K ending in a short int4 block
REPLAYS = 10


@dataclass(frozen=True)
class Weights:
    """One copy of a layer's packed weights (and, for the baseline, its bf16 matrix)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    dense: torch.Tensor

    @property
    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)


def make_weights(n: int, k: int, bits: int, group_size: int, device: str, dtype: torch.dtype, seed: int) -> Weights:
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), device=device, generator=gen)
    num_groups = -(-k // group_size)
    scales = (torch.rand(n, num_groups, device=device, generator=gen) * 0.01 + 1e-3).to(dtype)
    zeros = None if bits == 8 else torch.randint(0, 16, (n, num_groups), device=device, generator=gen).to(torch.uint8)
    dense = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
    return Weights(pack(q, bits), scales, zeros, dense)


def aten_peer(weights: Weights, bits: int, group_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's own kernel for these weights, in its layout: w = (q - 8) * scale + zero for tinygemm's int4, so
    zero = (8 - our integer zero) * scale; w = q * scale for int8 per row, so q = ours - 128."""
    q = unpack(weights.qweight, bits)
    if bits == 8:
        signed = (q.to(torch.int16) - 128).to(torch.int8)
        scales = weights.scales.flatten().contiguous()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, signed, scales)
    inner_k_tiles = 8
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), inner_k_tiles)
    scales = weights.scales.float()
    zeros = (8 - weights.zeros.float()) * scales
    scales_and_zeros = torch.stack((scales, zeros), dim=2).transpose(0, 1).contiguous().to(weights.scales.dtype)
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


@triton.jit
def stream_kernel(q_ptr, out_ptr, N, row_bytes, bytes_per_split, stride_qn,
                  BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """The small-M kernel's reads alone: program (n, s) loads the bytes of split s of rows n*BLOCK_N.. in steps
    of BLOCK_B, adds them up as integers and stores one sum per row (so the loads cannot be dropped)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_start = tl.program_id(1) * bytes_per_split
    b_end = tl.minimum(b_start + bytes_per_split, row_bytes)
    acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.int32)
    for b0 in range(b_start, b_end, BLOCK_B):
        offs_b = tl.max_contiguous(tl.multiple_of(b0 + tl.arange(0, BLOCK_B), BLOCK_B), BLOCK_B)
        mask = n_mask[:, None] & (offs_b < b_end)[None, :]
        acc += tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :], mask=mask, other=0).to(tl.int32)
    tl.store(out_ptr + tl.program_id(1) * N + offs_n, tl.sum(acc, axis=1), mask=n_mask)


def stream(qweight: torch.Tensor, config, out: torch.Tensor) -> torch.Tensor:
    """stream_kernel over qweight with config's tiles, warps and split (out: [splits, N] int32)."""
    n, row_bytes = qweight.shape
    bytes_per_split = kernels._bytes_per_split(row_bytes, config.split_k, config.block_bytes)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(row_bytes, bytes_per_split))
    stream_kernel[grid](qweight, out, n, row_bytes, bytes_per_split, qweight.stride(0),
                        BLOCK_N=config.block_n, BLOCK_B=config.block_bytes, num_warps=config.num_warps)
    return out


def copies_for(nbytes: int, device: str) -> int:
    return rotation_copies(nbytes) if device == "cuda" else 1


def weight_copies(n: int, k: int, bits: int, group_size: int, device: str, dtype: torch.dtype) -> list[Weights]:
    """Enough copies of a layer's weights that one pass over them reads past L2 (one on the CPU)."""
    first = make_weights(n, k, bits, group_size, device, dtype, seed=0)
    return [first] + [make_weights(n, k, bits, group_size, device, dtype, seed=i)
                      for i in range(1, copies_for(first.packed_bytes, device))]


def time_ms(calls: list[Callable[[], object]], device: str) -> float:
    """Median time of one call, when the calls run back to back (one CUDA graph replays them all)."""
    if device != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3 / len(calls)
    return graph_replay_ms(lambda: [call() for call in calls], REPLAYS) / len(calls)


def read_bandwidth(device: str) -> float:
    """Bytes/s of reading a 1 GiB buffer once (torch.sum: a read-only stream), best of two dtypes."""
    nbytes = 2**30 if device == "cuda" else 2**24
    best = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        buffer = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
        ms = time_ms([lambda: buffer.sum()] * 4, device)
        best = max(best, nbytes / (ms / 1e3))
        del buffer
    return best


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def probe(shapes: dict, device: str, bandwidth: float) -> None:
    """Per tuning candidate at M = 1: the op's time next to the time of streaming its bytes alone."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    num_sms = kernels.sm_count(torch.device(device))
    print(f"\nthe bytes alone (M = 1; read bandwidth {bandwidth / 1e9:.0f} GB/s)")
    print(f"{'layer':>13} {'bits':>5} {'config':>34} {'op ms':>8} {'bytes ms':>8} {'floor ms':>8} {'bytes/floor':>11}")
    for name, (n, k) in shapes.items():
        for bits, group_size in ((8, k), (4, 128)):
            copies = weight_copies(n, k, bits, group_size, device, dtype)
            first = copies[0]
            x = torch.randn(1, k, device=device, dtype=dtype)
            floor_ms = first.qweight.numel() / bandwidth * 1e3
            candidates = kernels.tuning_candidates(1, n, k, bits, num_sms)
            # In Triton's interpreter each config takes seconds: the smoke run probes the first two.
            for config in candidates if device == "cuda" else candidates[:2]:
                out = torch.empty((config.split_k, n), dtype=torch.int32, device=device)
                got = stream(first.qweight, config, out).to(torch.int64).sum(0)
                assert torch.equal(got, first.qweight.to(torch.int64).sum(1)), f"bytes misread: {config.name}"
                op_ms = time_ms([lambda w=w, c=config: kernels.launch_small_m(
                    x, w.qweight, w.scales, w.zeros, None, bits, group_size, c) for w in copies], device)
                bytes_ms = time_ms([lambda w=w, c=config: stream(w.qweight, c, out) for w in copies], device)
                print(f"{name:>13} {f'int{bits}':>5} {config.name:>34} {op_ms:8.4f} {bytes_ms:8.4f} {floor_ms:8.4f} "
                      f"{bytes_ms / floor_ms:11.2f}")
            del copies


def measure(shapes: dict, widths: list[int], with_configs: bool, device: str, bandwidth: float) -> None:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"read bandwidth {bandwidth / 1e9:.0f} GB/s (torch.sum over a large buffer)")
    num_sms = kernels.sm_count(torch.device(device))
    rows, config_rows, peer_rows = [], [], []
    for name, (n, k) in shapes.items():
        for bits, group_size in ((8, k), (4, 128)):
            op_copies = weight_copies(n, k, bits, group_size, device, dtype)
            first = op_copies[0]
            # The packed weights are smaller than the bf16 ones: their copies hold enough bf16 copies.
            dense_copies = [w.dense for w in op_copies[:copies_for(first.dense.numel() * 2, device)]]
            peers = None
            if device == "cuda":
                try:
                    peers = [aten_peer(w, bits, group_size) for w in op_copies]
                except (RuntimeError, NotImplementedError) as err:  # not in this torch, or not for CUDA
                    print(f"torch's int{bits} kernel: not available here ({str(err).splitlines()[0][:100]})")
            for m in widths:
                x = torch.randn(m, k, device=device, dtype=dtype)
                args = (first.qweight, first.scales, first.zeros, None, bits, group_size)
                ref = reference_quant_linear(x, *args)
                error = relative_error(torch.ops.pt2serve.quant_linear(x, *args), ref)
                mm = time_ms([lambda w=w: torch.mm(x, w.T) for w in dense_copies], device)
                op = time_ms([lambda w=w: torch.ops.pt2serve.quant_linear(x, w.qweight, w.scales, w.zeros, None, bits,
                                                                            group_size) for w in op_copies], device)
                floor_ms = (first.packed_bytes + x.element_size() * m * (n + k)) / bandwidth * 1e3
                rows.append((name, f"int{bits}", m, error, mm, op, floor_ms))
                if peers is not None:
                    try:
                        peer_error = relative_error(peers[0](x), ref)
                        peer_ms = time_ms([lambda p=p: p(x) for p in peers], device)
                        peer_rows.append((name, f"int{bits}", m, peer_error, peer_ms, op, floor_ms))
                    except (RuntimeError, NotImplementedError) as err:
                        print(f"torch's int{bits} kernel at M={m}: {str(err).splitlines()[0][:100]}")
                if with_configs and m <= kernels.SMALL_M_MAX:
                    for config in kernels.small_m_candidates(m, n, k, bits, num_sms):
                        out = kernels.launch_small_m(x, *args[:4], bits, group_size, config)
                        config_ms = time_ms([lambda w=w, c=config: kernels.launch_small_m(
                            x, w.qweight, w.scales, w.zeros, None, bits, group_size, c) for w in op_copies], device)
                        config_rows.append((name, f"int{bits}", m, config.name, relative_error(out, ref), config_ms,
                                            floor_ms))
            del op_copies, dense_copies
    print(f"{'layer':>13} {'bits':>5} {'M':>5} {'rel err':>8} {'bf16 mm':>8} {'op ms':>8} {'floor ms':>8} "
          f"{'op/floor':>8} {'op/mm':>6}")
    for name, bits, m, error, mm, op, floor_ms in rows:
        print(f"{name:>13} {bits:>5} {m:>5} {error:8.1e} {mm:8.4f} {op:8.4f} {floor_ms:8.4f} "
              f"{op / floor_ms:8.2f} {op / mm:6.2f}")
    if peer_rows:
        print("\ntorch's own weight-only kernels on the same weights (a peer)")
        print(f"{'layer':>13} {'bits':>5} {'M':>5} {'rel err':>8} {'torch ms':>8} {'/floor':>7} {'op/torch':>8}")
        for name, bits, m, error, ms, op, floor_ms in peer_rows:
            print(f"{name:>13} {bits:>5} {m:>5} {error:8.1e} {ms:8.4f} {ms / floor_ms:7.2f} {op / ms:8.2f}")
    if config_rows:
        print("\nsmall-M launch configs (the first of each group is the default)")
        print(f"{'layer':>13} {'bits':>5} {'M':>5} {'config':>34} {'rel err':>8} {'ms':>8} {'/floor':>7}")
        for name, bits, m, config, error, ms, floor_ms in config_rows:
            print(f"{name:>13} {bits:>5} {m:>5} {config:>34} {error:8.1e} {ms:8.4f} {ms / floor_ms:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default=None, help="comma-separated M values")
    parser.add_argument("--configs", action="store_true", help="also time every small-M launch config")
    parser.add_argument("--probe", action="store_true", help="also time streaming the packed bytes alone (M = 1)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU in Triton's interpreter")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, shapes, default_widths = "cpu", SMOKE_SHAPES, "1,3,16,65"
    else:
        if not torch.cuda.is_available():
            sys.exit("no GPU: run with --cpu-smoke to check the script on the CPU")
        device, shapes, default_widths = "cuda", GPU_SHAPES, "1,16,32,64,128,1024"
    widths = [int(m) for m in (args.widths or default_widths).split(",")]
    bandwidth = read_bandwidth(device)
    measure(shapes, widths, args.configs, device, bandwidth)
    if args.probe:
        probe(shapes, device, bandwidth)


if __name__ == "__main__":
    main()
