"""The Triton kernels of the quantized linear against the PyTorch reference, on random formats and shapes.

Without a GPU they run under TRITON_INTERPRET=1 (set by conftest.py; numpy on the CPU), in fp32: the interpreter computes a
bf16 tl.dot in fp32, so bf16 would test nothing more. With a GPU they run compiled, on CUDA tensors.
Shapes are chosen to be no multiple of the tile sizes, and formats to take both scale paths (a run of
columns inside one group, and groups narrower than a run).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

from fresh_process import run_without_interpreter  # noqa: E402
from pt2serve.kernels.quant_format import dequantize, pack, reference_quant_linear  # noqa: E402
from conftest import triton_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels():
    return triton_kernels("pt2serve.kernels.quant_linear_triton")


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


def check(out: torch.Tensor, ref: torch.Tensor, msg: str | None = None) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()), msg=msg)


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
            try:
                out = kernels.launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, config)
            except OutOfResources:
                # fp32 dot tiles of 256 int4 columns, 3-4 pipeline stages deep, outgrow an H200's shared memory
                # (250-655 KB), and the tuner skips what the GPU refuses; in bf16, what models serve, all fit.
                x16, scales16 = x.bfloat16(), scales.bfloat16()
                out = kernels.launch_small_m(x16, qweight, scales16, zeros, perm, bits, group_size, config).float()
                ref16 = reference_quant_linear(x16.float(), qweight, scales16.float(), zeros, perm, bits, group_size)
                torch.testing.assert_close(out, ref16, atol=2e-2 * float(ref16.abs().max()), rtol=2e-2,
                                           msg=config.name)
                continue
            check(out, ref, config.name)


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


STEP_CASES = [
    # format, block bytes, split K, whether every step of every split is whole (EVEN_B)
    ((4, 40, 1024, 128, True, False), 64, 2, True),
    ((4, 24, 1152, 64, True, True), 64, 3, True),  # a short block of 128 columns: its halves are whole steps
    ((4, 40, 1000, 128, False, True), 64, 2, False),  # 500 bytes: the last step is cut short
    ((4, 40, 1152, 128, False, False), 128, 1, False),  # the short block's 64 bytes are half a step
    ((8, 40, 640, 128, False, False), 128, 2, True),  # splits of 384 and 256 bytes: whole steps either way
    ((8, 40, 520, 64, True, True), 128, 2, False),
]


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda case: f"{format_id(case[0])}-b{case[1]}-k{case[2]}")
def test_whole_and_partial_steps_match_reference(kernels, case):
    """Rows of whole steps load with one mask per step (EVEN_B), the others with one per byte; the gemv
    kernel's load of the step past its split must not read past the row either way."""
    fmt, block_bytes, split_k, whole = case
    bits, n, k, group_size, has_zeros, has_perm = fmt
    row_bytes = k * bits // 8
    assert kernels._whole_steps(row_bytes, block_bytes) == whole
    qweight, scales, zeros, perm = random_format(bits, n, k, group_size, has_zeros, has_perm, seed=k + block_bytes)
    for num_rows in (1, kernels.GEMV_M_MAX + 5):
        use_dot = num_rows > kernels.GEMV_M_MAX
        block_m = 16 if use_dot else 1
        config = kernels.QuantLaunchConfig(use_dot, block_m, 16, block_bytes, 4, 2 if use_dot else 1, split_k)
        x = torch.randn(num_rows, k, device=DEVICE)
        out = kernels.launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, config)
        check(out, reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size))


def test_one_row_gemv_steps_are_whole_lanes(kernels):
    """At M = 1 each thread of the gemv kernel loads GEMV_LANE bytes of a row: a step must hold whole lanes."""
    qweight, scales, zeros, perm = random_format(8, 16, 64, 64, False, False, seed=3)
    config = kernels.QuantLaunchConfig(False, 1, 16, kernels.GEMV_LANE.value // 2, 4, 1, 1)
    with pytest.raises(ValueError, match="whole lanes"):
        kernels.launch_small_m(torch.randn(1, 64, device=DEVICE), qweight, scales, zeros, perm, 8, 64, config)


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
        from pt2serve.kernels.quant_format import pack
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
    done = run_without_interpreter(script, timeout=300)
    assert "exported" in done.stdout


def test_device_benchmark_runs_on_the_cpu():
    """scripts/device/quant_kernels.py --cpu-smoke: every row of its tables is computed, and correct (the probe
    checks the sums of the bytes it streamed itself, and exits non-zero if one is wrong)."""
    root = Path(__file__).parents[1]
    script = root / "scripts" / "device" / "quant_kernels.py"
    env = os.environ | {"PYTHONPATH": str(root)}  # this checkout's pt2serve, not whichever one is installed
    done = subprocess.run([sys.executable, str(script), "--cpu-smoke", "--widths", "1,65", "--configs", "--probe"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    tables, _, probe = done.stdout.partition("the bytes alone")
    probed = [line.split()[1] for line in probe.splitlines() if line.split()[:1] == ["tiny"]]
    assert sorted(set(probed)) == ["int4", "int8"] and len(probed) >= 4
    rows = [line.split() for line in tables.splitlines() if line.split()[:1] == ["tiny"]]
    widths = [(row[1], row[2]) for row in rows[:4]]
    assert widths == [("int8", "1"), ("int8", "65"), ("int4", "1"), ("int4", "65")]
    configs = rows[4:]
    assert len(configs) > 10 and {row[3] for row in configs} == {"gemv", "dot"}
    errors = [float(row[3]) for row in rows[:4]] + [float(row[-3]) for row in configs]
    assert max(errors) < 1e-5


# ------------------------------------------------------------------------------------------------ export-time choice


def quantized_tiny_model(scheme: str, group_size: int | None):
    from pt2serve.model.presets import build_preset_model
    from pt2serve.model.quant import QuantScheme, quantize_model

    model = build_preset_model("tiny-random", torch.float32, DEVICE).eval()
    quantize_model(model, QuantScheme.from_flags(scheme, group_size, lm_head=True, embedding=False))
    return model


def test_model_matmuls_lists_quantized_projections_by_format():
    from pt2serve.export.linear_tuning import MatmulShape, model_matmuls
    from pt2serve.kernels.linear_configs import QuantFormat

    model = quantized_tiny_model("int4", 32)
    cfg = model.config
    fmt = QuantFormat(4, 32, has_zeros=True, has_perm=False)
    assert fmt.kind == "int4g32-zeros"
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = [
        (q + 2 * kv, cfg.hidden_size, cfg.num_layers),
        (cfg.hidden_size, q, cfg.num_layers),
        (2 * cfg.intermediate_size, cfg.hidden_size, cfg.num_layers),  # gate/up: a plain quantized matmul
        (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers),
        (cfg.vocab_size, cfg.hidden_size, 1),
    ]
    merged: dict = {}
    for rows, cols, count in expected:
        shape = MatmulShape(fmt.kind, rows, cols, fmt)
        merged[shape] = merged.get(shape, 0) + count
    assert model_matmuls(model) == merged


def test_choices_keep_the_config_class_of_their_kind():
    from pt2serve.kernels.linear_choice import LinearChoices, choice_key
    from pt2serve.kernels.linear_configs import LaunchConfig, QuantFormat, QuantLaunchConfig

    fmt = QuantFormat(8, 4096, has_zeros=False, has_perm=True)
    choices = LinearChoices({
        choice_key("linear", 24, 64, 2, torch.bfloat16): LaunchConfig(False, 2, 8, 256, 4),
        choice_key(fmt.kind, 24, 64, 2, torch.bfloat16): QuantLaunchConfig(True, 16, 64, 64, 4, 3, 2),
    })
    assert LinearChoices.from_dict(choices.to_dict()).configs == choices.configs
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert choices.lookup_quant(fmt, x, 24) == QuantLaunchConfig(True, 16, 64, 64, 4, 3, 2)
    assert choices.lookup_quant(QuantFormat(8, 4096, False, False), x, 24) is None  # another format
    assert choices.lookup_quant(fmt, torch.randn(3, 64, dtype=torch.bfloat16), 24) is None  # another width


@pytest.mark.parametrize("num_rows", [1, 4, 16, 64])
def test_export_tunes_a_few_varied_configs_the_default_first(kernels, num_rows):
    every = kernels.small_m_candidates(num_rows, 4096, 14336, 4, kernels.DEFAULT_NUM_SMS)
    tuned = kernels.tuning_candidates(num_rows, 4096, 14336, 4, kernels.DEFAULT_NUM_SMS)
    assert tuned[0] == kernels.small_m_config(num_rows, 4096, 14336, 4, kernels.DEFAULT_NUM_SMS)
    direct = [c for c in tuned if c.x_direct]
    assert len(tuned) - len(direct) == kernels.TUNED_CONFIGS and set(tuned) <= set(every)
    assert {c.use_dot for c in tuned} == ({False, True} if num_rows <= kernels.GEMV_M_MAX else {True})
    gemv = [c.block_n for c in every if not c.use_dot and c.num_warps == 4]
    assert not gemv or max(gemv) in {c.block_n for c in tuned if not c.use_dot}  # the widest gemv tile
    # At one row each gemv tile is timed both ways of reaching x; elsewhere x_direct does not apply.
    plain_gemv = {dataclasses.replace(c, x_direct=True) for c in tuned if not c.use_dot and not c.x_direct}
    assert set(direct) == (plain_gemv if num_rows == 1 else set())


def test_x_direct_is_a_one_row_gemv_config(kernels):
    qweight, scales, zeros, perm = random_format(8, 16, 64, 64, False, False, seed=3)
    for num_rows, use_dot, block_m in ((1, True, 16), (2, False, 2)):
        config = kernels.QuantLaunchConfig(use_dot, block_m, 16, 16, 4, 1, 1, x_direct=True)
        with pytest.raises(ValueError, match="one-row gemv"):
            kernels.launch_small_m(torch.randn(num_rows, 64, device=DEVICE), qweight, scales, zeros, perm, 8, 64,
                                   config)


def test_tuning_times_every_quantized_config_and_keeps_the_fastest(kernels, monkeypatch, fake_tuning_times):
    """The tuning loop on the CPU with made-up times: every candidate runs (in the interpreter) on random packed
    weights of each quantized shape, and each key takes its fastest config, the default included."""
    from pt2serve.export import linear_tuning
    from pt2serve.export.linear_tuning import describe, model_matmuls

    model = quantized_tiny_model("int4", 32)
    shapes, widths = list(model_matmuls(model)), (1, 16)
    candidates = kernels.tuning_candidates
    # Three configs per key keep the interpreter's time down; every config runs in the tests above.
    monkeypatch.setattr(kernels, "tuning_candidates", lambda *args: candidates(*args)[:3])
    times = []  # in the order tune() times them: per shape, per width, each candidate (the default first)
    for _ in shapes:
        times += [1.0, 0.9, 0.5]  # width 1: the last candidate is the fastest
        times += [1.0, 1.2, 1.1]  # width 16: the default is
    fake = fake_tuning_times(times)
    choices, timings = linear_tuning.tune(model, widths + (128,), show_progress=False)  # 128: no static kernel
    assert next(fake, None) is None  # every candidate was timed
    assert [(t.shape, t.width) for t in timings] == [(s, w) for s in shapes for w in widths]
    for t in timings:
        configs = candidates(t.width, t.shape.rows, t.shape.cols, 4, kernels.DEFAULT_NUM_SMS)
        assert t.baseline_ms == 1.0 and t.baseline == f"default {configs[0].name}"
        assert t.chosen == configs[2 if t.width == 1 else 0]
    assert choices.configs == {t.key: t.chosen for t in timings}
    record = describe(model, timings)
    per_step = sum(model_matmuls(model).values())
    assert record["step_matmuls_ms"] == {"1": {"untuned": per_step * 1.0, "tuned": per_step * 0.5},
                                         "16": {"untuned": per_step * 1.0, "tuned": per_step * 1.0}}


@pytest.mark.parametrize("fmt", [FORMATS[i] for i in (0, 8)], ids=format_id)
def test_the_operator_with_a_chosen_config_matches_reference(kernels, fmt):
    bits, n, k, group_size, has_zeros, has_perm = fmt
    qweight, scales, zeros, perm = random_format(bits, n, k, group_size, has_zeros, has_perm, seed=3)
    for num_rows in (1, 20):
        candidates = kernels.small_m_candidates(num_rows, n, k, bits, kernels.DEFAULT_NUM_SMS)
        x = torch.randn(num_rows, k, device=DEVICE)
        for config in [candidates[-1]] + [c for c in candidates if c.x_direct][:1]:
            out = torch.ops.pt2serve.quant_linear_small_m(
                x, qweight, scales, zeros, perm, bits, group_size, config.use_dot, config.block_m, config.block_n,
                config.block_bytes, config.num_warps, config.num_stages, config.split_k, config.x_direct)
            check(out, reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size))


def test_a_chosen_config_is_traced_into_the_call(tmp_path):
    """Exported with choices (in a fresh process without the interpreter, as above): a chosen width holds the
    operator with its config as arguments, another width the default operator."""
    script = textwrap.dedent("""
        import torch
        from pt2serve.kernels.linear_choice import LinearChoices, choice_key, using
        from pt2serve.kernels.linear_configs import QuantFormat, QuantLaunchConfig
        from pt2serve.kernels.quant_format import pack
        from pt2serve.kernels.quant_linear import triton_quant_linear

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("qweight", pack(torch.randint(0, 16, (96, 128)), 4))
                self.register_buffer("scales", torch.rand(96, 2))
                self.register_buffer("zeros", torch.randint(0, 16, (96, 2), dtype=torch.uint8))

            def forward(self, x):
                return triton_quant_linear(x, self.qweight, self.scales, self.zeros, None, 4, 64)

        config = QuantLaunchConfig(True, 16, 32, 64, 4, 3, 2)
        key = choice_key(QuantFormat(4, 64, True, False).kind, 96, 128, 4, torch.float32)
        with using(LinearChoices({key: config})):
            for width in (4, 5):
                program = torch.export.export(Layer(), (torch.randn(width, 128),), strict=False)
                calls = [node for node in program.graph.nodes if node.op == "call_function"]
                print(width, [str(node.target) for node in calls], list(calls[0].args[5:]))  # past x and the weights
    """)
    lines = run_without_interpreter(script, timeout=300).stdout.splitlines()
    assert lines[-2] == "4 ['pt2serve.quant_linear_small_m.default'] [4, 64, True, 16, 32, 64, 4, 3, 2, False]"
    assert lines[-1] == "5 ['pt2serve.quant_linear.default'] [4, 64]"
