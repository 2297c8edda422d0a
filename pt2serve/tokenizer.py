"""Text <-> token ids, chat templates and streaming detokenization.

Shared by the exporter (which stores the checkpoint's tokenizer files in the artifact) and the runtime
(which rebuilds the tokenizer from them), so it depends on neither.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from pt2serve.errors import Pt2ServeError

# Used when a checkpoint ships no chat template: one "role: content" line per message.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (byte_fallback)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, in which byte-level vocabularies spell tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_BYTE_OF_CHAR = {char: byte for byte, char in byte_level_alphabet().items()}


@dataclass(frozen=True)
class TokenizerFiles:
    """What an artifact stores about its tokenizer: tokenizer.json text plus the special ids and template."""

    tokenizer_json: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token/eos_token text, for templates

    def to_dict(self) -> dict[str, Any]:
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
            "special_tokens": dict(self.special_tokens),
        }

    @classmethod
    def from_dict(cls, tokenizer_json: str, data: dict[str, Any]) -> "TokenizerFiles":
        return cls(
            tokenizer_json=tokenizer_json,
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=tuple(data.get("eos_token_ids") or ()),
            chat_template=data.get("chat_template"),
            special_tokens=dict(data.get("special_tokens") or {}),
        )


class Tokenizer:
    def __init__(self, files: TokenizerFiles) -> None:
        self.files = files
        try:
            self._tok = HFTokenizer.from_str(files.tokenizer_json)
        except Exception as err:  # the tokenizers library raises a bare Exception on bad JSON
            raise Pt2ServeError(f"tokenizer.json could not be parsed: {err}") from None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = _tojson
        self._chat = env.from_string(files.chat_template or PLAIN_CHAT_TEMPLATE)
        self._byte_level = _decodes_byte_level(self._tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.files.eos_token_ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.files.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (what logprobs name a token by)."""
        return self._tok.decode([token], skip_special_tokens=False)

    def token_piece(self, token: int) -> str | None:
        """The token as the vocabulary spells it (a byte-level vocabulary's "Ġhi" for " hi")."""
        return self._tok.id_to_token(token)

    def token_bytes(self, token: int) -> bytes | None:
        """One token's own bytes. A token that holds part of a UTF-8 character decodes alone to U+FFFD; its
        bytes come from the vocabulary then (byte-level BPE, SentencePiece byte fallback), None where the
        vocabulary does not tell."""
        text = self.token_text(token)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token) or ""
        byte = _BYTE_FALLBACK_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte[1], 16)])
        if self._byte_level and piece and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat (and the tools it may call); the template adds bos itself when it wants one."""
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self._chat.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra,
                                     **self.files.special_tokens)
        except jinja2.TemplateError as err:
            raise Pt2ServeError(f"chat template failed: {err}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, add_bos: bool | None = None) -> list[int]:
        """The chat's prompt ids; `add_bos` None adds bos as the chat endpoint does."""
        # As transformers' apply_chat_template: a checkpoint's template writes every special token the
        # model wants (a ChatML template on a tokenizer with a bos gets none); the plain fallback writes
        # none, so the prompt starts with bos as encoded text does.
        if add_bos is None:
            add_bos = self.files.chat_template is None
        return self.encode(self.render_chat(messages, tools, add_generation_prompt), add_bos=add_bos)

    @property
    def chat_template(self) -> str:
        """The template chats are rendered with: the checkpoint's, or the plain fallback."""
        return self.files.chat_template or PLAIN_CHAT_TEMPLATE


def _decodes_byte_level(tok: HFTokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level (alone or in a sequence): its pieces spell bytes."""
    if tok.decoder is None:
        return False
    decoder = json.loads(tok.decoder.__getstate__())
    return any(d.get("type") == "ByteLevel" for d in [decoder, *decoder.get("decoders", [])])


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """As transformers renders chat templates: plain JSON (jinja's own tojson escapes <, > and & for HTML,
    which would change the prompt a model was trained on)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Only a short window is decoded per token (the tokens since the last emitted text, plus the ones before
    them that give it context), so streaming costs O(1) per token rather than re-decoding everything.
    When no token follows, `flush()` gives what is held back, so the deltas always join to the decode of
    all the ids.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are already emitted as text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before, after = self._window()
        # A replacement character at the end means a multi-byte character is still incomplete.
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        return self._emit(after[len(before):])

    def flush(self) -> str:
        """The text held back, decoded as it stands (an incomplete character becomes U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        before, after = self._window()
        return self._emit(after[len(before):])

    def _window(self) -> tuple[str, str]:
        """The window's text without and with the tokens not yet emitted."""
        window = self._ids[self._prefix_offset:]
        emitted = self._read_offset - self._prefix_offset
        return self._tokenizer.decode(window[:emitted]), self._tokenizer.decode(window)

    def _emit(self, delta: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta


def read_tokenizer_config(text: str, source: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise Pt2ServeError(f"{source} is not valid JSON: {err}") from None
