"""What rounding a preset's weights to int8 and int4 does to its next-token distributions, in eager PyTorch.

Usage: python scripts/quant_rounding.py PRESET [--tokens N]

The yardstick for `pt2serve bench --mode quality` on presets, whose random weights give nearly flat
distributions: the same comparison (top-1 agreement, mean KL(bf16-rounded float || quantized)) without any
compiled kernel, so a quantized artifact that lands far from these numbers points at its kernels. Runs in fp32
on the CPU with the weights rounded to bf16 first (the GPU exports quantize bf16 weights); one model at a time.
"""

from __future__ import annotations

import argparse
import gc

import torch

from pt2serve.model.eager import EagerSequence
from pt2serve.model.presets import build_preset_model
from pt2serve.model.quant import QuantScheme, quantize_model


def next_token_logits(preset: str, prompt: list[int], scheme: str | None) -> torch.Tensor:
    model = build_preset_model(preset, torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    if scheme is not None:
        quantize_model(model, QuantScheme.from_flags(scheme, None, lm_head=False, embedding=False))
    logits = EagerSequence(model, len(prompt)).extend(prompt).float()
    del model
    gc.collect()
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset")
    parser.add_argument("--tokens", type=int, default=48, help="prompt positions compared")
    args = parser.parse_args()
    prompt = torch.randint(0, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = next_token_logits(args.preset, prompt, None)
    log_p = reference.log_softmax(-1)
    print(f"{args.preset}: {args.tokens} positions; reference logits std {reference.std():.3f}, largest "
          f"probability {log_p.exp().max(-1).values.mean():.2e} on average")
    print("| format | top-1 agreement | mean KL | max KL | max abs dlogit |")
    print("|---|---:|---:|---:|---:|")
    for scheme in ("int8", "int4"):
        logits = next_token_logits(args.preset, prompt, scheme)
        kl = (log_p.exp() * (log_p - logits.log_softmax(-1))).sum(-1)
        top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        print(f"| {scheme} | {top1:.1%} | {kl.mean():.2e} | {kl.max():.2e} | {(logits - reference).abs().max():.2f} |")


if __name__ == "__main__":
    main()
