"""A DFlash draft model (z-lab's block-diffusion drafter) written for export beside its target.

A DFlash draft has no embedding and no LM head: it reads the target's. It drafts a block of `block_size`
tokens at once: the sequence's newest known token followed by mask tokens, run through a few Qwen3-style
layers that attend, without a causal mask inside the block, to

  - the draft context: each committed position's target hidden states, taken after the layers listed in
    `target_layer_ids`, concatenated, projected by `fc` and normalised by `hidden_norm`, then projected by
    each draft layer's own k/v projections (k through that layer's k_norm, then rope at the position);
  - the block's own tokens (their K/V after input_layernorm, k_norm and rope, like any Qwen3 layer).

The block's positions 1 .. block_size - 1 go through the draft's final norm and the target's LM head; their
argmax are the drafts. Ropes: context keys at their own positions, the block at positions n .. n + B - 1,
where n is the position of the newest known token (the first one without a hidden state yet).

The context K/V live in the draft's own cell pool (see contract.py): a second pool whose cell ids mirror
the target's, so the runtime's cell allocation serves both. The block's K/V go to per-slot block cells past
the mirrored ones; a block token sees its sequence's context cells and its whole block, which the cell
attention expresses as every block token "sitting" at the block's last position.

Checkpoint layout (as published): config.json (a Qwen3 config plus `block_size` and `dflash_config`:
`mask_token_id`, `target_layer_ids`) and safetensors weights `fc.weight`, `hidden_norm.weight`,
`layers.N.*` (q/k/v/o projections, q_norm, k_norm, MLP, the two layer norms) and `norm.weight`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pt2serve.errors import Pt2ServeError
from pt2serve.model.attention import AttentionImpl, StepAttention
from pt2serve.model.config import ModelConfig
from pt2serve.model.model import (
    DecoderLayer,
    RMSNorm,
    apply_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    stacked_projections,
)

DRAFT_ATTRIBUTE = "draft"  # the draft's module name under the target: its weights are "draft.*" in the artifact


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash draft's config.json: its layers' shape (a Qwen3 config) and how it drafts."""

    layers: ModelConfig  # hidden size, heads, rope, ... of the draft's own layers (vocab: the target's)
    block_size: int  # tokens per drafted block: the newest known token and block_size - 1 masks
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose outputs feed the draft context, in fc's order
    input_embedding_scale: float = 1.0  # the block's token embeddings are scaled by this (1 in published drafts)

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers.to_dict(), "block_size": self.block_size, "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids), "input_embedding_scale": self.input_embedding_scale}


def read_dflash_config(path: Path) -> DFlashConfig:
    """Parse a DFlash draft's config.json; refuse what the draft model here does not implement."""
    if not path.is_file():
        raise Pt2ServeError(f"{path} is missing: a DFlash draft directory needs a config.json")
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise Pt2ServeError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(hf, dict):
        raise Pt2ServeError(f"{path}: expected a JSON object")
    dflash = hf.get("dflash_config") or {}

    def field(name: str, default: Any = None) -> Any:
        return dflash.get(name, hf.get(name, default))

    ids, mask, block = field("target_layer_ids"), field("mask_token_id"), field("block_size", 16)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise Pt2ServeError(f"{path}: dflash_config.target_layer_ids must be a non-empty list of layer numbers, "
                            f"got {ids!r}")
    if not isinstance(mask, int):
        raise Pt2ServeError(f"{path}: dflash_config.mask_token_id must be a token id, got {mask!r}")
    if not isinstance(block, int) or block < 2:
        raise Pt2ServeError(f"{path}: block_size must be an integer of at least 2, got {block!r}")
    if field("is_causal") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise Pt2ServeError(f"{path}: causal or sliding-window draft layers are not supported (only the "
                            "published non-causal DFlash layers)")
    if not hf.get("rope_is_neox_style", hf.get("is_neox_style", True)):
        raise Pt2ServeError(f"{path}: interleaved rope (is_neox_style=false) is not supported: pt2serve's rope "
                            "rotates halves, as the targets it serves do")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise Pt2ServeError(f"{path}: partial rotary embeddings (partial_rotary_factor "
                            f"{hf['partial_rotary_factor']}) are not supported: rope covers the whole head")
    if field("candidate_selector") or field("conv_kernel_size"):
        raise Pt2ServeError(f"{path}: DFlash2 drafts (candidate selector, convolutions) are not supported")
    # The draft's layers are Qwen3 layers; parse them with the decoder's own config reader.
    try:
        layers = ModelConfig.from_hf({**hf, "architectures": ["Qwen3ForCausalLM"]}, source=str(path))
    except Pt2ServeError as err:
        raise Pt2ServeError(f"DFlash draft: {err}") from None
    return DFlashConfig(layers, block, mask, tuple(ids), float(field("input_embedding_scale", 1.0)))


def check_against_target(draft: DFlashConfig, target: ModelConfig, source: str) -> None:
    """Refuse a draft that cannot read this target's hidden states, embeddings or positions."""
    layers = draft.layers
    if layers.hidden_size != target.hidden_size:
        raise Pt2ServeError(
            f"{source}: the draft's hidden_size ({layers.hidden_size}) differs from the target's "
            f"({target.hidden_size}): a DFlash draft reads the target's embeddings, hidden states and LM head, "
            "so it must be the draft trained for this target")
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise Pt2ServeError(
            f"{source}: dflash_config.target_layer_ids {list(draft.target_layer_ids)} names layer {bad[0]}, but the "
            f"target has layers 0..{target.num_layers - 1}: the draft was trained for another target")
    if len(set(draft.target_layer_ids)) != len(draft.target_layer_ids):
        raise Pt2ServeError(f"{source}: dflash_config.target_layer_ids {list(draft.target_layer_ids)} repeats a layer")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise Pt2ServeError(f"{source}: mask_token_id {draft.mask_token_id} is outside the target's vocabulary "
                            f"(0..{target.vocab_size - 1})")
    if layers.vocab_size != target.vocab_size:
        raise Pt2ServeError(f"{source}: the draft's vocab_size ({layers.vocab_size}) differs from the target's "
                            f"({target.vocab_size})")
    # The draft's positions are the target's: a draft whose rope base differs from the target's was trained for
    # another model, and its drafts would be rejected without any error. The draft applies its own rope (as the
    # published code does), so a draft without the target's frequency scaling is taken as it was trained; two
    # different scalings are refused.
    scalings = (layers.rope_scaling, target.rope_scaling)
    if layers.rope_theta != target.rope_theta or (None not in scalings and scalings[0] != scalings[1]):
        raise Pt2ServeError(
            f"{source}: the draft's rope (theta {layers.rope_theta}, scaling {layers.rope_scaling}) differs from the "
            f"target's (theta {target.rope_theta}, scaling {target.rope_scaling}): its positions would not match "
            "the target's, so its drafts would be rejected; use the draft trained for this target")


class DFlashDraft(nn.Module):
    """The draft's weights and its two computations: writing the context cells and drafting a block."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        layers = cfg.layers
        self.fc = nn.Linear(len(cfg.target_layer_ids) * layers.hidden_size, layers.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(layers.hidden_size, layers.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(layers) for _ in range(layers.num_layers))
        self.norm = RMSNorm(layers.hidden_size, layers.rms_norm_eps)
        self.register_buffer(
            "inv_freq", rope_inv_freq(layers.head_dim, layers.rope_theta, layers.rope_scaling), persistent=False
        )
        self.rope_attention_factor = rope_attention_factor(layers.rope_scaling)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor)

    def write_context(
        self,
        taps: torch.Tensor,  # [T, len(target_layer_ids) * hidden]: the target's tapped hidden states
        positions: torch.Tensor,  # [T]
        write_cells: torch.Tensor,  # [T]: the draft cells of those positions (the target's cell ids)
        k_pools: list[torch.Tensor],  # per draft layer [C, KVH, D], written in place
        v_pools: list[torch.Tensor],
    ) -> None:
        """Project the target's hidden states into every draft layer's context K/V."""
        context = self.hidden_norm(self.fc(taps))
        cos, sin = self.rope(positions)
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools):
            attn = layer.self_attn
            # The context skips input_layernorm and q: it only provides keys and values (as published).
            _, k, v = attn.qkv_proj(context).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
            k = k.reshape(-1, attn.num_kv_heads, attn.head_dim)
            v = v.reshape(-1, attn.num_kv_heads, attn.head_dim)
            if attn.k_norm is not None:
                k = attn.k_norm(k)
            k_pool.index_copy_(0, write_cells, apply_rope(k, cos, sin).to(k_pool.dtype))
            v_pool.index_copy_(0, write_cells, v.to(v_pool.dtype))

    def draft_hidden(
        self,
        embeddings: torch.Tensor,  # [S * B, hidden]: the blocks' token embeddings, sequence-major
        seq_indptr: torch.Tensor,  # [S+1]: sequence s owns seq_cells[seq_indptr[s] : seq_indptr[s+1]]
        seq_cells: torch.Tensor,  # [E]: each sequence's context cells, then its B block cells
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        attention: AttentionImpl,
    ) -> torch.Tensor:  # [S, B, hidden], after the final norm
        block = self.config.block_size
        layers = self.config.layers
        num_seqs = seq_indptr.shape[0] - 1
        lengths = seq_indptr[1:] - seq_indptr[:-1]  # context + block
        offsets = torch.arange(block, device=seq_cells.device)
        rope_positions = ((lengths - block)[:, None] + offsets[None, :]).reshape(-1)
        # Non-causal inside the block: every block token sees all its sequence's cells, so it "sits" at the
        # block's last position for visibility (its rope position stays its own).
        visible_until = (lengths - 1)[:, None].expand(num_seqs, block).reshape(-1)
        token_seq = torch.arange(num_seqs, device=seq_cells.device)[:, None].expand(num_seqs, block).reshape(-1)
        write_cells = seq_cells[((seq_indptr[1:] - block)[:, None] + offsets[None, :]).reshape(-1)]
        attend = StepAttention(attention, layers.num_heads, layers.num_kv_heads, visible_until, token_seq,
                               seq_indptr, seq_cells)
        cos, sin = self.rope(rope_positions)
        x = embeddings
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools):
            x = layer(x, cos, sin, write_cells, attend, k_pool, v_pool)
        return self.norm(x).reshape(num_seqs, block, -1)


class DraftContextMethod(nn.Module):
    """The artifact's `draft_context` method: taps, positions, cells and the draft pools -> nothing (in place)."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.draft = getattr(target, DRAFT_ATTRIBUTE)  # same attribute name: weight names match the target's

    def forward(self, taps, positions, write_cells, k_pools, v_pools) -> torch.Tensor:
        self.draft.write_context(taps, positions, write_cells, k_pools, v_pools)
        # AOTInductor needs an output: a tiny fresh one (not a view of an input); the pools are the real result.
        return write_cells[:1].clone()


class DraftBlockMethod(nn.Module):
    """The artifact's `draft_S` methods: each sequence's newest token -> argmax drafts [S, block_size - 1].

    Holds the target's embedding and LM head under their own names, so the artifact stores them once.
    """

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.draft = getattr(target, DRAFT_ATTRIBUTE)
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head
        self.attention = target.attention

    def forward(self, last_tokens, seq_indptr, seq_cells, k_pools, v_pools) -> torch.Tensor:
        cfg = self.draft.config
        num_seqs = last_tokens.shape[0]
        masks = torch.full((num_seqs, cfg.block_size - 1), cfg.mask_token_id, dtype=last_tokens.dtype,
                           device=last_tokens.device)
        tokens = torch.cat((last_tokens[:, None], masks), dim=1).reshape(-1)
        embeddings = self.embed_tokens(tokens)
        if cfg.input_embedding_scale != 1.0:
            embeddings = embeddings * cfg.input_embedding_scale
        hidden = self.draft.draft_hidden(embeddings, seq_indptr, seq_cells, k_pools, v_pools, self.attention)
        hidden = hidden[:, 1:].reshape(num_seqs * (cfg.block_size - 1), -1)
        # The target's head, without the target's final norm: the draft applied its own.
        logits = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return logits.argmax(dim=-1).reshape(num_seqs, cfg.block_size - 1)


# -- loading a published checkpoint -------------------------------------------------------------------------


def load_draft(path: str | Path, target: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> DFlashDraft:
    """Load and check a DFlash draft directory against its target; weights in `dtype` on `device`."""
    root = Path(path)
    if not root.is_dir():
        raise Pt2ServeError(f"draft directory {root} does not exist (or is not a directory)")
    cfg = read_dflash_config(root / "config.json")
    check_against_target(cfg, target, str(root / "config.json"))
    with torch.device("meta"):
        draft = DFlashDraft(cfg)
    draft = draft.to(dtype).to_empty(device=device)
    _load_draft_weights(draft, _weight_files(root))
    draft.inv_freq = rope_inv_freq(cfg.layers.head_dim, cfg.layers.rope_theta, cfg.layers.rope_scaling).to(device)
    return draft.eval()


def attach_draft(model: nn.Module, path: str | Path) -> DFlashDraft:
    """Load the draft at `path` for `model` (a Transformer) and make the model tap the layers it reads."""
    weight = model.norm.weight
    draft = load_draft(path, model.config, weight.dtype, weight.device)
    setattr(model, DRAFT_ATTRIBUTE, draft)
    model.tap_layers = draft.config.target_layer_ids
    return draft


def _weight_files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise Pt2ServeError(f"{root} has no *.safetensors file: a DFlash draft needs its weights")
    return files


def _draft_layout(draft: DFlashDraft) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Checkpoint tensor name -> (our parameter, first row, shape), for every tensor the draft needs."""
    stacked = stacked_projections(draft.config.layers)
    layout = {}
    for name, param in draft.named_parameters():
        match = re.fullmatch(r"(layers\.\d+)\.(.+)\.(weight|bias)", name)
        if match is None or match[2] not in stacked:
            layout[name] = (name, 0, tuple(param.shape))
            continue
        layer, projection, kind = match.groups()
        start = 0
        for part, rows in stacked[projection]:
            layout[f"{layer}.{part}.{kind}"] = (name, start, (rows, *param.shape[1:]))
            start += rows
    return layout


@torch.no_grad()
def _load_draft_weights(draft: DFlashDraft, files: list[Path]) -> None:
    params = dict(draft.named_parameters())
    layout = _draft_layout(draft)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                name = key.removeprefix("model.")
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # computed from config.json
                if name not in layout:
                    raise Pt2ServeError(f"{file}: unexpected tensor {key!r}: the DFlash draft described by "
                                        "config.json has no such weight (embeddings and LM head come from the target)")
                target, start, shape = layout[name]
                found = list(reader.get_slice(key).get_shape())
                if found != list(shape):
                    raise Pt2ServeError(f"{file}: tensor {key!r} has shape {found}, expected {list(shape)} from "
                                        "config.json (does the draft's config match its weights?)")
                params[target].narrow(0, start, shape[0]).copy_(reader.get_tensor(key))
                loaded.add(name)
    missing = sorted(set(layout) - loaded)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise Pt2ServeError(f"tensor {missing[0]!r}{more} needed by the DFlash draft is missing from "
                            f"{', '.join(str(f) for f in files)}")


# -- a random draft of the published layout (tests and benchmarks; no download) -----------------------------


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: layers spread evenly from the second to the fourth from last."""
    start, end = min(1, num_target_layers - 1), max(1, num_target_layers - 3)
    if num_draft_layers == 1:
        return [start]
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def write_random_draft(
    directory: str | Path,
    target: ModelConfig,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a DFlash draft checkpoint for `target` with random weights, in the published layout.

    `overrides` replace config.json fields (e.g. hidden_size, to make a draft that does not fit).
    """
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    ids = target_layer_ids if target_layer_ids is not None else default_target_layer_ids(target.num_layers, num_layers)
    hf: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": target.vocab_size - 1 if mask_token_id is None else mask_token_id,
                          "target_layer_ids": ids},
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_target_layers": target.num_layers,
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "vocab_size": target.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    if target.rope_scaling is not None:
        hf["rope_scaling"] = target.rope_scaling.to_hf()
    hf.update(overrides)
    (root / "config.json").write_text(json.dumps(hf, indent=1))
    hidden, heads, kv_heads = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim, inner = hf["head_dim"], hf["intermediate_size"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    tensors = {"fc.weight": normal(hidden, len(ids) * target.hidden_size), "hidden_norm.weight": torch.ones(hidden),
               "norm.weight": torch.ones(hidden)}
    for layer in range(hf["num_hidden_layers"]):
        prefix = f"layers.{layer}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            prefix + "self_attn.q_norm.weight": torch.ones(head_dim),
            prefix + "self_attn.k_norm.weight": torch.ones(head_dim),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden),
            prefix + "mlp.up_proj.weight": normal(inner, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, inner),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, str(root / "model.safetensors"))
    return root
