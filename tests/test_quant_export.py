"""Quantized artifacts end to end on the CPU: toy-greedy exported with --quantize int8 and int4 (the latter
once with the defaults, once with its LM head and embedding quantized too) generates its designed tokens, its
compiled methods match the eager quantized model, the packed weights are what the package stores and inspect
shows, the eager peer runs them, and `bench --mode quality` compares them with the float export."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import export_options_for_tests, exported, packed_random_step
from pt2serve.export.options import ExportOptions
from pt2serve.bench.quality import QualityOptions, kl_and_agreement, run_quality
from pt2serve.contract import FORWARD_OTHERS, forward_name
from pt2serve.model.checkpoint import load_model
from pt2serve.model.presets import get_preset, toy_greedy_continuation
from pt2serve.model.quant import QuantScheme
from pt2serve.runtime.artifact import load_artifact, read_metadata
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.executor import ExecutorConfig

PT2SERVE = str(Path(sys.executable).with_name("pt2serve"))
# One static width (decodes pad into it), forward_others for the rest: on the CPU a quantized layer is the same
# aten ops at every width, so more static widths would only cost compile time.
SIZES = (4,)
# Groups of 128 (the default): toy-greedy's 320-wide rows end in a short group of 64, and its 128-wide MLP rows
# are one group (compiled methods once left each row's short last group unwritten).
INT4 = dict(quantize="int4", quantize_lm_head=True, quantize_embedding=True)
INT8 = dict(quantize="int8")


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory) -> Path:
    return exported("toy-greedy-int8", lambda path: quantized_options(path, **INT8), tmp_path_factory)


@pytest.fixture(scope="module")
def int4_artifact(tmp_path_factory) -> Path:
    return exported("toy-greedy-int4-all", lambda path: quantized_options(path, **INT4), tmp_path_factory)


def quantized_options(path: Path, **quantize) -> ExportOptions:
    return dataclasses.replace(export_options_for_tests("toy-greedy", path), forward_sizes=SIZES, **quantize)


@pytest.mark.parametrize("use_static_methods", [True, False], ids=["static", "forward_others"])
def test_quantized_artifacts_generate_the_designed_tokens(int8_artifact, int4_artifact, use_static_methods):
    config = ExecutorConfig(num_cells=512, use_static_methods=use_static_methods)
    for path in (int8_artifact, int4_artifact):
        runner = open_runner(path, executor_config=config)
        try:
            for prompt in ([256, 5, 9], [3] * 7, list(range(40, 70))):
                done = runner.generate(prompt, max_new_tokens=10, ignore_eos=True)
                assert list(done.token_ids) == toy_greedy_continuation(prompt, 10), (path.name, prompt)
        finally:
            runner.close()


def test_int4_keeps_the_designed_tokens_from_every_start_on_every_run(int4_artifact):
    """Every start token at once, twice. Compiled methods once left each row's short last group unwritten:
    from most starts the output was mostly token 0, and the same prompt answered differently run to run."""
    runner = open_runner(int4_artifact)
    try:
        for run in range(2):
            handles = {start: runner.submit([start], max_new_tokens=6, ignore_eos=True) for start in range(256)}
            got = {start: list(handle.result(timeout=120).token_ids) for start, handle in handles.items()}
            wrong = {start: tokens for start, tokens in got.items() if tokens != toy_greedy_continuation([start], 6)}
            assert not wrong, f"run {run + 1}: {len(wrong)} of 256 starts wrong, e.g. {dict(list(wrong.items())[:3])}"
    finally:
        runner.close()


@pytest.mark.parametrize("which", ["int8", "int4"])
def test_compiled_methods_match_the_eager_quantized_model(int8_artifact, int4_artifact, which):
    path, flags = (int8_artifact, INT8) if which == "int8" else (int4_artifact, INT4)
    artifact = load_artifact(path)
    scheme = QuantScheme.from_flags(flags["quantize"], flags.get("group_size"), flags.get("quantize_lm_head", False),
                                    flags.get("quantize_embedding", False))
    model = load_model(None, "toy-greedy", torch.float32, "cpu", quantize=scheme).model
    cfg = model.config
    rng = np.random.default_rng(0)
    pool_shape = (64, cfg.num_kv_heads, cfg.head_dim)
    for method, width, lengths in ((forward_name(4), 4, (2, 1, 1)), (FORWARD_OTHERS, None, (9, 1, 5))):
        inputs = packed_random_step(artifact, method, width, lengths, rng)
        pools = [torch.zeros(pool_shape) for _ in range(2 * cfg.num_layers)]
        compiled = artifact.run(method, [*inputs, *pools])[0]
        with torch.no_grad():
            eager = model(*inputs, [torch.zeros(pool_shape) for _ in range(cfg.num_layers)],
                          [torch.zeros(pool_shape) for _ in range(cfg.num_layers)])
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_metadata_and_inspect_show_the_quantization(int8_artifact, int4_artifact):
    int4 = read_metadata(int4_artifact).raw
    assert int4["quantization"] == {
        "method": "rtn", "bits": 4, "packing": "split-halves-256", "group_size": 128, "symmetric": False, "act_order": False,
        "num_layers_quantized": 10, "lm_head": True, "embedding": True,
    }
    int8 = read_metadata(int8_artifact).raw
    assert int8["quantization"]["bits"] == 8 and int8["quantization"]["symmetric"]
    assert not int8["quantization"]["lm_head"] and not int8["quantization"]["embedding"]
    weights = {entry["name"]: entry for entry in int4["weights"]}
    assert weights["layers.0.mlp.down_proj.qweight"]["dtype"] == "uint8"
    assert "layers.0.mlp.down_proj.weight" not in weights and "lm_head.qweight" in weights
    shown = subprocess.run([PT2SERVE, "inspect", str(int4_artifact)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "250"})  # one table row per line
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "int4 rtn, group 128, zero points" in text and "LM head and embedding quantized" in text


def test_packed_weights_are_what_the_package_stores(int8_artifact, int4_artifact):
    """int8 stores a quarter of fp32's bytes for each quantized layer (plus one scale per row), int4 an eighth
    (plus a scale and a zero per 128 inputs); the package carries them once."""
    cfg = get_preset("toy-greedy").config
    float_bytes = 4 * cfg.weight_count
    sizes = {}
    for name, path in (("int8", int8_artifact), ("int4", int4_artifact)):
        entries = read_metadata(path).raw["weights"]
        sizes[name] = sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize for e in entries)
        assert path.stat().st_size < sizes[name] + 5 * 3_000_000  # 5 methods of code, the weights once
    head_and_embedding = 2 * 4 * cfg.vocab_size * cfg.hidden_size
    layers = float_bytes - head_and_embedding
    assert sizes["int8"] < head_and_embedding + 0.27 * layers
    assert sizes["int4"] < 0.2 * float_bytes


def test_eager_peer_runs_quantized_artifacts(int4_artifact, tmp_path):
    out = tmp_path / "sweep.json"
    done = subprocess.run(
        [PT2SERVE, "bench", str(int4_artifact), "--tokens", "1,4", "--warmup", "1", "--iters", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert all(row["eager_seconds"] is not None for row in document["rows"])
    cfg = get_preset("toy-greedy").config
    # The roofline counts a quantized layer's parameters, not its packed bytes (the head reads the embedding).
    norms = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size
    assert document["model_cost"]["matmul_params"] == cfg.weight_count - cfg.vocab_size * cfg.hidden_size - norms


def test_kl_and_agreement():
    reference = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    same, agree = kl_and_agreement(reference, reference.clone())
    assert same.abs().max() < 1e-6 and bool(agree.all())
    kl, agree = kl_and_agreement(reference, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]))
    p = reference[0].softmax(-1)
    assert float(kl[0]) == pytest.approx(float((p * (p.log() - torch.full((3,), 1 / 3).log())).sum()), rel=1e-5)
    assert agree.tolist() == [True, False] and float(kl[1]) > 0


def test_quality_against_the_float_export(toy_artifact, int8_artifact, int4_artifact, tmp_path):
    options = QualityOptions(prompts=3, prompt_tokens=6, max_new_tokens=5)
    results = {name: run_quality(path, toy_artifact, options) for name, path in
               (("int8", int8_artifact), ("int4", int4_artifact), ("float", toy_artifact))}
    assert results["float"].mean_kl == pytest.approx(0.0, abs=1e-6)
    for name in ("int8", "int4"):  # toy-greedy's margins survive quantization: every greedy choice agrees
        assert results[name].positions == 15 and results[name].top1_agreement == 1.0
        assert results[name].prompts_fully_agreeing == 3
    assert 0 < results["int8"].mean_kl < results["int4"].mean_kl < 0.05
    out = tmp_path / "quality.json"
    done = subprocess.run(
        [PT2SERVE, "bench", str(int4_artifact), "--mode", "quality", "--reference", str(toy_artifact),
         "--requests", "3", "--prompt-tokens", "6", "--max-new-tokens", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "top-1 agreement" in done.stdout and "100.00%" in done.stdout
    assert json.loads(out.read_text())["result"]["mean_kl"] == pytest.approx(results["int4"].mean_kl, rel=1e-4)


def test_quality_mode_needs_a_reference(int8_artifact):
    done = subprocess.run([PT2SERVE, "bench", str(int8_artifact), "--mode", "quality"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--reference REF.pt2" in done.stderr
