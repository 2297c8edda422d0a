"""The Triton kernels of the quantized linear against the PyTorch reference, on random formats and shapes.

Without a GPU they run under TRITON_INTERPRET=1 (set by conftest.py; numpy on the CPU), in fp32: the interpreter computes a
bf16 tl.dot in fp32, so bf16 would test nothing more. With a GPU they run compiled, on CUDA tensors.
Shapes are chosen to be no multiple of the tile sizes, and formats to take both scale paths (a run of
columns inside one group, and groups narrower than a run).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pt2serve.kernels.quant_linear import dequantize, pack, reference_quant_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton was not put in interpreter mode (tests/conftest.py does that)")
    return importlib.import_module("pt2serve.kernels.quant_linear_triton")


def random_format(bits: int, n: int, k: int, group_size: int, has_zeros: bool, has_perm: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    num_groups = -(-k // group_size)
    scales = torch.rand(n, num_groups, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 2**bits, (n, num_groups), generator=gen).to(torch.uint8) if has_zeros else None
    perm = torch.randperm(k, generator=gen) if has_perm else None
    tensors = [pack(q, bits), scales, zeros, perm]
    return [t.to(DEVICE) if t is not None else None for t in tensors]


FORMATS = [
    # bits, n, k, group size, zeros, perm
    (4, 100, 200, 64, True, False),
    (4, 72, 384, 128, False, True),  # one full 256-column block and a short one
    (4, 33, 96, 32, True, True),
    (4, 48, 250, 250, True, False),  # one group per row, K no multiple of any tile
    (4, 40, 768, 128, True, False),  # groups of 128 in whole blocks: every nibble run inside one group
    (8, 100, 200, 64, False, False),
    (8, 50, 160, 160, False, True),
    (8, 40, 96, 32, True, False),
    (8, 24, 512, 128, True, True),
]
WIDTHS = (1, 3, 16, 64, 65, 200)  # gemv, dot, the last static width, the dequantize-and-multiply path


def format_id(fmt) -> str:
    return "int{}-n{}-k{}-g{}-z{}-p{}".format(fmt[0], fmt[1], fmt[2], fmt[3], int(fmt[4]), int(fmt[5]))


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("fmt", FORMATS, ids=format_id)
def test_operator_matches_reference_at_every_width(kernels, fmt):
    bits, n, k, group_size, has_zeros, has_perm = fmt
    qweight, scales, zeros, perm = random_format(bits, n, k, group_size, has_zeros, has_perm, seed=n + k)
    for num_rows in WIDTHS:
        x = torch.randn(num_rows, k, device=DEVICE)
        out = torch.ops.pt2serve.quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
        check(out, reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size))


@pytest.mark.parametrize("fmt", [FORMATS[i] for i in (0, 1, 4, 5, 8)], ids=format_id)
def test_every_small_m_candidate_matches_reference(kernels, fmt):
    """Each config the GPU benchmark may pick computes the same thing (gemv and dot, split K or not)."""
    bits, n, k, group_size, has_zeros, has_perm = fmt
    qweight, scales, zeros, perm = random_format(bits, n, k, group_size, has_zeros, has_perm, seed=2 * n + k)
    for num_rows in (1, 5, 33):
        x = torch.randn(num_rows, k, device=DEVICE)
        ref = reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
        candidates = kernels.small_m_candidates(num_rows, n, k, bits, kernels.DEFAULT_NUM_SMS)
        assert any(not c.use_dot for c in candidates) == (num_rows <= kernels.GEMV_M_MAX)
        for config in candidates:
            out = kernels.launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, config)
            check(out, ref)


def test_both_scale_paths_are_exercised(kernels):
    """Runs inside one group scale once per row; others per column. The formats above take both."""
    assert kernels._uniform_groups(4, 4096, 128, 128)  # llama shapes at the default int4 group size
    assert kernels._uniform_groups(8, 4096, 4096, 256)  # int8, one group per row
    assert kernels._uniform_groups(4, 768, 128, 64)
    assert not kernels._uniform_groups(4, 384, 128, 128)  # the short block's high run starts at column 320
    assert not kernels._uniform_groups(4, 96, 32, 64)


def test_small_m_kernel_splits_k(kernels):
    """Few outputs and long rows: the default config splits K and the partial sums add up."""
    bits, group_size = 4, 128
    qweight, scales, zeros, perm = random_format(bits, 40, 4096, group_size, True, False, seed=7)
    for num_rows in (1, 16):
        config = kernels.small_m_config(num_rows, 40, 4096, bits, kernels.DEFAULT_NUM_SMS)
        assert config.split_k > 1
        x = torch.randn(num_rows, 4096, device=DEVICE)
        out = kernels.launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, config)
        check(out, reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size))


@pytest.mark.parametrize("fmt", [FORMATS[i] for i in (1, 2, 4, 7)], ids=format_id)
def test_dequantize_kernel_matches_the_format(kernels, fmt):
    bits, n, k, group_size, has_zeros, has_perm = fmt
    qweight, scales, zeros, _ = random_format(bits, n, k, group_size, has_zeros, has_perm, seed=5)
    weight = kernels.dequantize_weight(qweight, scales, zeros, bits, group_size, k, torch.float32)
    assert torch.equal(weight, dequantize(qweight, scales, zeros, bits, group_size))


def test_operator_exports_with_a_dynamic_width(tmp_path):
    """torch.export keeps the op whole, static or with a dynamic token count (no guard on the width).

    In a fresh process without the interpreter: export hands fake tensors to the kernels, which the
    interpreter would try to run.
    """
    script = textwrap.dedent("""
        import torch
        from torch.export import Dim
        from pt2serve.kernels.quant_linear import pack
        from pt2serve.kernels import quant_linear_triton  # noqa: F401

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("qweight", pack(torch.randint(0, 16, (96, 128)), 4))
                self.register_buffer("scales", torch.rand(96, 2))
                self.register_buffer("perm", torch.randperm(128))

            def forward(self, x):
                return torch.ops.pt2serve.quant_linear(x, self.qweight, self.scales, None, self.perm, 4, 64)

        dynamic = torch.export.export(Layer(), (torch.randn(80, 128),),
                                      dynamic_shapes=({0: Dim("tokens", min=2, max=4097)},), strict=False)
        static = torch.export.export(Layer(), (torch.randn(4, 128),), strict=False)
        for program in (dynamic, static):
            targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
            assert targets == ["pt2serve.quant_linear.default"], targets
        print("exported")
    """)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "exported" in done.stdout, done.stderr[-3000:]


def test_device_benchmark_runs_on_the_cpu():
    """scripts/device/quant_kernels.py --cpu-smoke: every row of both tables is computed, and correct."""
    script = Path(__file__).parents[1] / "scripts" / "device" / "quant_kernels.py"
    done = subprocess.run([sys.executable, str(script), "--cpu-smoke", "--widths", "1,65", "--configs"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["tiny"]]
    widths = [(row[1], row[2]) for row in rows[:4]]
    assert widths == [("int8", "1"), ("int8", "65"), ("int4", "1"), ("int4", "65")]
    configs = rows[4:]
    assert len(configs) > 10 and {row[3] for row in configs} == {"gemv", "dot"}
    errors = [float(row[3]) for row in rows[:4]] + [float(row[-3]) for row in configs]
    assert max(errors) < 1e-5
