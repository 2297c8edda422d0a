"""Train the `tiny` preset: a byte-level BPE tokenizer and the Llama of CONFIGS["tiny"] on the twelve
Shakespeare plays in data/shakespeare/ (public domain; its README says where they come from), written to
pt2serve/model/trained/tiny/ (tokenizer.json and model.safetensors, in bf16), which the preset loads.

    PYTHONPATH=$PWD python scripts/train_tiny.py          # seed 20261130 (presets.SEED), 800 steps

The committed files are this command's output (torch 2.13 CPU: 7.7 minutes of one core on a busy 2-core
machine; held-out loss 1.93 bits a character). A run is a function of the seed, the text and the torch build:
one thread, so every sum is taken in the same order (and on a shared 2-core machine two threads mostly wait
for each other). It ends with the held-out loss and the greedy continuation of the quickstart's prompt.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pt2serve.model.eager import EagerSequence, greedy_generate
from pt2serve.model.model import Transformer, apply_rope
from pt2serve.model.presets import BOS_TEXT, CONFIGS, EOS_TEXT, SEED, TRAINED_DIR

TEXT_DIR = Path(__file__).resolve().parents[1] / "data" / "shakespeare"
CONTEXT = 256  # tokens a training row sees, bos first (about 700 characters)
BATCH = 16
PEAK_LR = 3e-3
WARMUP_STEPS = 80
HELD_OUT = 0.05  # the last 5% of the tokens: never trained on, only scored


def read_plays() -> str:
    return "\n\n\n".join(path.read_text() for path in sorted(TEXT_DIR.glob("*.txt")))


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE: every byte is a token, so any text encodes; bos and eos take the last ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.add_special_tokens([BOS_TEXT, EOS_TEXT])
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    return tokenizer


def init_weights(model: Transformer, generator: torch.Generator) -> None:
    """GPT-2's: N(0, 0.02), the projections that write into the residual stream scaled by 1/sqrt(2 layers)."""
    residual_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                param.normal_(0.0, std, generator=generator)


def causal_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] tokens -> [B, T, vocab] logits: the model's own weights and math, batched with causal attention
    instead of the serving forward's cell pools (the check in main() compares the two)."""
    batch, length = tokens.shape
    freqs = torch.arange(length)[:, None].float() * model.inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()  # [T, D]: broadcast over batch and heads by apply_rope
    x = model.embed_tokens(tokens)
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = F.linear(layer.input_layernorm(x), attn.qkv_proj.weight).split(
            (attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
        q = apply_rope(q.reshape(batch, length, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(k.reshape(batch, length, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = v.reshape(batch, length, attn.num_kv_heads, attn.head_dim)
        group = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + F.linear(out.transpose(1, 2).reshape(batch, length, -1), attn.o_proj.weight)
        gate, up = F.linear(layer.post_attention_layernorm(x), layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    return F.linear(model.norm(x), model.embed_tokens.weight)  # tied head


def rows(ids: torch.Tensor, starts: torch.Tensor, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [B, CONTEXT] (bos, then CONTEXT - 1 tokens from each start) and their targets [B, CONTEXT].

    Every row starts with bos as every prompt does (the tokenizer adds it), so the model learns to continue
    text that starts anywhere after it."""
    window = torch.stack([ids[start:start + CONTEXT] for start in starts.tolist()])
    inputs = torch.cat((torch.full((len(starts), 1), bos), window[:, :-1]), dim=1)
    return inputs, window


def learning_rate(step: int, num_steps: int) -> float:
    """Linear warmup, then a cosine down to a tenth of the peak."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, num_steps - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: Transformer, ids: torch.Tensor, bos: int, num_steps: int, generator: torch.Generator) -> None:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    norms = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": norms, "weight_decay": 0.0}],
                                  lr=PEAK_LR, betas=(0.9, 0.95))
    start = time.monotonic()
    for step in range(num_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, num_steps)
        inputs, targets = rows(ids, torch.randint(0, len(ids) - CONTEXT, (BATCH,), generator=generator), bos)
        loss = F.cross_entropy(causal_logits(model, inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == num_steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.monotonic() - start:.0f} s", flush=True)


@torch.no_grad()
def held_out_loss(model: Transformer, ids: torch.Tensor, bos: int) -> float:
    """Mean next-token loss (nats) over consecutive rows of the held-out tokens."""
    starts = torch.arange(0, len(ids) - CONTEXT, CONTEXT)
    inputs, targets = rows(ids, starts, bos)
    return F.cross_entropy(causal_logits(model, inputs).flatten(0, 1), targets.flatten()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=TRAINED_DIR / "tiny",
                        help="folder for tokenizer.json and model.safetensors")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = CONFIGS["tiny"]

    text = read_plays()
    tokenizer = train_tokenizer(text, cfg.vocab_size)
    bos = tokenizer.token_to_id(BOS_TEXT)
    ids = torch.tensor(tokenizer.encode(text).ids)
    num_train = int(len(ids) * (1 - HELD_OUT))
    print(f"{len(text):,} characters, {len(ids):,} tokens ({len(text) / len(ids):.2f} characters a token)")

    generator = torch.Generator().manual_seed(args.seed)
    model = Transformer(cfg)
    init_weights(model, generator)
    print(f"{sum(p.numel() for p in model.parameters()):,} weights")
    train(model, ids[:num_train], bos, args.steps, generator)

    # Stored in bf16, and scored as stored: the fp32 CPU export and a bf16 GPU export then hold the same values.
    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16())
    loss = held_out_loss(model, ids[num_train:], bos)
    print(f"held-out loss {loss:.3f} nats a token, {loss * len(ids) / len(text) / math.log(2):.2f} bits a character")

    # The serving forward (cell pools, the eager reference of every export) reads the weights as training did.
    prompt = [bos, *tokenizer.encode("Hello, pt2serve!").ids]
    served = EagerSequence(model, len(prompt)).extend(prompt)
    torch.testing.assert_close(served, causal_logits(model, torch.tensor([prompt]))[0], atol=1e-4, rtol=1e-4)
    print("greedy:", repr(tokenizer.decode(greedy_generate(model, prompt, 40))))

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    save_file({name: value.bfloat16().contiguous() for name, value in model.state_dict().items()},
              str(args.out / "model.safetensors"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
