"""FP8 checkpoints as llm-compressor (compressed-tensors) and the fine-grained fp8 releases publish them,
written here from toy-greedy's float weights with the test's own e4m3 quantization: each layout loads to the
weights it means (per-channel and per-tensor exactly, block-wise after its measured re-rounding to one scale
per row), computes close to the float model, exports on the CPU to an artifact that generates the designed
tokens, and every layout outside the supported ones is refused with a message naming it."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import export_options_for_tests, exported, generates_the_designed_tokens
from pt2serve.errors import Pt2ServeError
from pt2serve.model.checkpoint import load_checkpoint, load_model
from pt2serve.model.config import ModelConfig
from pt2serve.model.eager import EagerSequence
from pt2serve.model.fp8 import Fp8Linear
from pt2serve.model.fp8_checkpoint import ScaleLayout, to_per_channel
from pt2serve.model.model import Transformer, stacked_projections
from pt2serve.model.presets import build_preset_model, get_preset, toy_greedy_continuation
from pt2serve.model.quant import QuantScheme, quantize_model
from pt2serve.runtime.artifact import read_metadata
from pt2serve.runtime.executor import ExecutorConfig

PT2SERVE = str(Path(sys.executable).with_name("pt2serve"))
E4M3 = torch.float8_e4m3fn
PROMPT = [256, 5, 9, 40, 41, 3, 3, 200]
STACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "self_attn.o_proj": ("self_attn.o_proj",),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
           "mlp.down_proj": ("mlp.down_proj",)}
# The largest relative error (Frobenius norm) that re-rounding block scales to row scales may add against the
# block-dequantized weight; measured 2.2% on test_block_requantization_error's weight, up to 2.7% on toy-greedy's.
REQUANTIZATION_BOUND = 0.035

# ------------------------------------------------------------------------------------ the test's own FP8


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(E4M3)


def block_scales(weight: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Each rows x columns block's max |value| / 448 (the last blocks may be short), [row blocks, column blocks]."""
    n, k = weight.shape
    return torch.stack([torch.stack([weight[i:i + rows, j:j + columns].abs().max() for j in range(0, k, columns)])
                        for i in range(0, n, rows)]).clamp(min=1e-12) / 448  # an all-zero block: zeros


def expand(scales: torch.Tensor, rows: int, columns: int, shape) -> torch.Tensor:
    """Every weight's scale: element (n, k) takes block (n // rows, k // columns)."""
    n, k = shape
    return scales[torch.arange(n) // rows][:, torch.arange(k) // columns]


def per_channel(weight, scale_dtype=torch.bfloat16):
    """compressed-tensors' channel strategy: scales [N, 1] in the model's dtype (as llm-compressor saves them)."""
    scale = (weight.abs().amax(1, keepdim=True) / 448).to(scale_dtype)
    q = e4m3(weight / scale.float())
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def per_tensor(scale_shape, with_input_scale=True):
    def layer(weight):
        scale = (weight.abs().max() / 448).reshape(scale_shape)
        q = e4m3(weight / scale)
        tensors = {"weight": q, "weight_scale": scale}
        if with_input_scale:  # static activation scales: never read
            tensors["input_scale"] = torch.full(scale_shape, 0.05)
        return tensors, q.float() * scale

    return layer


def blockwise(rows, columns, scale_name):
    def layer(weight):
        scales = block_scales(weight, rows, columns)
        full = expand(scales, rows, columns, weight.shape)
        q = e4m3(weight / full)
        return {"weight": q, scale_name: scales}, q.float() * full

    return layer


def rows_rerounded(weight: torch.Tensor) -> torch.Tensor:
    """The block-dequantized weight rounded to e4m3 again with one scale per row, dequantized."""
    scale = weight.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    return e4m3(weight / scale).float() * scale


# ------------------------------------------------------------------------------------ checkpoints


def hf_config(cfg: ModelConfig, quantization_config: dict | None) -> dict:
    config = {
        "architectures": [cfg.architecture], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if cfg.attention_bias:
        config["attention_bias"] = True
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return config


def hf_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's names, stacked projections split back into their parts."""
    stacked = stacked_projections(model.config)
    tensors = {}
    for name, param in model.named_parameters():
        match = re.fullmatch(r"(layers\.\d+)\.(.+)\.(weight|bias)", name)
        if match is None or match[2] not in stacked:
            tensors[name if name == "lm_head.weight" else f"model.{name}"] = param.detach().clone()
            continue
        parts = stacked[match[2]]
        for (part, _), rows in zip(parts, param.detach().split([rows for _, rows in parts])):
            tensors[f"model.{match[1]}.{part}.{match[3]}"] = rows.clone()
    return tensors


def write_checkpoint(root: Path, cfg: ModelConfig, tensors: dict, quantization_config: dict | None) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(hf_config(cfg, quantization_config)))
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return root


def quantized_tensors(float_tensors: dict, layer_fn, lm_head: bool) -> tuple[dict, dict]:
    """Every decoder projection (and the head, if asked) through layer_fn; returns tensors and meant weights."""
    tensors, meant = {}, {}
    for name, tensor in float_tensors.items():
        prefix = name.removesuffix(".weight")
        is_projection = re.fullmatch(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight", name)
        if is_projection or (lm_head and name == "lm_head.weight"):
            layer_tensors, meant[prefix] = layer_fn(tensor)
            tensors.update({f"{prefix}.{suffix}": t for suffix, t in layer_tensors.items()})
        else:
            tensors[name] = tensor
    return tensors, meant


def ct_config(weights: dict, input_activations: dict | None = None, ignore=("lm_head",), **extra) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (one config group)."""
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                                "group_size": None, "block_structure": None, "actorder": None,
                                                "observer": "minmax", "observer_kwargs": {}, **weights},
             "input_activations": input_activations, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None,
            "sparsity_config": {}, **extra}


DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
STATIC_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# name -> (quantization_config, layer_fn, FP8 LM head, inputs per scale block: None for one scale per row, where
# the stored e4m3 values and scales are kept exactly; so are a block layout's layers with no more inputs)
LAYOUTS = {
    "ct-channel": (ct_config({"strategy": "channel"}, DYNAMIC_TOKEN), per_channel, False, None),
    "ct-tensor-static": (ct_config({"strategy": "tensor"}, STATIC_TENSOR, ignore=["re:.*lm_head$"]),
                         per_tensor([1]), False, None),
    "ct-block": (ct_config({"strategy": "block", "block_structure": [128, 128]},
                           {**DYNAMIC_TOKEN, "strategy": "group", "group_size": 128}, ignore=[]),
                 blockwise(128, 128, "weight_scale"), True, 128),
    "ct-group": (ct_config({"strategy": "group", "group_size": 64}, None), blockwise(1, 64, "weight_scale"),
                 False, 64),
    "fp8-block": (FP8_BLOCK, blockwise(128, 128, "weight_scale_inv"), True, 128),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
                   per_tensor([]), False, None),
}


@pytest.fixture(scope="module")
def toy():
    """toy-greedy in fp32 and its weights under Hugging Face's names."""
    model = build_preset_model("toy-greedy", torch.float32).eval()
    return model, hf_tensors(model)


def write_layout(root: Path, toy, name: str) -> tuple[Path, dict]:
    config, layer_fn, lm_head, _ = LAYOUTS[name]
    tensors, meant = quantized_tensors(toy[1], layer_fn, lm_head)
    return write_checkpoint(root, toy[0].config, tensors, config), meant


def logits(model) -> torch.Tensor:
    return EagerSequence(model, len(PROMPT)).extend(PROMPT)


def assert_layers_mean(model, meant: dict, block_columns: int | None, num_layers: int) -> list[float]:
    """Every FP8 layer holds the weights its checkpoint means; returns the block layouts' re-rounding errors."""
    errors = []
    for layer in range(num_layers):
        for module, parts in STACKED.items():
            got = model.get_submodule(f"layers.{layer}.{module}")
            assert isinstance(got, Fp8Linear) and got.weight.dtype == E4M3
            want = torch.cat([meant[f"model.layers.{layer}.{part}"] for part in parts])
            errors.append(check_layer(got, want, block_columns))
    if "lm_head" in meant:
        errors.append(check_layer(model.lm_head, meant["lm_head"], block_columns))
    return errors


def check_layer(got: Fp8Linear, want: torch.Tensor, block_columns: int | None) -> float:
    if block_columns is None or got.in_features <= block_columns:
        assert torch.equal(got.dequantized(), want)
        return 0.0
    # Several blocks a row: exactly the block-dequantized weight rounded again per row (each part on its own).
    assert torch.equal(got.dequantized(), rows_rerounded(want))
    error = float((got.dequantized() - want).norm() / want.norm())
    assert error < REQUANTIZATION_BOUND
    return error


# ------------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_layout_loads_to_the_weights_it_means(tmp_path, toy, name):
    root, meant = write_layout(tmp_path / name, toy, name)
    _, _, lm_head, block_columns = LAYOUTS[name]
    loaded = load_checkpoint(root, torch.float32)
    assert loaded.quantization.method == name.split("-")[0].replace("ct", "compressed-tensors")
    model = loaded.model
    errors = assert_layers_mean(model, meant, block_columns, model.config.num_layers)
    if block_columns is not None:
        print(f"\n{name}: re-rounding to row scales, relative error up to {max(errors):.4f}")
    assert isinstance(model.lm_head, Fp8Linear) == lm_head
    if not lm_head:
        assert torch.equal(model.lm_head.weight, toy[0].lm_head.weight)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, toy[0].embed_tokens.weight)
    # Close to the float model (activations quantized per token too), and greedy keeps the designed tokens.
    fp8_logits, float_logits = logits(model), logits(toy[0])
    assert float((fp8_logits - float_logits).norm() / float_logits.norm()) < 0.02
    next_tokens = fp8_logits.argmax(-1).tolist()
    assert next_tokens == [toy_greedy_continuation([token], 1)[0] for token in PROMPT]


def test_block_requantization_error():
    """Block scales (128 x 128) re-rounded to one scale per row: the error it adds against the block-dequantized
    weight, on weights whose input columns differ in size (as trained layers' do), next to the block
    quantization's own error against the float weight."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 1024, generator=gen) * torch.exp(0.5 * torch.randn(1024, generator=gen))
    weight[:, torch.randint(0, 1024, (8,), generator=gen)] *= 10  # a few outlier inputs
    tensors, meant = blockwise(128, 128, "weight_scale_inv")(weight)
    q, scale = to_per_channel(tensors["weight"], tensors["weight_scale_inv"], ScaleLayout("blocks", 128, 128))
    got = q.float() * scale[:, None]
    requantization = float((got - meant).norm() / meant.norm())
    block_quantization = float((meant - weight).norm() / weight.norm())
    print(f"\nre-rounding 128x128 blocks to rows: {requantization:.4f} relative error against the block-dequantized "
          f"weight (block quantization itself: {block_quantization:.4f} against the float weight)")
    assert torch.equal(got, rows_rerounded(meant))
    assert 0.005 < requantization < REQUANTIZATION_BOUND
    assert requantization < 1.5 * block_quantization


def test_fp8_qwen2_with_biases_loads_them(tmp_path):
    """Stacked q/k/v in FP8 keep their float biases (Qwen2)."""
    cfg = dataclasses.replace(get_preset("tiny-random").config, architecture="Qwen2ForCausalLM", attention_bias=True)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0.0, 0.05)
    tensors, meant = quantized_tensors(hf_tensors(model), per_channel, lm_head=False)
    root = write_checkpoint(tmp_path / "qwen2", cfg, tensors, LAYOUTS["ct-channel"][0])
    loaded = load_checkpoint(root, torch.float32).model
    assert_layers_mean(loaded, meant, None, cfg.num_layers)
    qkv = loaded.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.bias, model.layers[1].self_attn.qkv_proj.bias)
    # In bf16 the biases follow the dtype; the e4m3 weights and fp32 scales stay as they are.
    qkv16 = load_checkpoint(root, torch.bfloat16).model.layers[1].self_attn.qkv_proj
    assert (qkv16.weight.dtype, qkv16.weight_scale.dtype, qkv16.bias.dtype) == (E4M3, torch.float32, torch.bfloat16)
    assert torch.equal(qkv16.dequantized(), qkv.dequantized())
    # Random weights leave no margin: FP8 moves these logits about 6%, as `--quantize fp8` of the float model does.
    rtn = copy.deepcopy(model)
    quantize_model(rtn, QuantScheme.from_flags("fp8", None, False, False))
    float_logits = logits(model)
    error, rtn_error = (float((logits(m) - float_logits).norm() / float_logits.norm()) for m in (loaded, rtn))
    assert error < 1.2 * rtn_error


# ------------------------------------------------------------------------------------ refused


def config_only(tmp_path: Path, quantization_config: dict) -> Path:
    """A checkpoint directory with config.json only: quantization configs are checked before any weight."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(hf_config(get_preset("toy-greedy").config, quantization_config)))
    return root


CHANNEL = ct_config({"strategy": "channel"}, DYNAMIC_TOKEN)


@pytest.mark.parametrize("config, message", [
    ({**CHANNEL, "format": "pack-quantized"}, "compressed-tensors format 'pack-quantized' is not supported"),
    ({**CHANNEL, "format": "int-quantized"}, "compressed-tensors format 'int-quantized' is not supported"),
    ({**CHANNEL, "format": "naive-quantized"}, "compressed-tensors format 'naive-quantized' is not supported"),
    (ct_config({"strategy": "channel", "type": "int"}), "weights of type 'int' with num_bits 8 are not supported"),
    (ct_config({"strategy": "tensor_group", "num_bits": 4, "group_size": 16}),
     "weights of type 'float' with num_bits 4 are not supported"),
    (ct_config({"strategy": "channel", "symmetric": False}), "asymmetric FP8 weights"),
    (ct_config({"strategy": "tensor_group"}), "weight strategy 'tensor_group' is not supported"),
    (ct_config({"strategy": "group", "group_size": 128, "actorder": "group"}), "actorder"),
    ({**CHANNEL, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({**CHANNEL, "quantization_status": "frozen"}, "quantization_status 'frozen' is not supported"),
    ({**FP8_BLOCK, "fmt": "e5m2"}, "fp8 fmt 'e5m2' is not supported"),
    ({**FP8_BLOCK, "weight_block_size": [128]}, r"weight_block_size must be two positive integers"),
    ({**CHANNEL, "ignore": ["re:(lm_head"]}, r"ignore entry 're:\(lm_head' is no regex"),
], ids=["pack-quantized", "int-quantized", "naive-quantized", "int-weights", "nvfp4", "asymmetric", "tensor-group",
        "actorder", "kv-cache", "frozen", "e5m2-config", "bad-block-size", "bad-regex"])
def test_unsupported_fp8_configs_are_refused(tmp_path, config, message):
    with pytest.raises(Pt2ServeError, match=message) as refused:
        load_checkpoint(config_only(tmp_path, config), torch.float32)
    assert "config.json" in str(refused.value)


def _edited(tmp_path, toy, name: str, edit) -> Path:
    config, layer_fn, lm_head, _ = LAYOUTS[name]
    tensors, _ = quantized_tensors(toy[1], layer_fn, lm_head)
    cfg = toy[0].config
    edited = edit(tensors, config, cfg)  # edits the tensors in place, or returns a new (config, ModelConfig)
    if isinstance(edited, tuple):
        config, cfg = edited
    return write_checkpoint(tmp_path / "edited", cfg, tensors, config)


def _float_q_proj(tensors, config, cfg):
    prefix = "model.layers.1.self_attn.q_proj"
    weight = tensors.pop(f"{prefix}.weight").float() * tensors.pop(f"{prefix}.weight_scale").float()
    tensors[f"{prefix}.weight"] = weight.to(torch.bfloat16)


def _e5m2(tensors, config, cfg):
    for key in [key for key, t in tensors.items() if t.dtype == E4M3]:
        tensors[key] = tensors[key].float().to(torch.float8_e5m2)


@pytest.mark.parametrize("name, edit, message", [
    ("ct-channel", _float_q_proj, r"v_proj stored as F8_E4M3, but model.layers.1.self_attn.q_proj as BF16: .*"
                                  "FP8 alike"),
    ("ct-channel", lambda t, c, m: ({**c, "ignore": ["lm_head", "re:.*\\.k_proj"]}, m),
     r"model.layers.0.self_attn.k_proj.weight is stored as F8_E4M3, but quantization_config lists"),
    ("ct-channel", lambda t, c, m: t.update({"model.embed_tokens.weight": e4m3(t["model.embed_tokens.weight"])}),
     "pt2serve keeps the embedding in float"),
    ("fp8-block", lambda t, c, m: (c, dataclasses.replace(m, tie_word_embeddings=True)),
     r"ties the LM head to the embedding \(tie_word_embeddings=true\)"),
    ("ct-channel", lambda t, c, m: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(1)}),
     r"down_proj.weight_scale has shape \[1\]; for a \[320, 128\] weight quantization_config allows "
     r"\[320, 1\] \(per-channel\)"),
    ("fp8-block", lambda t, c, m: t.pop("model.layers.0.mlp.up_proj.weight_scale_inv"),
     "up_proj.weight is stored as F8_E4M3 but model.layers.0.mlp.up_proj.weight_scale_inv is missing"),
    ("fp8-tensor", _e5m2, "stored as F8_E5M2: pt2serve reads FP8 weights in e4m3"),
    ("ct-channel", lambda t, c, m: (None, m),
     r"stored as F8_E4M3; a quantized checkpoint needs a quantization_config in config.json \(gptq, awq, "
     r"compressed-tensors or fp8\)"),
], ids=["float-q-proj", "ignored-but-fp8", "fp8-embedding", "tied-fp8-head", "scale-shape", "missing-scale",
        "e5m2-tensors", "no-config"])
def test_fp8_checkpoints_pt2serve_cannot_read_are_refused(tmp_path, toy, name, edit, message):
    root = _edited(tmp_path, toy, name, edit)
    with pytest.raises(Pt2ServeError, match=message):
        load_checkpoint(root, torch.float32)


def test_fp8_checkpoint_is_not_quantized_again(tmp_path, toy):
    root, _ = write_layout(tmp_path / "ct", toy, "ct-channel")
    assert load_model(str(root), None, torch.float32).quantization_method == "compressed-tensors"
    with pytest.raises(Pt2ServeError, match="already compressed-tensors-quantized; export it without --quantize"):
        load_model(str(root), None, torch.float32, quantize=QuantScheme.from_flags("fp8", None, False, False))
    # The command says so too, without a traceback.
    done = subprocess.run([PT2SERVE, "export", "--backend", "cpu", "--use-offgraph-kv-cache", "--checkpoint",
                           str(root), "--quantize", "fp8", "-o", str(tmp_path / "m.pt2")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "already compressed-tensors-quantized" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# ------------------------------------------------------------------------------------ export


@pytest.fixture(scope="module")
def fp8_block_artifact(tmp_path_factory, toy) -> Path:
    """toy-greedy as a block-wise fp8 checkpoint (LM head too), exported on the CPU with the fewest methods."""
    root, _ = write_layout(tmp_path_factory.mktemp("fp8-checkpoint") / "toy-greedy-fp8-block", toy, "fp8-block")

    def options(path: Path):
        return dataclasses.replace(export_options_for_tests("toy-greedy", path), preset=None, checkpoint=root,
                                   forward_sizes=(4,))

    return exported("toy-greedy-fp8-block-checkpoint", options, tmp_path_factory)


def test_exported_fp8_checkpoint_generates_the_designed_tokens(fp8_block_artifact):
    prompts = [[256, 5, 9], [3] * 7, list(range(40, 70))] + [[start] for start in range(0, 256, 37)]
    generates_the_designed_tokens(fp8_block_artifact, prompts, ExecutorConfig(num_cells=512))


def test_exported_fp8_checkpoint_records_its_method(fp8_block_artifact):
    raw = read_metadata(fp8_block_artifact).raw
    cfg = get_preset("toy-greedy").config
    assert raw["quantization"] == {
        "method": "fp8", "format": "fp8-e4m3", "bits": 8, "weight_scales": "per-channel",
        "activations": "dynamic per-token", "num_layers_quantized": 4 * cfg.num_layers + 1, "lm_head": True,
        "embedding": False,
    }
    weights = {entry["name"]: entry for entry in raw["weights"]}
    assert weights["layers.0.self_attn.qkv_proj.weight"]["dtype"] == "float8_e4m3fn"
    assert weights["lm_head.weight_scale"]["shape"] == [cfg.vocab_size]
    shown = subprocess.run([PT2SERVE, "inspect", str(fp8_block_artifact)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    assert "fp8 e4m3 fp8, per-channel weight scales, dynamic per-token activation scales; 9 layers" in shown.stdout
