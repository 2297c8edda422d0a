"""Weight-only quantization on the CPU: the packed format, the RTN quantizer, quantized layers, toy-greedy's
designed tokens through quantized models, export flags, and GPTQ / AWQ checkpoints written here in their
published layouts (AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear) loading to the
weights those layouts mean."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pt2serve.errors import Pt2ServeError
from pt2serve.export import inductor_fixes
from pt2serve.export.options import ExportOptions
from pt2serve.kernels.quant_format import dequantize, pack, reference_quant_linear, unpack
from pt2serve.kernels.quant_linear import quant_linear
from pt2serve.model.checkpoint import load_checkpoint, load_model
from pt2serve.model.eager import EagerSequence, greedy_generate
from pt2serve.model.presets import build_preset_model, toy_greedy_continuation
from pt2serve.model.quant import (
    LinearFormat,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantScheme,
    describe_quantization,
    formats_from_weights,
    quantize_model,
    quantize_weight,
)

# --------------------------------------------------------------------------------------------- the format


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    q = torch.randint(0, 2**bits, (7, 24), dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 24 * bits // 8)
    assert torch.equal(unpack(packed, bits), q)


def test_int4_split_halves():
    """Byte j of a 256-column block holds column j low and column j + 128 high; a short last block of L
    columns holds j and j + L / 2 (the kernels rely on it)."""
    assert pack(torch.tensor([[1, 2, 15, 0]]), 4).tolist() == [[0xF1, 0x02]]
    q = torch.randint(0, 16, (3, 256 + 12), dtype=torch.uint8)
    packed = pack(q, 4)
    assert packed.shape == (3, 134)
    assert torch.equal(packed[:, :128] & 15, q[:, :128]) and torch.equal(packed[:, :128] >> 4, q[:, 128:256])
    assert torch.equal(packed[:, 128:] & 15, q[:, 256:262]) and torch.equal(packed[:, 128:] >> 4, q[:, 262:])


@pytest.mark.parametrize("num_columns", [2, 96, 256, 384, 4096, 4098])
def test_int4_round_trip_over_whole_and_short_blocks(num_columns):
    q = torch.randint(0, 16, (5, num_columns), dtype=torch.uint8)
    assert torch.equal(unpack(pack(q, 4), 4), q)


def test_dequantize_uses_each_columns_group_and_the_midpoint_when_symmetric():
    q = torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.uint8)  # 6 columns, groups of 4: the last is short
    scales = torch.tensor([[0.5, 2.0]])
    zeros = torch.tensor([[1, 3]], dtype=torch.uint8)
    assert dequantize(pack(q, 8), scales, zeros, 8, 4).tolist() == [[-0.5, 0.0, 0.5, 1.0, 2.0, 4.0]]
    assert dequantize(pack(q, 8), scales, None, 8, 4).tolist() == [[-64.0, -63.5, -63.0, -62.5, -248.0, -246.0]]


def test_reference_applies_the_input_permutation():
    weight_q = torch.randint(0, 16, (5, 8), dtype=torch.uint8)
    scales, perm = torch.rand(5, 2) + 0.1, torch.randperm(8)
    x = torch.randn(3, 8)
    # Column j holds input perm[j]: the float weight has it at perm[j].
    stored = dequantize(pack(weight_q, 4), scales, None, 4, 4)
    weight = torch.empty_like(stored)
    weight[:, perm] = stored
    torch.testing.assert_close(reference_quant_linear(x, pack(weight_q, 4), scales, None, perm, 4, 4), x @ weight.T)


# Widths no multiple of the 256-column int4 block or of the group: toy-greedy's hidden size and MLP, Qwen2.5-0.5B's
# hidden size, one short block alone, and one whose last group is 2 wide.
ODD_WIDTHS = (320, 896, 128, 96, 130)
GROUP_SIZES = (32, 64, 128, 256, None)  # None: one group per row
ODD_ROWS = 5
# The formats RTN exports: int4 with zero points, int8 symmetric; then the others a checkpoint may bring.
EXPORTED_FORMATS = [(4, False), (8, True)]
FORMATS = EXPORTED_FORMATS + [(4, True), (8, False)]


def independent_unpack(qweight: torch.Tensor, bits: int, num_columns: int) -> torch.Tensor:
    """The values [N, K] the format description says qweight holds, column by column."""
    if bits == 8:
        return qweight.long()
    byte_of, shift_of = [], []
    for column in range(num_columns):
        start = column - column % 256
        block = min(256, num_columns - start)
        offset = column - start
        byte_of.append(start // 2 + offset % (block // 2))
        shift_of.append(0 if offset < block // 2 else 4)
    return (qweight.long()[:, byte_of] >> torch.tensor(shift_of)) & 15


def independent_dequantize(qweight, scales, zeros, bits: int, group_size: int, num_columns: int) -> torch.Tensor:
    group = torch.arange(num_columns) // group_size
    zero = 2 ** (bits - 1) if zeros is None else zeros.long()[:, group]
    return (independent_unpack(qweight, bits, num_columns) - zero) * scales[:, group]


def odd_format(bits: int, symmetric: bool, num_columns: int, group_size: int):
    """Random (qweight, scales, zeros) of ODD_ROWS rows."""
    gen = torch.Generator().manual_seed(num_columns * 1000 + group_size)
    num_groups = -(-num_columns // group_size)
    q = torch.randint(0, 2**bits, (ODD_ROWS, num_columns), generator=gen)
    scales = torch.rand(ODD_ROWS, num_groups, generator=gen) + 0.1
    # An int4 zero may be 16 (GPTQ's offset): one past the largest value, as far as a byte holds.
    top = min(2**bits, 255)
    zeros = None if symmetric else torch.randint(0, top + 1, (ODD_ROWS, num_groups), generator=gen).to(torch.uint8)
    return pack(q, bits), scales, zeros


def odd_shapes(short_last_group_only: bool = False) -> list[tuple[int, int]]:
    """(K, group size) for every odd width and group size (per row: the width)."""
    shapes = [(k, g or k) for k in ODD_WIDTHS for g in GROUP_SIZES]
    if short_last_group_only:
        return [(k, g) for k, g in shapes if g < k and k % g]
    return shapes


@pytest.mark.parametrize("bits,symmetric", FORMATS)
def test_odd_widths_unpack_dequantize_and_multiply_as_the_format_says(bits, symmetric):
    for num_columns, group_size in odd_shapes():
        case = (num_columns, group_size)
        qweight, scales, zeros = odd_format(bits, symmetric, num_columns, group_size)
        assert qweight.shape == (ODD_ROWS, num_columns * bits // 8), case
        values = independent_unpack(qweight, bits, num_columns)
        assert torch.equal(unpack(qweight, bits).long(), values), case
        assert torch.equal(pack(values, bits), qweight), case
        weight = independent_dequantize(qweight, scales, zeros, bits, group_size, num_columns)
        assert torch.equal(dequantize(qweight, scales, zeros, bits, group_size), weight), case
        x = torch.randn(3, num_columns)
        torch.testing.assert_close(quant_linear(x, qweight, scales, zeros, None, bits, group_size), x @ weight.T,
                                   msg=lambda m: f"{case}: {m}")


def test_odd_widths_compiled_write_every_group():
    """quant_linear and an embedding's dequantize as exports compile them on the CPU (Inductor's C++ code with
    pt2serve's fixes), every short last group of the exported formats in one graph. Unfixed, the loop over a
    row's columns, indexed by column // group_size, was split into (K // group_size) x group_size iterations:
    the short last group was never written and held whatever memory the output was given."""
    from torch._inductor import config as inductor_config

    cases = [(bits, k, g, *odd_format(bits, symmetric, k, g))
             for bits, symmetric in EXPORTED_FORMATS for k, g in odd_shapes(short_last_group_only=True)]
    inputs = [torch.randn(3, k) for _, k, *_ in cases]

    def run(inputs):
        return [(quant_linear(x, qweight, scales, zeros, None, bits, g), dequantize(qweight, scales, zeros, bits, g))
                for x, (bits, _, g, qweight, scales, zeros) in zip(inputs, cases)]

    inductor_fixes.apply()
    with inductor_config.patch(force_disable_caches=True):  # a graph cached before the fixes would hide them
        compiled = torch.compile(run, dynamic=False, fullgraph=True)(inputs)
    for x, (bits, k, g, qweight, scales, zeros), (out, weight) in zip(inputs, cases, compiled):
        case = (bits, k, g)
        expected = independent_dequantize(qweight, scales, zeros, bits, g, k)
        assert torch.equal(weight, expected), case
        torch.testing.assert_close(out, x @ expected.T, msg=lambda m: f"{case}: {m}")


# --------------------------------------------------------------------------------------------- RTN


@pytest.mark.parametrize("bits,group_size,symmetric", [(8, 40, True), (8, 17, True), (4, 16, False), (4, 6, False)])
def test_quantize_weight_error_is_within_half_a_step(bits, group_size, symmetric):
    weight = torch.randn(12, 40) * 0.05
    weight[3, :] = 0.0  # an all-zero row stays exactly zero
    q, scales, zeros = quantize_weight(weight, bits, group_size, symmetric, torch.float32)
    assert q.dtype == torch.uint8 and int(q.max()) < 2**bits
    assert (zeros is None) == symmetric
    restored = dequantize(pack(q, bits), scales, zeros, bits, group_size)
    step = scales.repeat_interleave(group_size, dim=1)[:, :40]
    assert bool(((restored - weight).abs() <= step / 2 + 1e-7).all())
    assert bool((restored[3] == 0).all())


def test_quantized_linear_matches_its_dequantized_weights():
    layer = torch.nn.Linear(64, 48, bias=True)
    scheme = QuantScheme.from_flags("int4", 32, False, False)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].proj = layer
    holder.lm_head = torch.nn.Linear(4, 4)
    quantize_model(holder, scheme)
    quantized = holder.layers[0].proj
    assert isinstance(quantized, QuantizedLinear) and isinstance(holder.lm_head, torch.nn.Linear)
    x = torch.randn(5, 64)
    torch.testing.assert_close(quantized(x), x @ quantized.dequantized().T + layer.bias, rtol=1e-5, atol=1e-5)
    assert (quantized.dequantized() - layer.weight).abs().max() < 0.05  # and it is close to the float layer


# --------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("scheme", [
    QuantScheme.from_flags("int8", None, False, False),
    QuantScheme.from_flags("int4", None, False, False),
    QuantScheme.from_flags("int4", 32, True, True),
], ids=["int8", "int4", "int4-head-embedding"])
def test_toy_greedy_keeps_its_designed_tokens(scheme):
    model = build_preset_model("toy-greedy", torch.float32).eval()
    quantize_model(model, scheme)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) == scheme.embedding
    assert isinstance(model.lm_head, QuantizedLinear) == scheme.lm_head
    # toy-greedy's MLP input is 128 wide: a group of 128 is its whole row, and still recorded as 128.
    assert describe_quantization(model, "rtn")["group_size"] == scheme.group_size
    for prompt in ([256, 5, 9], [1, 2, 3, 200]):
        assert greedy_generate(model, prompt, 12) == toy_greedy_continuation(prompt, 12)


def test_artifact_records_name_their_packing():
    """Layers are rebuilt from an artifact's record only when its bytes mean what this version's do."""
    names = ["layers.0.mlp.down_proj.qweight", "layers.0.mlp.down_proj.scales", "layers.0.mlp.down_proj.zeros"]
    record = {"bits": 4, "group_size": 32}
    formats = formats_from_weights(names, {**record, "packing": "split-halves-256"})
    assert formats == {"layers.0.mlp.down_proj": LinearFormat(4, 32, has_zeros=True)}
    with pytest.raises(Pt2ServeError, match="an earlier int4 layout.*re-export"):
        formats_from_weights(names, record)
    assert formats_from_weights(names[:2], {"bits": 8, "group_size": None})  # int8 bytes never changed


def test_tied_embedding_quantized_once_serves_as_the_head():
    """llama-3.2-1b style tying: one quantized matrix for both uses."""
    model = build_preset_model("tiny-random", torch.float32).eval()
    model.lm_head = None  # tie it: the head reads the embedding
    quantize_model(model, QuantScheme.from_flags("int8", None, lm_head=True, embedding=False))
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head is None
    x = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.embed_tokens.attend(x), x @ model.embed_tokens.dequantized().T)
    tokens = torch.tensor([4, 0, 257])
    torch.testing.assert_close(model.embed_tokens(tokens), model.embed_tokens.dequantized()[tokens])


def test_quantized_logits_stay_close_to_float():
    prompt = list(range(20))
    reference = EagerSequence(build_preset_model("tiny-random", torch.float32).eval(), 20).extend(prompt)
    errors = {}
    for name in ("int8", "int4"):
        model = build_preset_model("tiny-random", torch.float32).eval()
        quantize_model(model, QuantScheme.from_flags(name, 32, False, False))
        errors[name] = float((EagerSequence(model, 20).extend(prompt) - reference).abs().max())
    assert errors["int8"] < 0.01 < errors["int4"] < 0.2, errors  # int4 is coarser, but still close


# --------------------------------------------------------------------------------------------- export flags


@pytest.mark.parametrize("flags,message", [
    (dict(quantize="int3"), "--quantize must be one of int8, int4"),
    (dict(quantize="int4", group_size=33), "even for int4"),
    (dict(quantize="int8", group_size=1), "at least 2"),
    (dict(group_size=64), "need --quantize"),
    (dict(quantize_lm_head=True), "need --quantize"),
])
def test_export_refuses_bad_quantization_flags(tmp_path, flags, message):
    options = ExportOptions(backend="cpu", output=tmp_path / "m.pt2", preset="tiny", **flags)
    with pytest.raises(Pt2ServeError, match=message):
        options.validate()


def test_default_group_sizes():
    assert QuantScheme.from_flags("int4", None, False, False).group_size == 128
    assert QuantScheme.from_flags("int8", None, False, False).group_size is None


# --------------------------------------------------------------------------------------------- GPTQ / AWQ

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 4, 2, 16, 300
PROJECTIONS = {  # name -> (out, in)
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}
STACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "self_attn.o_proj": ("self_attn.o_proj",),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
           "mlp.down_proj": ("mlp.down_proj",)}
# Projections reading the same input share one g_idx (GPTQ derives it from that input's statistics).
SAME_INPUT = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
              "self_attn.o_proj": "o", "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up", "mlp.down_proj": "down"}


def _pack_u32(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Pack along `axis`, value i of each word at bit bits*i (order[i]: which of the word's values goes there)."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    values = values.astype(np.uint32)
    shape = list(values.shape)
    shape[axis] //= per_word
    out = np.zeros(shape, dtype=np.uint32)
    for i in range(per_word):
        part = values[order[i]::per_word] if axis == 0 else values[:, order[i]::per_word]
        out |= part << np.uint32(bits * i)
    return out.view(np.int32)


def gptq_layer(weight, bits, group_size, sym, g_idx, checkpoint_format):
    """AutoGPTQ's layout of one layer (its QuantLinear.pack): returns the tensors and the weight they mean."""
    out_features, in_features = weight.shape
    maxq = 2**bits - 1
    num_groups = in_features // group_size
    groups = [weight[:, g_idx == g] for g in range(num_groups)]  # GPTQ's per-group quantizer over each group
    if sym:
        scale = torch.stack([g.abs().amax(1) for g in groups]) * 2 / maxq  # [G, N]
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        low = torch.stack([g.amin(1).clamp(max=0) for g in groups])
        high = torch.stack([g.amax(1).clamp(min=0) for g in groups])
        scale = (high - low) / maxq
        zero = torch.round(-low / scale)
    scale = scale.half()
    intweight = torch.round(weight.T / scale.float()[g_idx] + zero[g_idx]).clamp(0, maxq).to(torch.int64)  # [K, N]
    meant = ((intweight - zero[g_idx]) * scale.float()[g_idx]).T.contiguous()
    stored_zero = zero.to(torch.int64) - (1 if checkpoint_format == "gptq" else 0)
    tensors = {
        "qweight": torch.from_numpy(_pack_u32(intweight.numpy(), bits, axis=0)),
        "qzeros": torch.from_numpy(_pack_u32(stored_zero.numpy(), bits, axis=1)),
        "scales": scale,
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, meant


def awq_layer(weight, group_size):
    """AutoAWQ's GEMM layout of one layer (WQLinear_GEMM.from_linear): tensors and the weight they mean."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, -1, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low).clamp(min=1e-5) / 15).T.contiguous().half()  # [G, N]
    zero = torch.round(-low.T / scale.float()).clamp(0, 15)
    g = torch.arange(in_features) // group_size
    intweight = torch.round(weight.T / scale.float()[g] + zero[g]).clamp(0, 15).to(torch.int64)
    meant = ((intweight - zero[g]) * scale.float()[g]).T.contiguous()
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    tensors = {
        "qweight": torch.from_numpy(_pack_u32(intweight.numpy(), 4, axis=1, order=order)),
        "qzeros": torch.from_numpy(_pack_u32(zero.to(torch.int64).numpy(), 4, axis=1, order=order)),
        "scales": scale,
    }
    return tensors, meant


def write_quantized_checkpoint(root: Path, quantization_config: dict, layer_fn, seed=0):
    """A two-layer Llama whose projections are quantized by `layer_fn`; returns the float weights they mean."""
    root.mkdir()
    gen = torch.Generator().manual_seed(seed)
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "quantization_config": quantization_config,
    }
    (root / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.1,
    }
    meant = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        orders = {}
        for name, shape in PROJECTIONS.items():
            weight = torch.randn(*shape, generator=gen) * 0.1
            order_key = SAME_INPUT[name]
            if order_key not in orders:
                orders[order_key] = torch.randperm(shape[1], generator=gen)
            layer_tensors, meant[f"{prefix}.{name}"] = layer_fn(weight, orders[order_key])
            tensors.update({f"{prefix}.{name}.{suffix}": t for suffix, t in layer_tensors.items()})
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return meant


def act_order_g_idx(order: torch.Tensor, group_size: int) -> torch.Tensor:
    """GPTQ with desc_act: inputs quantized in `order`, groups of group_size along it, g_idx in input order."""
    g_idx = torch.empty_like(order)
    g_idx[order] = torch.arange(len(order)) // group_size
    return g_idx


GPTQ_CASES = [
    # bits, group size (-1: per row), sym, desc_act, checkpoint_format
    (4, 32, False, True, "gptq"),
    (4, 32, True, False, "gptq"),
    (4, 16, False, True, "gptq_v2"),
    (8, -1, True, True, "gptq_v2"),
    (8, 32, False, False, "gptq"),
]


def _expected_stacked(meant: dict, layer: int, module: str) -> torch.Tensor:
    return torch.cat([meant[f"model.layers.{layer}.{part}"] for part in STACKED[module]])


def _check_loaded(loaded, meant, tmp_path):
    """Every quantized layer dequantizes to the weights the layout means, and the model computes with them."""
    for layer in range(2):
        for module in STACKED:
            got = loaded.model.get_submodule(f"layers.{layer}.{module}")
            assert isinstance(got, QuantizedLinear)
            torch.testing.assert_close(got.dequantized(), _expected_stacked(meant, layer, module), rtol=0, atol=1e-6)
    # The same weights in float, loaded as a plain checkpoint, give the same logits (perm reaches the input).
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((loaded_root(loaded) / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    tensors = {name: t for name, t in _float_tensors(loaded_root(loaded)).items()}
    tensors.update({f"{name}.weight": weight for name, weight in meant.items()})
    save_file(tensors, plain / "model.safetensors")
    reference = load_checkpoint(plain, torch.float32)
    prompt = [5, 17, 42, 99, 3, 250]
    torch.testing.assert_close(EagerSequence(loaded.model, 8).extend(prompt),
                               EagerSequence(reference.model, 8).extend(prompt), rtol=1e-4, atol=1e-4)


def loaded_root(loaded) -> Path:
    return Path(loaded.source)


def _float_tensors(root: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(root / "model.safetensors").items()
            if not k.endswith(("qweight", "qzeros", "scales", "g_idx"))}


@pytest.mark.parametrize("case", GPTQ_CASES, ids=lambda c: f"{c[0]}bit-g{c[1]}-sym{int(c[2])}-act{int(c[3])}-{c[4]}")
def test_gptq_checkpoint_loads_to_the_weights_its_layout_means(tmp_path, case):
    bits, group_size, sym, desc_act, checkpoint_format = case

    def layer(weight, order):
        groups = group_size if group_size != -1 else weight.shape[1]
        in_order = torch.arange(weight.shape[1])
        g_idx = act_order_g_idx(order if desc_act else in_order, groups)
        return gptq_layer(weight, bits, groups, sym, g_idx, checkpoint_format)

    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
              "checkpoint_format": checkpoint_format}
    meant = write_quantized_checkpoint(tmp_path / "gptq", config, layer)
    loaded = load_checkpoint(tmp_path / "gptq", torch.float32)
    assert loaded.quantization.method == "gptq"
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert (qkv.zeros is None) == sym and (qkv.perm is not None) == (desc_act and group_size != -1)
    _check_loaded(loaded, meant, tmp_path)


def test_awq_gemm_checkpoint_loads_to_the_weights_its_layout_means(tmp_path):
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    meant = write_quantized_checkpoint(tmp_path / "awq", config, lambda weight, order: awq_layer(weight, 32))
    loaded = load_checkpoint(tmp_path / "awq", torch.float32)
    assert loaded.quantization.method == "awq"
    _check_loaded(loaded, meant, tmp_path)


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True}


def _gptq_act_order(weight, order):
    return gptq_layer(weight, 4, 32, False, act_order_g_idx(order, 32), "gptq")


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "only the GEMM layout"),
    ({**GPTQ_CONFIG, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({**GPTQ_CONFIG, "bits": 3}, "3 bits is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({**GPTQ_CONFIG, "group_size": 0}, "group_size must be -1 or an integer >= 2"),
])
def test_unsupported_quantization_configs_are_refused(tmp_path, config, message):
    write_quantized_checkpoint(tmp_path / "ckpt", config, _gptq_act_order)
    with pytest.raises(Pt2ServeError, match=message):
        load_checkpoint(tmp_path / "ckpt", torch.float32)


def test_stacked_projections_with_different_act_orders_are_refused(tmp_path):
    def layer(weight, _order):  # each projection its own order
        return _gptq_act_order(weight, torch.randperm(weight.shape[1]))

    write_quantized_checkpoint(tmp_path / "ckpt", GPTQ_CONFIG, layer)
    with pytest.raises(Pt2ServeError, match="different g_idx"):
        load_checkpoint(tmp_path / "ckpt", torch.float32)


def test_uneven_act_order_groups_are_refused(tmp_path):
    def layer(weight, order):
        tensors, meant = _gptq_act_order(weight, order)
        tensors["g_idx"] = torch.zeros_like(tensors["g_idx"])  # every input in group 0: not 32 per group
        return tensors, meant

    write_quantized_checkpoint(tmp_path / "ckpt", GPTQ_CONFIG, layer)
    with pytest.raises(Pt2ServeError, match="exactly group_size=32 inputs in each group"):
        load_checkpoint(tmp_path / "ckpt", torch.float32)


def test_symmetric_config_with_other_zero_points_is_refused(tmp_path):
    write_quantized_checkpoint(tmp_path / "ckpt", {**GPTQ_CONFIG, "sym": True}, _gptq_act_order)
    with pytest.raises(Pt2ServeError, match="sym=true, but its zero points"):
        load_checkpoint(tmp_path / "ckpt", torch.float32)


def test_quantized_checkpoint_is_not_quantized_again(tmp_path):
    write_quantized_checkpoint(tmp_path / "ckpt", GPTQ_CONFIG, _gptq_act_order)
    loaded = load_model(str(tmp_path / "ckpt"), None, torch.float32)
    assert loaded.quantization_method == "gptq"
    with pytest.raises(Pt2ServeError, match="already gptq-quantized"):
        load_model(str(tmp_path / "ckpt"), None, torch.float32, quantize=QuantScheme.from_flags("int8", None, False, False))


def test_integer_tensors_without_a_quantization_config_are_explained(tmp_path):
    write_quantized_checkpoint(tmp_path / "ckpt", GPTQ_CONFIG, _gptq_act_order)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Pt2ServeError, match="belongs to a quantized layer, but config.json has no quantization_config"):
        load_checkpoint(tmp_path / "ckpt", torch.float32)
