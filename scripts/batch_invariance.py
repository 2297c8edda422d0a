#!/usr/bin/env python3
"""Which ways of cutting a step change one sequence's logits, bit for bit? (what --deterministic exports fix)

    python scripts/batch_invariance.py ARTIFACT [--seed 0]

One sequence's row is computed many ways (pt2serve/bench/invariance.py): a decode alone at each static width,
beside other decodes (before and after it), through forward_others with and without company; its prompt
prefilled whole, in chunks, or with all but its last token computed earlier (what a prefix-cache hit does),
that last token then run as a decode at each width. Every way is compared with the first and the second way
of its table; last, whether the K/V cells a prompt's prefill writes are the same bits however it was chunked.
An artifact exported with --deterministic should print True everywhere.
"""

from __future__ import annotations

import argparse

import torch

from pt2serve.bench.invariance import PoolRuns, decode, prompt_chunk, table

PROMPT_TOKENS = 41  # the sequence's prompt: cells 1..41


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = PoolRuns(args.artifact, args.seed)
    widths = runs.artifact.metadata.forward_sizes
    target = decode(1, PROMPT_TOKENS - 1, 7)  # reads cells 1..40 of random context
    rows: dict[str, torch.Tensor] = {}
    for width in widths:
        rows[f"decode alone, forward_{width}"] = runs.logits([target], width)[0]
        if width > 1:
            rows[f"decode first of {width}, forward_{width}"] = runs.logits([target, *runs.others(width - 1)], width)[0]
            rows[f"decode last of {width}, forward_{width}"] = runs.logits([*runs.others(width - 1), target], width)[-1]
    rows["decode alone, forward_others"] = runs.logits([target], None)[0]
    rows["decode first of 4, forward_others"] = runs.logits([target, *runs.others(3)], None)[0]

    prompt = runs.random_tokens(PROMPT_TOKENS)
    prompts, written = {}, {}
    for name, cuts in (("whole", [PROMPT_TOKENS]), ("17 + 24", [17, 24]), ("40 + 1 (a cached prefix)", [40, 1])):
        prompts[f"prompt {name}"], written[name] = runs.prefill(prompt, cuts)
    _, prefix = runs.prefill(prompt[:-1], [PROMPT_TOKENS - 1])
    last = decode(1, PROMPT_TOKENS - 1, prompt[-1])
    for width in widths:
        prompts[f"last token as a decode, forward_{width}"] = runs.logits([last], width, prefix.clone())[0]

    print(table("a decode at position 40", rows))
    print(table("the logits after a 41-token prompt", prompts))
    whole = runs.cells_of(written["whole"], PROMPT_TOKENS)
    for name, state in written.items():
        same = all(torch.equal(a, b) for a, b in zip(whole, runs.cells_of(state, PROMPT_TOKENS)))
        print(f"the prompt's K/V cells, prefilled {name}: {'the same bits' if same else 'different'} as whole")


if __name__ == "__main__":
    main()
