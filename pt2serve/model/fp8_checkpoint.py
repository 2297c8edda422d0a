"""FP8 checkpoints: recognised from config.json's quantization_config, converted to model/fp8.py's layers.

Published layouts, for a linear layer [out N, in K] whose checkpoint prefix is P (e.g.
"model.layers.0.self_attn.q_proj"):

compressed-tensors (llm-compressor): quant_method "compressed-tensors", format "float-quantized", and
config_groups whose weights are {type: "float", num_bits: 8, symmetric: true, strategy: ...}:
    P.weight         F8_E4M3 [N, K]
    P.weight_scale   strategy "channel": [N, 1] (or [N]);  "tensor": [1] (or a scalar);
                     "block", block_structure [bn, bk]: [ceil(N/bn), ceil(K/bk)];
                     "group", group_size g: [N, ceil(K/g)]            (any float dtype, often bf16)
    P.input_scale    static activation scales: not read (see below)
    W[n, k] = weight[n, k] * the scale of the block holding (n, k)
    `ignore` lists layers left in float: module names, or "re:" regexes matched from the name's start.
fp8 (Hugging Face's fine-grained FP8: Qwen3-FP8, DeepSeek releases): quant_method "fp8", fmt "e4m3",
activation_scheme "dynamic", weight_block_size [bn, bk] (usually [128, 128]):
    P.weight             F8_E4M3 [N, K]
    P.weight_scale_inv   float32 [ceil(N/bn), ceil(K/bk)]     W = weight * weight_scale_inv, per block
  and the older per-tensor fp8 (no weight_block_size, activation_scheme "static" or "dynamic"):
    P.weight         F8_E4M3 [N, K]
    P.weight_scale   float32 scalar                           W = weight * weight_scale
    P.input_scale    scalar: not read
    `modules_to_not_convert` / `ignored_layers` list layers left in float (matched as parts of the name).

Our layers hold one scale per output row (kernels/fp8_linear.py). Converting:
- per-channel scales are kept as they are; a per-tensor scale is repeated for every row; so is any block
  layout one block wide (bk >= K). The e4m3 values are kept too: the layer's weight is exactly the
  checkpoint's.
- blocks across K (block-wise, groups) cannot be one scale per row: the weight is dequantized in fp32 and
  rounded to e4m3 again with one scale per row (quantize_rows). That rounds a second time: the block holding
  a row's largest value keeps its values, the row's other blocks land on that block's coarser grid, and
  values below the row's smallest e4m3 step go to zero. tests/test_fp8_checkpoint.py measures it: 2-3%
  relative error (Frobenius norm) against the block-dequantized weight, about as large as the block
  quantization's own error against the float weight (2.7% there).

Activations: our layers always quantize them on the fly, one scale per token, which needs no calibration.
A checkpoint's static per-tensor input_scale tensors are therefore not read, and checkpoints calibrated for
per-tensor, per-group or no activation quantization run with per-token activations here.

Which layers are FP8 follows the tensors: a linear layer whose weight is stored as F8_E4M3 becomes an
Fp8Linear, one stored in float stays float (an FP8 layer the config lists as ignored is refused as a
contradiction). Projections we stack (q/k/v, gate/up) must be FP8 alike; their rows are concatenated, each
part's scales with them. The embedding is never FP8; an FP8 LM head becomes an Fp8Linear head when it is
untied (a tied head is the embedding).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pt2serve.errors import Pt2ServeError
from pt2serve.kernels.fp8_linear import quantize_rows
from pt2serve.model.fp8 import install_fp8_modules
from pt2serve.model.quantized_checkpoint import Part

FP8_METHODS = ("compressed-tensors", "fp8")
E4M3_STORED = "F8_E4M3"  # safetensors' name for float8_e4m3fn
SCALE_DTYPES = ("F64", "F32", "F16", "BF16")
UNREAD_SUFFIXES = ("input_scale", "input_zero_point")  # activations are quantized per token instead
SUPPORTED = ("compressed-tensors (format float-quantized: 8-bit float weights, symmetric, per channel, per "
             "tensor, per block or per group) and fp8 (fmt e4m3, with or without weight_block_size)")


@dataclass(frozen=True)
class ScaleLayout:
    """Which weights share a scale: blocks of `rows` x `columns` (None: the whole dimension)."""

    name: str  # for messages, e.g. "per-channel" or "128x128 blocks"
    rows: int | None
    columns: int | None

    def scale_shape(self, num_rows: int, num_columns: int) -> tuple[int, int]:
        return (-(-num_rows // self.rows) if self.rows else 1, -(-num_columns // self.columns) if self.columns else 1)


PER_CHANNEL = ScaleLayout("per-channel", 1, None)
PER_TENSOR = ScaleLayout("per-tensor", None, None)


@dataclass(frozen=True)
class Fp8CheckpointQuantization:
    """An FP8 checkpoint's quantization_config, checked."""

    method: str  # "compressed-tensors" or "fp8"
    scale_suffix: str  # "weight_scale" or "weight_scale_inv"
    layouts: tuple[ScaleLayout, ...]  # the weight-scale layouts the config allows
    ignore: tuple[str, ...]  # layers the config leaves in float
    ignore_by_regex: bool  # compressed-tensors: names or "re:" regexes; fp8: parts of the name

    def ignores(self, prefix: str) -> bool:
        if self.ignore_by_regex:
            return any(re.match(entry[3:], prefix) if entry.startswith("re:") else entry == prefix
                       for entry in self.ignore)
        return any(entry in prefix for entry in self.ignore)

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("weight", self.scale_suffix, "weight_zero_point", *UNREAD_SUFFIXES)


def read_fp8_quantization_config(hf: dict[str, Any], source: str) -> Fp8CheckpointQuantization | None:
    """The checked config of an FP8 checkpoint; None when quantization_config names another method (or none)."""
    config = hf.get("quantization_config")
    if not isinstance(config, dict) or config.get("quant_method") not in FP8_METHODS:
        return None
    if config.get("kv_cache_scheme"):
        raise Pt2ServeError(f"{source}: quantization_config.kv_cache_scheme (a quantized KV cache) is not "
                            "supported; pt2serve keeps the KV cache in the model's dtype")
    if config["quant_method"] == "fp8":
        return _read_fp8(config, source)
    return _read_compressed_tensors(config, source)


def _read_fp8(config: dict[str, Any], source: str) -> Fp8CheckpointQuantization:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Pt2ServeError(f"{source}: fp8 fmt {fmt!r} is not supported (only e4m3); supported: {SUPPORTED}")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise Pt2ServeError(f"{source}: fp8 activation_scheme {scheme!r} is not supported (dynamic or static)")
    ignore = (_names(config.get("modules_to_not_convert"), f"{source}: fp8 modules_to_not_convert")
              + _names(config.get("ignored_layers"), f"{source}: fp8 ignored_layers"))
    block = config.get("weight_block_size")
    if block is None:
        return Fp8CheckpointQuantization("fp8", "weight_scale", (PER_TENSOR,), ignore, ignore_by_regex=False)
    rows, columns = _block_shape(block, f"{source}: fp8 weight_block_size")
    layout = ScaleLayout(f"{rows}x{columns} blocks", rows, columns)
    return Fp8CheckpointQuantization("fp8", "weight_scale_inv", (layout,), ignore, ignore_by_regex=False)


def _read_compressed_tensors(config: dict[str, Any], source: str) -> Fp8CheckpointQuantization:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise Pt2ServeError(f"{source}: compressed-tensors format {fmt!r} is not supported; supported: {SUPPORTED}")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise Pt2ServeError(f"{source}: compressed-tensors quantization_status {status!r} is not supported: "
                            "pt2serve reads saved (compressed) FP8 weights")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise Pt2ServeError(f"{source}: compressed-tensors sparsity format {sparsity['format']!r} is not supported")
    if config.get("transform_config"):
        raise Pt2ServeError(f"{source}: compressed-tensors transform_config (rotated weights) is not supported")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Pt2ServeError(f"{source}: compressed-tensors quantization_config needs a non-empty config_groups object")
    layouts = []
    for name, group in groups.items():
        where = f"{source}: quantization_config.config_groups.{name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise Pt2ServeError(f"{where} quantizes no weights; pt2serve reads FP8 weights ({SUPPORTED})")
        group_format = group.get("format") or fmt
        if group_format != "float-quantized":
            raise Pt2ServeError(f"{where} has format {group_format!r}; supported: {SUPPORTED}")
        if group.get("output_activations"):
            raise Pt2ServeError(f"{where}: quantized output activations are not supported")
        layouts.append(_weight_layout(group["weights"], where))
    ignore = _names(config.get("ignore"), f"{source}: compressed-tensors ignore")
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as err:
                raise Pt2ServeError(f"{source}: compressed-tensors ignore entry {entry!r} is no regex: {err}") from None
    return Fp8CheckpointQuantization("compressed-tensors", "weight_scale", tuple(dict.fromkeys(layouts)), ignore,
                                     ignore_by_regex=True)


def _names(value: Any, what: str) -> tuple[str, ...]:
    """A config's list of layer names (absent or null: none)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(entry, str) for entry in value):
        raise Pt2ServeError(f"{what} must be a list of layer names, got {value!r}")
    return tuple(value)


def _weight_layout(weights: dict[str, Any], where: str) -> ScaleLayout:
    """One config group's weights -> its scale layout (compressed-tensors' QuantizationArgs, with its defaults)."""
    kind, bits = weights.get("type", "int"), weights.get("num_bits", 8)
    if kind != "float" or bits != 8:
        raise Pt2ServeError(f"{where}: weights of type {kind!r} with num_bits {bits} are not supported; "
                            f"supported: {SUPPORTED}")
    if not weights.get("symmetric", True):
        raise Pt2ServeError(f"{where}: asymmetric FP8 weights (zero points) are not supported; supported: {SUPPORTED}")
    if weights.get("dynamic"):
        raise Pt2ServeError(f"{where}: dynamic weight scales are not supported: pt2serve reads stored scales")
    group_size = weights.get("group_size")
    strategy = weights.get("strategy")
    if strategy is None:  # as compressed-tensors infers it
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    if strategy == "channel":
        return PER_CHANNEL
    if strategy == "tensor":
        return PER_TENSOR
    if strategy == "block":
        rows, columns = _block_shape(weights.get("block_structure"), f"{where}: weights.block_structure")
        return ScaleLayout(f"{rows}x{columns} blocks", rows, columns)
    if strategy == "group":
        if not isinstance(group_size, int) or group_size < 1:
            raise Pt2ServeError(f"{where}: group weights need a positive group_size, got {group_size!r}")
        if weights.get("actorder"):
            raise Pt2ServeError(f"{where}: activation ordering (actorder) is not supported for FP8 weights")
        return ScaleLayout(f"groups of {group_size}", 1, group_size)
    raise Pt2ServeError(f"{where}: weight strategy {strategy!r} is not supported (channel, tensor, block or group)")


def _block_shape(block: Any, what: str) -> tuple[int, int]:
    if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):  # older compressed-tensors: "128x128"
        block = [int(n) for n in block.split("x")]
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise Pt2ServeError(f"{what} must be two positive integers [rows, columns], got {block!r}")
    return block[0], block[1]


# ------------------------------------------------------------------------------------------------ loading


@dataclass(frozen=True)
class _Stored:
    file: Path
    dtype: str  # safetensors' name, e.g. "F8_E4M3"
    shape: tuple[int, ...]


def _headers(files: list[Path]) -> dict[str, _Stored]:
    """Every tensor's file, dtype and shape, from the safetensors headers (no data read)."""
    stored = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                view = reader.get_slice(key)
                stored[key] = _Stored(file, view.get_dtype(), tuple(view.get_shape()))
    return stored


def install_fp8_checkpoint_layers(
    model: nn.Module, layout: dict, files: list[Path], quant: Fp8CheckpointQuantization
) -> dict[str, list[Part]]:
    """Swap in an empty Fp8Linear wherever the checkpoint stores a linear layer in e4m3; returns their parts.

    `layout` is checkpoint_layout of the float model (checkpoint name -> Destination), already in its dtype
    (Module.to(dtype) would also convert the e4m3 buffers).
    """
    stored = _headers(files)
    parts: dict[str, list[Part]] = defaultdict(list)
    for name, destination in layout.items():
        module = destination.name.removesuffix(".weight")
        if name.endswith(".weight") and isinstance(model.get_submodule(module), nn.Linear):
            parts[module].append(Part(name.removesuffix(".weight"), destination.start, destination.shape[0]))
    fp8: dict[str, list[Part]] = {}
    for module, module_parts in parts.items():
        dtypes = {part.prefix: stored[f"{part.prefix}.weight"].dtype for part in module_parts
                  if f"{part.prefix}.weight" in stored}
        in_e4m3 = [prefix for prefix, dtype in dtypes.items() if dtype == E4M3_STORED]
        if not in_e4m3:
            continue  # a float layer (one missing from the checkpoint: the float loader reports it)
        others = [f"{prefix} as {dtype}" for prefix, dtype in dtypes.items() if dtype != E4M3_STORED]
        others += [f"{part.prefix}.weight is missing" for part in module_parts if part.prefix not in dtypes]
        if others:
            raise Pt2ServeError(f"{', '.join(in_e4m3)} stored as {E4M3_STORED}, but {', '.join(others)}: pt2serve "
                                "stacks these projections into one layer and needs q/k/v (and gate/up) in FP8 alike")
        for prefix in in_e4m3:
            if quant.ignores(prefix):
                raise Pt2ServeError(f"{prefix}.weight is stored as {E4M3_STORED}, but quantization_config lists "
                                    f"{prefix} among the layers left in float")
        fp8[module] = sorted(module_parts, key=lambda part: part.start)
    owned = fp8_owned_keys(fp8, quant)
    for key, tensor in stored.items():
        if tensor.dtype.startswith("F8_") and key not in owned:
            raise Pt2ServeError(_unread_fp8_tensor(key, tensor.dtype, model))
    if not fp8:
        raise Pt2ServeError(f"config.json says the checkpoint is {quant.method}-quantized, but no linear layer's "
                            f"weight is stored as {E4M3_STORED}")
    install_fp8_modules(model, list(fp8))
    return fp8


def _unread_fp8_tensor(key: str, dtype: str, model: nn.Module) -> str:
    if key == "lm_head.weight" and model.lm_head is None:
        return (f"lm_head.weight is stored as {dtype}, but config.json ties the LM head to the embedding "
                "(tie_word_embeddings=true), which pt2serve never stores in FP8; FP8 LM heads load when untied")
    if key.endswith("embed_tokens.weight"):
        return (f"{key} is stored as {dtype}: pt2serve keeps the embedding in float (a row gather, which FP8 "
                "does not speed up); store it in bf16 or fp32")
    if dtype != E4M3_STORED:
        return f"{key} is stored as {dtype}: pt2serve reads FP8 weights in e4m3 ({E4M3_STORED}) only"
    return f"{key} is stored as {dtype}, but it is no linear layer's weight that pt2serve reads in FP8"


def fp8_owned_keys(layers: dict[str, list[Part]], quant: Fp8CheckpointQuantization) -> set[str]:
    """The checkpoint tensors the FP8 layers read or deliberately leave unread."""
    return {f"{part.prefix}.{suffix}" for parts in layers.values() for part in parts
            for suffix in quant.tensor_suffixes}


@torch.no_grad()
def load_fp8_checkpoint_layers(
    model: nn.Module, layers: dict[str, list[Part]], files: list[Path], quant: Fp8CheckpointQuantization
) -> None:
    """Read every FP8 layer's weight and scales and store them with one scale per output row."""
    stored = _headers(files)
    for module_name, parts in layers.items():
        module = model.get_submodule(module_name)
        converted = [_read_part(part, module.in_features, stored, quant, module.weight.device) for part in parts]
        module.fill(torch.cat([weight for weight, _ in converted]), torch.cat([scale for _, scale in converted]))


def _read_part(part: Part, in_features: int, stored: dict[str, _Stored], quant: Fp8CheckpointQuantization,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    weight_key, scale_key = f"{part.prefix}.weight", f"{part.prefix}.{quant.scale_suffix}"
    if stored[weight_key].shape != (part.rows, in_features):
        raise Pt2ServeError(f"{weight_key} has shape {list(stored[weight_key].shape)}, expected "
                            f"{[part.rows, in_features]} from config.json")
    if scale_key not in stored:
        raise Pt2ServeError(f"{weight_key} is stored as {E4M3_STORED} but {scale_key} is missing "
                            f"({quant.method} checkpoints scale each FP8 weight by its {quant.scale_suffix})")
    scale_info = stored[scale_key]
    if scale_info.dtype not in SCALE_DTYPES:
        raise Pt2ServeError(f"{scale_key} is stored as {scale_info.dtype}; scales must be floats")
    shape = _as_matrix(scale_info.shape, part.rows)
    matching = [layout for layout in quant.layouts if layout.scale_shape(part.rows, in_features) == shape]
    if not matching:
        expected = ", ".join(f"{list(layout.scale_shape(part.rows, in_features))} ({layout.name})"
                             for layout in quant.layouts)
        raise Pt2ServeError(f"{scale_key} has shape {list(scale_info.shape)}; for a [{part.rows}, {in_features}] "
                            f"weight quantization_config allows {expected}")
    zero_key = f"{part.prefix}.weight_zero_point"
    if zero_key in stored and bool(_read(stored, zero_key, device).ne(0).any()):
        raise Pt2ServeError(f"{zero_key} is not all zero: asymmetric FP8 weights are not supported")
    weight = _read(stored, weight_key, device)
    scale = _read(stored, scale_key, device).float().reshape(shape)
    return to_per_channel(weight, scale, matching[0])


def _as_matrix(shape: tuple[int, ...], num_rows: int) -> tuple[int, int]:
    """A stored scale's shape as [row blocks, column blocks]: a scalar or [1] is [1, 1], [N] is [N, 1]."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return tuple(shape) if len(shape) == 2 else (-1, -1)


def _read(stored: dict[str, _Stored], key: str, device: torch.device) -> torch.Tensor:
    with safe_open(str(stored[key].file), framework="pt", device="cpu") as reader:
        return reader.get_tensor(key).to(device)


def to_per_channel(weight: torch.Tensor, scale: torch.Tensor, layout: ScaleLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [N, K] with scales [row blocks, column blocks] in `layout` -> (e4m3 [N, K], fp32 scales [N]).

    Exact when each row has one scale (per-channel, per-tensor, blocks as wide as K); otherwise the weight is
    dequantized and rounded again with one scale per row (see the module docstring).
    """
    num_rows, num_columns = weight.shape
    row_scales = scale.float().repeat_interleave(layout.rows or num_rows, dim=0)[:num_rows]
    if row_scales.shape[1] == 1:
        return weight, row_scales[:, 0].contiguous()
    scales = row_scales.repeat_interleave(layout.columns or num_columns, dim=1)[:, :num_columns]
    return quantize_rows(weight.float() * scales)
