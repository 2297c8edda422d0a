"""Grammar libraries for structured output, measured on this machine: llguidance, xgrammar, outlines-core.

For a byte-level BPE vocabulary trained here (no download) and a JSON schema of the kind tool calls use, each
library compiles the schema, then walks a valid JSON document token by token: fill the next-token mask, then
accept the token. Prints one row per library: compile ms, mean and p99 mask µs per token, accept µs per token.

    .venv/bin/python scripts/grammar_bench.py [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search", "book_flight"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "get_weather", "arguments": {"city": "San Francisco", "days": 3, "units": "metric",
                                                           "tags": ["outdoor", "weekend trip"]}})


def train_tokenizer(vocab_size: int) -> Tokenizer:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 12))) for _ in range(60000)]
    texts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(20000)]
    texts += [json.dumps({rng.choice(words): [rng.randint(0, 99999), rng.choice(words)]}) for _ in range(20000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def time_walk(fill, accept, tokens: list[int]) -> tuple[list[float], list[float]]:
    masks, accepts = [], []
    for token in tokens:
        started = time.perf_counter()
        fill()
        masks.append(time.perf_counter() - started)
        started = time.perf_counter()
        accept(token)
        accepts.append(time.perf_counter() - started)
    return masks, accepts


def bench_llguidance(tokenizer: Tokenizer, eos: int, tokens: list[int]):
    import llguidance
    import llguidance.torch

    lltok = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=eos)
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    masks, accepts = time_walk(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
                               lambda t: matcher.consume_token(t), tokens)
    assert not matcher.is_error(), matcher.get_error()
    return compile_s, masks, accepts


def bench_xgrammar(tokenizer: Tokenizer, eos: int, tokens: list[int]):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.get_vocab_size())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    masks, accepts = time_walk(lambda: matcher.fill_next_token_bitmask(bitmask, 0),
                               lambda t: matcher.accept_token(t), tokens)
    return compile_s, masks, accepts


def bench_outlines(tokenizer: Tokenizer, eos: int, tokens: list[int]):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab = {}
    for text, token in tokenizer.get_vocab().items():
        if token != eos:  # byte-level token text -> the bytes it stands for
            vocab.setdefault(bytes(byte_of[c] for c in text), []).append(token)
    started = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, vocab))
    guide = Guide(index)
    compile_s = time.perf_counter() - started
    words = (tokenizer.get_vocab_size() + 31) // 32
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    masks, accepts = time_walk(lambda: guide.write_mask_into(bitmask.data_ptr(), words, 4),
                               lambda t: guide.advance(t), tokens)
    return compile_s, masks, accepts


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    tokenizer = train_tokenizer(args.vocab)
    eos = tokenizer.token_to_id("<|eos|>")
    tokens = tokenizer.encode(DOCUMENT).ids
    print(f"vocabulary {tokenizer.get_vocab_size()} tokens; document {len(tokens)} tokens; torch {torch.__version__}")
    print(f"{'library':<14}{'compile ms':>12}{'mask µs mean':>14}{'mask µs p99':>13}{'accept µs':>11}")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                        ("outlines-core", bench_outlines)):
        try:
            compile_s, masks, accepts = bench(tokenizer, eos, tokens)
        except Exception as err:  # one library failing must not hide the others' numbers
            print(f"{name:<14} failed: {type(err).__name__}: {err}")
            continue
        p99 = float(np.percentile(masks, 99))
        print(f"{name:<14}{compile_s * 1e3:>12.1f}{statistics.mean(masks) * 1e6:>14.1f}{p99 * 1e6:>13.1f}"
              f"{statistics.mean(accepts) * 1e6:>11.1f}")


if __name__ == "__main__":
    main()
