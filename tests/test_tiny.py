"""The trained `tiny` preset (scripts/train_tiny.py): its files load into its config, and its greedy
continuation on the eager model reads as English, in words of the plays it was trained on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pt2serve.model.eager import greedy_generate
from pt2serve.model.presets import build_preset_model, get_preset
from pt2serve.tokenizer import Tokenizer

PLAYS = Path(__file__).resolve().parents[1] / "data" / "shakespeare"
PROMPT = "Hello, pt2serve!"  # the quickstart's
WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(get_preset("tiny").tokenizer)


def test_the_tokenizer_fits_the_model_and_round_trips_text(tokenizer):
    assert tokenizer.vocab_size == get_preset("tiny").config.vocab_size
    text = "O Romeo, Romeo! wherefore art thou Romeo? ✓ pt2serve\n\ttabs"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.files.bos_token_id
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2  # words of the plays take few tokens


def test_greedy_continuation_reads_as_english(tokenizer):
    model = build_preset_model("tiny", torch.float32).eval()
    text = tokenizer.decode(greedy_generate(model, tokenizer.encode(PROMPT), 48))
    known = set(WORD.findall("\n".join(path.read_text() for path in PLAYS.glob("*.txt")).lower()))
    words = WORD.findall(text.lower())
    letters_and_spaces = sum(char.isalpha() or char.isspace() for char in text)
    assert letters_and_spaces >= 0.75 * len(text), text
    assert len(words) >= 12, text
    assert sum(word in known for word in words) >= 0.9 * len(words), text
    assert len(set(words) & known) >= 5, text  # several different words, not one repeated
