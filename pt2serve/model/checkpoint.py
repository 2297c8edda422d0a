"""Load a Hugging Face checkpoint directory (config.json + safetensors + tokenizer files) into our Transformer.

Our module names equal Hugging Face's minus the leading "model.", except the stacked projections
(model.stacked_projections), which take their checkpoint tensors as row blocks. Loading is that mapping
plus checks: every checkpoint tensor a parameter needs must be there with the right shape, and every
checkpoint tensor must land somewhere. Tensors are read one at a time from memory-mapped safetensors, so a
model larger than host memory in fp32 still loads straight into `dtype` on `device`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from pt2serve.errors import Pt2ServeError
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.config import ModelConfig
from pt2serve.model.fp8_checkpoint import (
    Fp8CheckpointQuantization,
    fp8_owned_keys,
    install_fp8_checkpoint_layers,
    load_fp8_checkpoint_layers,
    read_fp8_quantization_config,
)
from pt2serve.model.model import Transformer, rope_inv_freq, stacked_projections
from pt2serve.model.quant import QuantScheme, quantize_model
from pt2serve.model.quantized_checkpoint import (
    CheckpointQuantization,
    install_checkpoint_layers,
    load_quantized_layers,
    owned_keys,
    read_quantization_config,
)
from pt2serve.tokenizer import TokenizerFiles, read_tokenizer_config

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Hugging Face stores these buffers in some checkpoints; we compute them from config.json instead.
COMPUTED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Tensors only quantized layers have (GPTQ / AWQ, FP8), and the methods whose configs say how to read them.
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_scale", ".weight_scale_inv", ".input_scale")
QUANTIZATION_METHODS = "gptq, awq, compressed-tensors or fp8"


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    model: Transformer  # weights loaded, eval mode
    tokenizer: TokenizerFiles | None  # None when the directory has no tokenizer.json
    source: str  # the directory it came from
    # A GPTQ, AWQ or FP8 checkpoint's quantization_config
    quantization: CheckpointQuantization | Fp8CheckpointQuantization | None = None
    generation_defaults: dict[str, float] = field(default_factory=dict)  # see read_generation_defaults


def load_checkpoint(
    path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu", attention: AttentionImpl = AttentionImpl.MASKED
) -> Checkpoint:
    """Load a Hugging Face checkpoint directory (float, GPTQ, AWQ or FP8) into a Transformer in `dtype` on `device`."""
    root = Path(path)
    if not root.is_dir():
        raise Pt2ServeError(f"checkpoint directory {root} does not exist (or is not a directory)")
    config = read_config(root / "config.json")
    hf, source = _read_json(root / "config.json"), str(root / "config.json")
    fp8 = read_fp8_quantization_config(hf, source)
    quantization = fp8 if fp8 is not None else read_quantization_config(hf, source)
    files = weight_files(root)

    # Build without allocating, then allocate once in the target dtype and device and fill from the files.
    with torch.device("meta"):
        model = Transformer(config, attention).to(dtype)  # before FP8 layers: .to(dtype) would convert them
    quantized_layers, skipped = {}, set()
    if fp8 is not None:
        quantized_layers = install_fp8_checkpoint_layers(model, checkpoint_layout(model), files, fp8)
        skipped = fp8_owned_keys(quantized_layers, fp8)
    elif quantization is not None:
        keys = {key for file in files for key in _tensor_names(file)}
        quantized_layers = install_checkpoint_layers(model, checkpoint_layout(model), keys, quantization)
        skipped = owned_keys(quantized_layers, quantization)
    model = model.to_empty(device=device)
    load_weights(model, files, skipped)
    if fp8 is not None:
        load_fp8_checkpoint_layers(model, quantized_layers, files, fp8)
    elif quantization is not None:
        load_quantized_layers(model, quantized_layers, files, quantization)
    # Not in checkpoints; kept in fp32 (to_empty left it uninitialised, .to(dtype) would have rounded it).
    model.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    model.eval()
    return Checkpoint(config=config, model=model, tokenizer=read_tokenizer(root), source=str(root),
                      quantization=quantization, generation_defaults=read_generation_defaults(root))


def _tensor_names(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt", device="cpu") as reader:
        return list(reader.keys())


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: Transformer  # eval mode
    tokenizer: TokenizerFiles | None
    # "rtn" (quantized here); the checkpoint's "gptq", "awq", "compressed-tensors" or "fp8"; None: float
    quantization_method: str | None
    generation_defaults: dict[str, float] = field(default_factory=dict)


def load_model(
    checkpoint: str | Path | None,
    preset: str | None,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    attention: AttentionImpl = AttentionImpl.MASKED,
    quantize: QuantScheme | None = None,
) -> LoadedModel:
    """The model of a checkpoint directory or a built-in preset (exactly one must be given), quantized as asked."""
    if (checkpoint is None) == (preset is None):
        given = "both" if checkpoint is not None else "neither"
        raise Pt2ServeError(
            f"give exactly one of a checkpoint directory or a preset name ({given} was given)"
        )
    if checkpoint is not None:
        loaded = load_checkpoint(checkpoint, dtype, device, attention)
        config, model, tokenizer = loaded.config, loaded.model, loaded.tokenizer
        defaults = loaded.generation_defaults
        method = loaded.quantization.method if loaded.quantization is not None else None
    else:
        # Imported here: presets build random weights and tokenizers this module otherwise has no use for.
        from pt2serve.model.presets import build_preset_model, get_preset

        found = get_preset(preset)
        config, tokenizer, method, defaults = found.config, found.tokenizer, None, {}
        model = build_preset_model(preset, dtype, device, attention).eval()
    if quantize is not None:
        if method is not None:
            raise Pt2ServeError(f"the checkpoint is already {method}-quantized; export it without --quantize")
        quantize_model(model, quantize)
        method = "rtn"
    return LoadedModel(config, model, tokenizer, method, defaults)


def read_config(path: Path) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json; errors name the file."""
    if not path.is_file():
        raise Pt2ServeError(f"{path} is missing: a Hugging Face checkpoint directory needs a config.json")
    hf = _read_json(path)
    if not isinstance(hf, dict):
        raise Pt2ServeError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    try:
        return ModelConfig.from_hf(hf, source=str(path))
    except Pt2ServeError as err:
        # ModelConfig's own checks (e.g. heads vs kv heads) do not know which file they came from.
        if str(path) in str(err):
            raise
        raise Pt2ServeError(f"{path}: {err}") from None


def weight_files(root: Path) -> list[Path]:
    """The safetensors files holding the weights: model.safetensors, or the shards an index names."""
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if single.is_file():
        return [single]
    if not index.is_file():
        raise Pt2ServeError(
            f"{root} has no {WEIGHTS_FILE} and no {INDEX_FILE}; pt2serve loads safetensors checkpoints only"
        )
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise Pt2ServeError(f"{index}: expected a non-empty 'weight_map' object (tensor name -> shard file)")
    files = []
    for shard in sorted(set(weight_map.values())):
        shard_path = root / shard
        if not shard_path.is_file():
            tensor = next(key for key, value in weight_map.items() if value == shard)
            raise Pt2ServeError(f"{index} names shard {shard!r} (holding e.g. {tensor!r}), but {shard_path} is missing")
        files.append(shard_path)
    return files


@dataclass(frozen=True)
class Destination:
    """Where a checkpoint tensor goes: rows start .. start + shape[0] of one of our parameters."""

    name: str
    start: int
    shape: tuple[int, ...]


def checkpoint_layout(model: Transformer) -> dict[str, Destination]:
    """Every checkpoint tensor the model needs, by its Hugging Face name, and where it goes."""
    stacked = stacked_projections(model.config)
    layout = {}
    for name, param in model.named_parameters():
        # e.g. "layers.3.self_attn.qkv_proj.weight" -> "layers.3", "self_attn.qkv_proj", "weight"
        match = re.fullmatch(r"(layers\.\d+)\.(.+)\.(weight|bias)", name)
        if match is None or match[2] not in stacked:
            layout[_hf_name(name)] = Destination(name, 0, tuple(param.shape))
            continue
        layer, projection, kind = match.groups()
        start = 0
        for part, rows in stacked[projection]:
            layout[f"model.{layer}.{part}.{kind}"] = Destination(name, start, (rows, *param.shape[1:]))
            start += rows
    return layout


@torch.no_grad()
def load_weights(model: Transformer, files: list[Path], skipped: set[str] = frozenset()) -> None:
    """Fill every parameter of `model` from the safetensors files, checking names and shapes.

    `skipped`: checkpoint tensors another loader reads (a quantized layer's).
    """
    cfg = model.config
    params = dict(model.named_parameters())
    layout = checkpoint_layout(model)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                if key in skipped or _is_skipped(key, cfg):
                    continue
                destination = layout.get(key)
                if destination is None and key.endswith(QUANTIZED_SUFFIXES):
                    raise Pt2ServeError(
                        f"{file}: tensor {key!r} belongs to a quantized layer, but config.json has no "
                        f"quantization_config ({QUANTIZATION_METHODS}) saying how it is stored"
                    )
                if destination is None:
                    raise Pt2ServeError(
                        f"{file}: unexpected tensor {key!r}: the {cfg.architecture} model described by config.json "
                        "has no such parameter (does config.json match the weights?)"
                    )
                # Check shape and dtype from the header before reading any data.
                view = reader.get_slice(key)
                shape, kind = list(view.get_shape()), view.get_dtype()
                if shape != list(destination.shape):
                    raise Pt2ServeError(
                        f"{file}: tensor {key!r} has shape {shape}, "
                        f"expected {list(destination.shape)} from config.json"
                    )
                if kind not in FLOAT_DTYPES:
                    raise Pt2ServeError(
                        f"{file}: tensor {key!r} is stored as {kind}; a quantized checkpoint needs a "
                        f"quantization_config in config.json ({QUANTIZATION_METHODS})"
                    )
                rows = params[destination.name].narrow(0, destination.start, shape[0])
                rows.copy_(reader.get_tensor(key))  # copy_ converts dtype and moves to the device
                loaded.add(key)
    missing = [key for key in layout if key not in loaded]
    if missing:
        key = missing[0]
        hint = " (config.json says tie_word_embeddings=false)" if key == "lm_head.weight" else ""
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        where = ", ".join(str(file) for file in files)
        raise Pt2ServeError(f"tensor {key!r}{more} needed by the model is missing from the checkpoint ({where}){hint}")


def _is_skipped(key: str, cfg: ModelConfig) -> bool:
    """Checkpoint tensors we deliberately do not load."""
    if key.endswith(COMPUTED_SUFFIXES):
        return True
    # Tied checkpoints sometimes store the head anyway; ours reads the embedding instead.
    return key == "lm_head.weight" and cfg.tie_word_embeddings


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


# What a checkpoint's generation_config.json may set that a request can leave out, and each one's range.
GENERATION_DEFAULTS = {"temperature": (0.0, 100.0), "top_p": (1e-6, 1.0), "top_k": (0, 1 << 30),
                       "repetition_penalty": (1e-6, 10.0)}


def read_generation_defaults(root: Path) -> dict[str, float]:
    """The sampling defaults the checkpoint's authors chose (generation_config.json), for requests that say
    nothing; values of the wrong type or out of range are refused with a message."""
    gen_config = _optional_json(root / "generation_config.json")
    defaults = {}
    for name, (low, high) in GENERATION_DEFAULTS.items():
        value = gen_config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise Pt2ServeError(f"{root / 'generation_config.json'}: {name} must be a number in [{low}, {high}], "
                                f"got {value!r}")
        defaults[name] = value
    return defaults


def read_tokenizer(root: Path) -> TokenizerFiles | None:
    """tokenizer.json plus special ids and chat template from the files beside it; None without tokenizer.json."""
    tokenizer_path = root / "tokenizer.json"
    if not tokenizer_path.is_file():
        return None
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    try:
        tokenizer = HFTokenizer.from_str(tokenizer_json)
    except Exception as err:  # the tokenizers library raises a bare Exception on bad JSON
        raise Pt2ServeError(f"{tokenizer_path} could not be parsed: {err}") from None
    tok_config = _optional_json(root / "tokenizer_config.json")
    gen_config = _optional_json(root / "generation_config.json")

    special: dict[str, str] = {}
    bos_text = _token_text(tok_config.get("bos_token"))
    eos_text = _token_text(tok_config.get("eos_token"))
    if bos_text is not None:
        special["bos_token"] = bos_text
    if eos_text is not None:
        special["eos_token"] = eos_text
    bos_id = tokenizer.token_to_id(bos_text) if bos_text is not None else None
    eos_ids: list[int] = []
    if eos_text is not None and tokenizer.token_to_id(eos_text) is not None:
        eos_ids.append(tokenizer.token_to_id(eos_text))
    # Chat models often stop on several tokens (e.g. Llama 3's <|eot_id|>), listed only in generation_config.
    gen_eos = gen_config.get("eos_token_id")
    for token_id in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if isinstance(token_id, int) and token_id not in eos_ids:
            eos_ids.append(token_id)

    return TokenizerFiles(
        tokenizer_json=tokenizer_json,
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
        chat_template=_chat_template(root, tok_config),
        special_tokens=special,
    )


def _chat_template(root: Path, tok_config: dict[str, Any]) -> str | None:
    # Newer transformers save the template as its own file, and prefer it over tokenizer_config's, as we do.
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = read_tokenizer_config(path.read_text(encoding="utf-8"), str(path))
    return data if isinstance(data, dict) else {}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise Pt2ServeError(f"{path} is not valid JSON: {err}") from None
