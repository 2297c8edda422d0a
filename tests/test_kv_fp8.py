"""FP8 KV cells (model/kv_fp8.py): calibration, the plain path's e4m3 cells, and toy-greedy exported with
--quantize fp8 --kv-dtype fp8 end to end on the CPU (the kernels' FP8 cells: test_cell_attention.py and
test_rope_store.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import export_options_for_tests, exported
from pt2serve.contract import FORWARD_OTHERS, forward_name
from pt2serve.errors import Pt2ServeError
from pt2serve.export.options import ExportOptions
from pt2serve.model.checkpoint import load_model
from pt2serve.model.kv_fp8 import HEADROOM, KV_FP8_DTYPE, calibrate_kv_scales, install_kv_scales, kv_pool_dtype
from pt2serve.model.presets import build_preset_model, toy_greedy_continuation
from pt2serve.model.quant import QuantScheme
from pt2serve.runtime.artifact import load_artifact, read_metadata
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, pack

PT2SERVE = str(Path(sys.executable).with_name("pt2serve"))
BOTH = dict(quantize="fp8", kv_dtype="fp8")


def test_calibrated_scales_leave_the_headroom_per_head():
    model = build_preset_model("tiny", torch.float32)
    scales = calibrate_kv_scales(model, seed=1)
    cfg = model.config
    assert len(scales) == cfg.num_layers
    for k_scale, v_scale in scales:
        assert k_scale.shape == v_scale.shape == (cfg.num_kv_heads,) and bool((k_scale > 0).all())
    # The largest calibration value of each head lands at 448 / HEADROOM: written again with these scales,
    # the same prompt's cells reach exactly that.
    install_kv_scales(model, scales)
    assert kv_pool_dtype(model) == KV_FP8_DTYPE
    tokens = torch.randint(0, cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(512)
    k_pools = [torch.zeros(513, cfg.num_kv_heads, cfg.head_dim, dtype=KV_FP8_DTYPE) for _ in range(cfg.num_layers)]
    v_pools = [p.clone() for p in k_pools]
    with torch.no_grad():
        model(tokens, positions, positions + 1, torch.zeros(512, dtype=torch.int64), torch.tensor([0, 512]),
              positions + 1, torch.tensor([511]), k_pools, v_pools)
    for pool in k_pools + v_pools:
        peak = pool[1:].float().abs().amax(dim=(0, 2))
        torch.testing.assert_close(peak, torch.full_like(peak, 448 / HEADROOM), rtol=0.07, atol=0)


def test_kv_dtype_flags_are_checked(tmp_path):
    def options(**flags) -> ExportOptions:
        return ExportOptions(backend="cpu", output=tmp_path / "m.pt2", preset="toy-greedy", **flags)

    with pytest.raises(Pt2ServeError, match="--kv-dtype must be fp8 or the model's dtype"):
        options(kv_dtype="int8").validate()
    with pytest.raises(Pt2ServeError, match="--kv-dtype fp8 with --draft is not supported"):
        options(kv_dtype="fp8", draft=tmp_path).validate()
    options(kv_dtype="fp32").validate()  # the model's own dtype: the default, said explicitly


@pytest.fixture(scope="module")
def both_artifact(tmp_path_factory) -> Path:
    def options(path: Path) -> ExportOptions:
        return dataclasses.replace(export_options_for_tests("toy-greedy", path), forward_sizes=(4,), **BOTH)

    return exported("toy-greedy-fp8-kv8", options, tmp_path_factory)


@pytest.mark.parametrize("use_static_methods", [True, False], ids=["static", "forward_others"])
def test_fp8_weights_and_cells_generate_the_designed_tokens(both_artifact, use_static_methods):
    runner = open_runner(both_artifact, executor_config=ExecutorConfig(num_cells=512,
                                                                       use_static_methods=use_static_methods))
    try:
        assert all(pool.dtype == KV_FP8_DTYPE for pool in runner.executor.pools)
        prompts = [[256, 5, 9], list(range(40, 70)), list(range(200))] + [[start] for start in range(0, 256, 31)]
        handles = [runner.submit(p, max_new_tokens=8, ignore_eos=True) for p in prompts]
        for prompt, handle in zip(prompts, handles):
            assert list(handle.result(timeout=120).token_ids) == toy_greedy_continuation(prompt, 8), prompt
    finally:
        runner.close()


def test_compiled_methods_write_and_read_the_eager_models_fp8_cells(both_artifact):
    artifact = load_artifact(both_artifact)
    model = load_model(None, "toy-greedy", torch.float32, "cpu",
                       quantize=QuantScheme.from_flags("fp8", None, False, False)).model
    cfg = model.config
    scales = [(artifact.weights[f"layers.{i}.self_attn.k_scale"], artifact.weights[f"layers.{i}.self_attn.v_scale"])
              for i in range(cfg.num_layers)]
    install_kv_scales(model, scales)
    rng = np.random.default_rng(1)
    pool_shape = (64, cfg.num_kv_heads, cfg.head_dim)
    for method, width, lengths in ((forward_name(4), 4, (2, 1, 1)), (FORWARD_OTHERS, None, (9, 1, 5))):
        chunks, next_cell = [], 1
        for length in lengths:
            cells = np.arange(next_cell, next_cell + length, dtype=np.int64)
            next_cell += length
            chunks.append(Chunk(cells, tuple(int(t) for t in rng.integers(0, 256, length)), 0, SamplingParams()))
        call = pack(list(enumerate(chunks)), method, width, artifact.metadata.entries_of(4) if width else None)
        inputs = call.device_inputs("cpu")
        compiled_pools = [torch.zeros(pool_shape, dtype=KV_FP8_DTYPE) for _ in range(2 * cfg.num_layers)]
        eager_pools = [p.clone() for p in compiled_pools]
        compiled = artifact.run(method, [*inputs, *compiled_pools])[0]
        with torch.no_grad():
            eager = model(*inputs, eager_pools[:cfg.num_layers], eager_pools[cfg.num_layers:])
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        for got, want in zip(compiled_pools, eager_pools):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_metadata_and_inspect_show_fp8_cells(both_artifact):
    raw = read_metadata(both_artifact).raw
    assert raw["cache"]["dtype"] == "fp8"
    weights = {entry["name"]: entry for entry in raw["weights"]}
    assert weights["layers.1.self_attn.k_scale"]["dtype"] == "float32"
    shown = subprocess.run([PT2SERVE, "inspect", str(both_artifact)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    cfg = raw["model_config"]
    per_token = cfg["num_layers"] * 2 * cfg["num_kv_heads"] * cfg["head_dim"]
    assert f"fp8 e4m3, a scale per layer and KV head; {per_token:,} bytes a token" in shown.stdout
