"""Structured output: grammars compiled against the artifact's tokenizer, and the token masks they allow.

The grammar library is xgrammar, chosen by measurement (scripts/grammar_bench.py; 32,000-token byte-level
vocabulary, a tool-call JSON schema, this 2-core CPU): filling one next-token mask takes 3.5 µs on average
(p99 47 µs) against llguidance's 31 µs (p99 425 µs) and outlines-core's 7.6 µs with 180 µs per accepted
token and 58 ms to compile the schema (xgrammar: 3.6 ms). It is an optional dependency
(pip install 'pt2serve[structured]'): requests that need it are refused with that message without it.

How a constrained request runs (runner.py, executor.py): its grammar is compiled when it is submitted (a bad
schema is the caller's error, at once); the runner keeps its matcher and feeds it every committed token.
A step that samples a constrained row runs its forward at once, then the runner reads the previous step's
ids (they come back while this forward runs), advances the matchers, fills one bitmask row per constrained
row into pinned memory and only then queues the masked sampling: the host's mask work overlaps the
forward, and the mask reaches the device by a non-blocking copy.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pt2serve.errors import Pt2ServeError

if TYPE_CHECKING:
    from pt2serve.tokenizer import Tokenizer

INSTALL_HINT = "structured output needs xgrammar: pip install 'pt2serve[structured]'"
BITS = 32  # tokens per bitmask word (int32)


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match."""

    kind: str  # "json" (any JSON object), "json_schema", "regex" or "ebnf" (xgrammar's GBNF dialect)
    source: str = ""  # the schema as JSON text, the regex, or the grammar

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_schema", "regex", "ebnf"):
            raise ValueError(f"unknown grammar kind {self.kind!r}")


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer (thread-safe; built on first use, which costs about a second)."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._no_control_bytes: torch.Tensor | None = None  # [words] int32, set with the compiler
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer | None, vocab_size: int) -> GrammarCompiler:
        """The compiler for an artifact's tokenizer (None: one that refuses every grammar with a message)."""
        if tokenizer is None:
            return cls(None, vocab_size, ())
        return cls(tokenizer.files.tokenizer_json, vocab_size, tokenizer.eos_token_ids)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (shared by every matcher of it); Pt2ServeError for a bad one."""
        compiler = self._get()
        try:
            # JSON without free whitespace: a model cannot wander off into spaces and newlines.
            if spec.kind == "json":
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "json_schema":
                grammar = compiler.compile_json_schema(spec.source, any_whitespace=False)
            elif spec.kind == "regex":
                grammar = compiler.compile_regex(spec.source)
            else:
                grammar = compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's errors for bad input
            raise Pt2ServeError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {_first_line(err)}") from None
        # xgrammar's JSON strings admit raw control characters, which JSON forbids (they must be escaped) and
        # strict parsers refuse; compact JSON has none anywhere, so tokens holding one are banned outright.
        return CompiledGrammar(grammar, self._no_control_bytes if spec.kind.startswith("json") else None, spec)

    def _get(self):
        if self._tokenizer_json is None:
            raise Pt2ServeError("structured output needs the model's tokenizer, and this artifact has none")
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise Pt2ServeError(INSTALL_HINT) from None
                info = self._tokenizer_info(xgr)
                self._no_control_bytes = _allowed_tokens(
                    [not any(b < 0x20 for b in token) for token in info.decoded_vocab], self._vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def _tokenizer_info(self, xgr):
        """xgrammar's view of the tokenizer, from tokenizer.json alone (no transformers tokenizer object)."""
        from tokenizers import Tokenizer as HFTokenizer

        vocab = HFTokenizer.from_str(self._tokenizer_json).get_vocab(with_added_tokens=True)
        encoded = [""] * self._vocab_size  # ids the model has but the tokenizer never produces stay empty
        for text, token in vocab.items():
            if token < self._vocab_size:
                encoded[token] = text
        detected = xgr.TokenizerInfo._detect_metadata_from_hf(self._tokenizer_json)
        return xgr.TokenizerInfo(encoded, detected["vocab_type"], vocab_size=self._vocab_size,
                                 stop_token_ids=self._stop_token_ids, add_prefix_space=detected["add_prefix_space"])


@dataclass(frozen=True)
class CompiledGrammar:
    grammar: Any  # xgrammar's CompiledGrammar
    allowed: torch.Tensor | None  # [words] int32: tokens it may ever use (None: all), ANDed into each mask
    spec: GrammarSpec  # what it was compiled from (an engine in another process compiles it again)


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self._allowed = compiled.allowed

    def accept_token(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """The tokens it allows next, as bits of bitmask[row] (left all-allowed once it has terminated: the
        request ends there and the row's sample is dropped)."""
        if self._matcher.is_terminated():
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._allowed is not None:
            bitmask[row] &= self._allowed


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def _allowed_tokens(allowed: list[bool], vocab_size: int) -> torch.Tensor:
    """Per-token flags as one bitmask row (bit t % 32 of word t // 32), as xgrammar lays masks out."""
    bits = torch.zeros(bitmask_words(vocab_size) * BITS, dtype=torch.int64)
    bits[: len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    words = (bits.view(-1, BITS) << torch.arange(BITS)).sum(dim=1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # as two's complement int32


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens' logits -> -inf, in place, on the logits' device ([R, V] and [R, words] int32)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as err:
            raise Pt2ServeError(f"{param} is not valid JSON: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise Pt2ServeError(f"{param} must be a JSON schema (an object)")
    return json.dumps(schema)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
