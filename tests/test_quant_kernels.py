"""The Triton kernels of the quantized linear against the PyTorch reference, on random formats and shapes.

Without a GPU they run under TRITON_INTERPRET=1 (set by conftest.py; numpy on the CPU), in fp32: the interpreter computes a
bf16 tl.dot in fp32, so bf16 would test nothing more. With a GPU they run compiled, on CUDA tensors.
Shapes are chosen to be no multiple of the tile sizes, and configs to take both scale paths (a tile
inside one group, and groups narrower than a tile).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from pt2serve.kernels.quant_linear import pack, reference_quant_linear  # noqa: E402

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
    (4, 72, 384, 128, False, True),
    (4, 33, 96, 32, True, True),
    (4, 48, 250, 250, True, False),  # one group per row, K no multiple of any tile
    (8, 100, 200, 64, False, False),
    (8, 50, 160, 160, False, True),
    (8, 40, 96, 32, True, False),
]


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"int{f[0]}-n{f[1]}-k{f[2]}-g{f[3]}-z{int(f[4])}-p{int(f[5])}")
def test_small_m_kernel_matches_reference(kernels, fmt):
    bits, n, k, group_size, has_zeros, has_perm = fmt
    qweight, scales, zeros, perm = random_format(bits, n, k, group_size, has_zeros, has_perm, seed=n + k)
    configs = [
        kernels.LaunchConfig(16, 16, 32, num_warps=4, num_stages=2),  # tiles inside one group
        kernels.LaunchConfig(16, 32, 256 if bits == 4 else 128, num_warps=4, num_stages=2, split_k=2),
        kernels.LaunchConfig(64, 16, 64, num_warps=4, num_stages=2, split_k=3),
    ]
    for num_rows in (1, 5, 33):
        x = torch.randn(num_rows, k, device=DEVICE)
        ref = reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
        for config in configs:
            if config.block_m < num_rows:
                continue
            out = kernels.launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, config, m_limit=64)
            check(out, ref)


@pytest.mark.parametrize("fmt", FORMATS[:3] + FORMATS[4:6], ids=lambda f: f"int{f[0]}-k{f[2]}-g{f[3]}")
def test_wide_m_kernel_matches_reference(kernels, fmt):
    bits, n, k, group_size, has_zeros, has_perm = fmt
    qweight, scales, zeros, perm = random_format(bits, n, k, group_size, has_zeros, has_perm, seed=3 * n + k)
    x = torch.randn(70, k, device=DEVICE)
    ref = reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
    for config in (kernels.LaunchConfig(32, 32, 32, 4, 2), kernels.wide_m_config(bits)):
        out = torch.full_like(ref, float("nan"))
        kernels.launch_wide_m(x, qweight, scales, zeros, perm, bits, group_size, config, 0, out)
        check(out, ref)


def test_operator_picks_a_kernel_by_width(kernels):
    """torch.ops.pt2serve.quant_linear: small widths (split K by the heuristic) and wide ones."""
    bits, group_size = 4, 128
    qweight, scales, zeros, perm = random_format(bits, 40, 4096, group_size, True, False, seed=7)
    split = kernels.small_m_config(1, 40, 4096, bits, kernels.DEFAULT_NUM_SMS).split_k
    assert split > 1  # few outputs, long rows: this shape must exercise the split-K reduction
    for num_rows in (1, 64, 65):
        x = torch.randn(num_rows, 4096, device=DEVICE)
        out = torch.ops.pt2serve.quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
        check(out, reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size))


def test_dynamic_width_runs_exactly_one_kernel(kernels):
    """forward_others launches both kernels on one output: each must leave other widths alone."""
    bits, group_size, k = 4, 64, 192
    qweight, scales, zeros, perm = random_format(bits, 48, k, group_size, True, True, seed=11)
    small = kernels.LaunchConfig(64, 16, 64, 4, 2)
    wide = kernels.LaunchConfig(32, 32, 64, 4, 2)
    limit = kernels.SMALL_M_MAX
    for num_rows, owner in ((5, "small"), (limit, "small"), (limit + 1, "wide"), (100, "wide")):
        x = torch.randn(num_rows, k, device=DEVICE)
        ref = reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
        out = torch.full_like(ref, float("nan"))
        kernels.launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, small, m_limit=limit, out=out)
        assert bool(out.isnan().all()) == (owner == "wide"), (num_rows, owner)
        kernels.launch_wide_m(x, qweight, scales, zeros, perm, bits, group_size, wide, limit, out)
        check(out, ref)


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
