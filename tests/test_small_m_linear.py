"""The small-M matmul kernels against F.linear, the export's choice of kernel per shape, and a model traced with it.

Without a GPU the kernels run under TRITON_INTERPRET=1 (conftest.py), in fp32. Shapes are no multiple of
the tiles. The exporter times the kernels only on a GPU (`cuda` test below); on the CPU the choice logic is
tested with given timings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from conftest import triton_kernels  # noqa: E402
from fresh_process import run_without_interpreter  # noqa: E402
from pt2serve.export.linear_tuning import (  # noqa: E402
    MARGIN,
    MAX_COPIES,
    ROTATION_BYTES,
    MatmulShape,
    Timing,
    describe,
    model_matmuls,
    rotation_copies,
)
from pt2serve.kernels.linear_choice import (  # noqa: E402
    LinearChoices,
    candidates,
    choice_key,
    linear,
    swiglu_linear,
    using,
)
from pt2serve.kernels.linear_configs import LaunchConfig  # noqa: E402
from pt2serve.model.presets import build_preset_model  # noqa: E402
from pt2serve.export.methods import example_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels():
    return triton_kernels("pt2serve.kernels.small_m_linear")


def reference(x: torch.Tensor, weight: torch.Tensor, swiglu: bool) -> torch.Tensor:
    out = x.double() @ weight.double().T
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out.float()


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 13, 64])
def test_every_candidate_config_computes_the_matmul(kernels, num_rows, swiglu):
    gen = torch.Generator().manual_seed(num_rows)
    n, k = 40, 300  # neither a multiple of any tile
    x = torch.randn(num_rows, k, generator=gen).to(DEVICE)
    weight = (torch.randn(2 * n if swiglu else n, k, generator=gen) * 0.1).to(DEVICE)
    want = reference(x, weight, swiglu)
    configs = candidates(num_rows, swiglu)
    assert any(not c.use_dot for c in configs) == (num_rows <= 4)
    for config in configs:
        try:
            got = kernels.launch(x, weight, swiglu, config)
        except OutOfResources:
            # fp32 tiles of 64 rows hold most of an H200's shared memory, and the tuner skips those it refuses;
            # bf16 models are what they serve, and in bf16 every tile fits.
            got = kernels.launch(x.bfloat16(), weight.bfloat16(), swiglu, config).float()
            want_bf16 = reference(x.bfloat16().float(), weight.bfloat16().float(), swiglu)
            torch.testing.assert_close(got, want_bf16, atol=2e-2, rtol=2e-2, msg=config.name)
            continue
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=config.name)


def test_the_operator_takes_its_config_as_arguments(kernels):
    x, weight = torch.randn(2, 64).to(DEVICE), torch.randn(24, 64).to(DEVICE)
    config = candidates(2, False)[0]
    got = torch.ops.pt2serve.small_m_linear(x, weight, False, config.use_dot, config.block_m, config.block_n,
                                            config.block_k, config.num_warps, config.num_stages)
    torch.testing.assert_close(got, reference(x, weight, False), atol=1e-4, rtol=1e-4)


def test_a_config_narrower_than_the_rows_is_refused(kernels):
    with pytest.raises(ValueError, match="holds 1 rows, not 2"):
        kernels.launch(torch.randn(2, 8), torch.randn(4, 8), False, LaunchConfig(False, 1, 4, 8, 4))


def test_choices_apply_only_to_their_key_and_to_concrete_narrow_widths(kernels):
    weight = torch.randn(24, 64, device=DEVICE)
    config = candidates(2, False)[0]
    choices = LinearChoices({choice_key("linear", 24, 64, 2, torch.float32): config})
    assert choices.lookup("linear", torch.randn(2, 64), weight) == config
    assert choices.lookup("linear", torch.randn(3, 64), weight) is None  # another width
    assert choices.lookup("swiglu", torch.randn(2, 64), weight) is None  # another kind
    assert choices.lookup("linear", torch.randn(2, 64, dtype=torch.float64), weight.double()) is None
    assert LinearChoices.from_dict(choices.to_dict()).configs == choices.configs
    x = torch.randn(2, 64, device=DEVICE)
    with using(choices):  # the chosen kernel and the plain matmul agree
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-4)
        bias = torch.ones(24, device=DEVICE)
        torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight) + 1, atol=1e-4, rtol=1e-4)
    gate_up = torch.randn(48, 64, device=DEVICE)
    with using(LinearChoices({choice_key("swiglu", 48, 64, 2, torch.float32): candidates(2, True)[0]})):
        torch.testing.assert_close(swiglu_linear(x, gate_up), reference(x, gate_up, True), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(swiglu_linear(x, gate_up), reference(x, gate_up, True), atol=1e-4, rtol=1e-4)


def test_model_matmuls_lists_each_shape_with_its_calls_per_step():
    model = build_preset_model("tiny-random", torch.float32)
    cfg = model.config
    calls = model_matmuls(model)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {
        MatmulShape("linear", q + 2 * kv, cfg.hidden_size): cfg.num_layers,
        MatmulShape("linear", cfg.hidden_size, q): cfg.num_layers,
        MatmulShape("swiglu", 2 * cfg.intermediate_size, cfg.hidden_size): cfg.num_layers,
        MatmulShape("linear", cfg.hidden_size, cfg.intermediate_size): cfg.num_layers,
        MatmulShape("linear", cfg.vocab_size, cfg.hidden_size): 1,  # the LM head, tied or not
    }
    merged: dict[MatmulShape, int] = {}
    for shape, count in expected.items():  # o_proj and down_proj may share a shape
        merged[shape] = merged.get(shape, 0) + count
    assert calls == merged


def test_a_timed_pass_reads_the_rotation_bytes_from_a_bounded_number_of_copies():
    # An 8B's weights need a few copies to read ROTATION_BYTES from DRAM; the tiny preset's 8 KB weights would
    # need 32,768, and a graph of that many launches per config made its tuning outlast the 8B's.
    assert rotation_copies(ROTATION_BYTES) == 1
    assert rotation_copies(28672 * 4096 * 2) == 2  # the 8B's gate_up projection in bf16
    assert rotation_copies(ROTATION_BYTES // MAX_COPIES) == MAX_COPIES
    assert rotation_copies(64 * 64 * 2) == MAX_COPIES


def test_a_config_is_chosen_unless_cublas_wins_past_the_noise():
    for kind in ("linear", "swiglu"):
        shape, config = MatmulShape(kind, 8, 8), candidates(1, kind == "swiglu")[0]

        def timing(best_ms, best=config):
            return Timing(shape, 1, torch.bfloat16, 1.0, best, best_ms)

        assert timing(0.9).chosen == config
        assert timing(1 + MARGIN / 2).chosen == config  # a tie within the noise goes to the Triton kernel
        assert timing(1 + 2 * MARGIN).chosen is None
        assert timing(float("inf"), best=None).chosen is None
    assert timing(float("inf"), best=None).to_dict()["best_us"] is None


def test_describe_sums_a_steps_matmuls_with_and_without_the_choices():
    model = build_preset_model("tiny-random", torch.float32)
    calls = model_matmuls(model)
    config = candidates(1, False)[0]
    timings = [Timing(shape, 1, torch.float32, 1.0, config, 0.5) for shape in calls]
    record = describe(model, timings)
    per_step = sum(calls.values())
    assert record["step_matmuls_ms"] == {"1": {"untuned": per_step * 1.0, "tuned": per_step * 0.5}}
    assert len(record["timings"]) == len(calls) and all(t["chosen"] for t in record["timings"])


TRACE_SCRIPT = """
import sys, torch
from pt2serve.export.linear_tuning import model_matmuls
from pt2serve.export.methods import MethodSpec, trace_forward
from pt2serve.kernels.linear_choice import LinearChoices, candidates, choice_key, using
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.checkpoint import load_model
model = load_model(None, "tiny-random", torch.float32, "cpu", AttentionImpl.MASKED).model
width = int(sys.argv[2])
configs = {}
for i, shape in enumerate(model_matmuls(model)):  # alternate gemv and dot tiles over the shapes
    options = candidates(width, shape.kind == "swiglu")
    configs[choice_key(shape.kind, shape.rows, shape.cols, width, torch.float32)] = options[-1 if i % 2 else 0]
with using(LinearChoices(configs)):
    program, _ = trace_forward(model, MethodSpec(f"forward_{width}", width, 300), max_step_tokens=128, max_cells=512)
torch.export.save(program, sys.argv[1])
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="runs the CPU-traced program's kernels in Triton's interpreter")
@pytest.mark.parametrize("width", [4])  # gemv and dot configs alternate over the shapes
def test_a_method_traced_with_choices_holds_the_kernels_and_matches_the_model(kernels, tmp_path, width):
    """Traced in a process without TRITON_INTERPRET (under it, export traces into the kernel instead of
    keeping the operator); AOTInductor compiling it is checked on the GPU."""
    path = tmp_path / "forward.pt2"
    run_without_interpreter(TRACE_SCRIPT, str(path), str(width))
    program = torch.export.load(path)
    targets = [str(node.target) for node in program.graph.nodes]
    model = build_preset_model("tiny-random", torch.float32).eval()
    assert sum("pt2serve.small_m_linear" in t for t in targets) == 4 * model.config.num_layers + 1
    cfg = model.config
    step = example_step(width, width, 300, 512, "cpu")  # a static width holds one row per sequence
    pools = [torch.zeros(512, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    with torch.no_grad():
        want = model(*step, pools[:cfg.num_layers], pools[cfg.num_layers:])
        got = program.module()(*step, pools[:cfg.num_layers], pools[cfg.num_layers:])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_tuning_times_every_shape_and_width_on_the_gpu():
    from pt2serve.export.linear_tuning import tune

    model = build_preset_model("tiny-random", torch.bfloat16, "cuda").eval()
    choices, timings = tune(model, (1, 4, 64, 128), show_progress=False)
    assert {(t.shape, t.width) for t in timings} == {(s, w) for s in model_matmuls(model) for w in (1, 4, 64)}
    assert all(t.baseline_ms > 0 and t.best is not None for t in timings)
    assert set(choices.configs) == {t.key for t in timings if t.chosen is not None}


@pytest.mark.cuda
def test_tuning_times_every_quantized_shape_and_takes_a_config_for_each():
    from pt2serve.export.linear_tuning import tune
    from pt2serve.model.quant import QuantScheme, quantize_model

    model = build_preset_model("tiny-random", torch.bfloat16, "cuda").eval()
    quantize_model(model, QuantScheme.from_flags("int4", 32, lm_head=True, embedding=False))
    choices, timings = tune(model, (1, 16, 64), show_progress=False)
    assert {(t.shape, t.width) for t in timings} == {(s, w) for s in model_matmuls(model) for w in (1, 16, 64)}
    assert all(t.shape.quant is not None and t.baseline_ms > 0 and t.chosen is not None for t in timings)
    assert set(choices.configs) == {t.key for t in timings}


def test_tuning_runs_every_candidate_and_keeps_the_faster_kernel(kernels, monkeypatch, fake_tuning_times):
    """The tuning loop on the CPU with made-up times: every candidate config it has runs (in the interpreter), a key
    takes the fastest config unless cuBLAS beats it past the margin, and stays cuBLAS where it does."""
    from pt2serve.export import linear_tuning

    model = build_preset_model("tiny-random", torch.float32, DEVICE).eval()
    shapes, widths = list(model_matmuls(model)), (1, 16)
    # Three configs per key keep the interpreter's time down; every config runs in the test above.
    monkeypatch.setattr(linear_tuning, "candidates", lambda width, swiglu: candidates(width, swiglu)[-3:])
    times = []  # in the order tune() times them: per shape, per width, cuBLAS then each candidate
    for shape in shapes:
        for width in widths:
            count = len(linear_tuning.candidates(width, shape.kind == "swiglu"))
            # width 1: the last candidate is much faster; width 16: cuBLAS beats every candidate past the noise
            times += [1.0] + ([0.99] * (count - 1) + [0.5] if width == 1 else [1.05] * count)
    fake = fake_tuning_times(times)
    choices, timings = linear_tuning.tune(model, widths + (128,), show_progress=False)  # 128: no static kernel
    assert next(fake, None) is None  # every candidate was timed
    assert [(t.shape, t.width) for t in timings] == [(s, w) for s in shapes for w in widths]
    for t in timings:
        if t.width == 1:
            assert t.chosen == candidates(1, t.shape.kind == "swiglu")[-1] and t.best_ms == 0.5
        else:
            assert t.chosen is None and t.best_ms == 1.05
    assert set(choices.configs) == {t.key for t in timings if t.width == 1}


def test_inspect_sums_up_dense_fp8_and_quantized_choices():
    from pt2serve.cli import describe_linear_kernels

    timings = [{"baseline": "cuBLAS", "chosen": True}, {"baseline": "cuBLAS", "chosen": False},
               {"baseline": "scaled_mm", "chosen": True}, {"baseline": "scaled_mm", "chosen": False},
               {"baseline": "scaled_mm", "chosen": True},
               {"baseline": "default gemv m1 n16 b128 w4 s1 k4", "chosen": True}]
    record = {"timings": timings, "step_matmuls_ms": {"1": {"untuned": 1.0, "tuned": 0.75}}}
    assert describe_linear_kernels(record, "cuda") == (
        "Triton kernel for 1 of 2 shape x width, FP8: Triton kernel for 2 of 3 (else _scaled_mm), quantized "
        "kernel config tuned for 1 shape x width; untuned -> tuned: M=1: 1.00 -> 0.75 ms")
    earlier = {"timings": [{"cublas_us": 3.0, "chosen": True}],  # before quantized weights were tuned
               "step_matmuls_ms": {"4": {"cublas": 2.0, "chosen": 1.5}}}
    assert describe_linear_kernels(earlier, "cuda") == (
        "Triton kernel for 1 of 1 shape x width; untuned -> tuned: M=4: 2.00 -> 1.50 ms")
    assert describe_linear_kernels(None, "cuda") == "cuBLAS (not tuned)"
    assert describe_linear_kernels(None, "cpu") == "not tuned (tuning needs a GPU)"



def test_a_residual_add_after_a_cublas_projection_stays_out_of_the_matmul():
    """Compiled, `linear` then the residual add and an RMSNorm: the add joins the norm's kernel; a cuBLAS addmm
    would copy the residual into its output first (one device copy per projection on the GPU)."""
    from torch._inductor.utils import run_and_get_code

    from pt2serve.kernels.linear_choice import linear
    from pt2serve.model.model import RMSNorm

    norm = RMSNorm(64, 1e-6)

    def residual_block(x, a, weight):
        h = x + linear(a, weight)
        return h, norm(h)

    _, (code,) = run_and_get_code(torch.compile(residual_block), torch.randn(4, 64), torch.randn(4, 32),
                                  torch.randn(64, 32))
    assert "addmm" not in code
