"""Log probabilities in OpenAI's two shapes: the legacy completions object and chat's `content` list.

    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
                  "text_offset": [...]}   (an echoed prompt's first token has None for both logprobs)
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token is named by its own decode (special tokens included), and distinct tokens never share a name:
a token that holds part of a UTF-8 character (alone it decodes to U+FFFD) is named by its bytes, as
"bytes:\\xe2\\x80" (OpenAI's form), and a completions alternative whose name another token of its position
already has goes by "token_id:N". With `return_tokens_as_token_ids` (vLLM's extension), and for a model
without a tokenizer, every token is "token_id:N". Chat's `bytes` are the token's own bytes.
"""

from __future__ import annotations

from typing import Any

from pt2serve.runtime.logprobs import TokenLogprob
from pt2serve.tokenizer import Tokenizer


class TokenTexts:
    """Each token's name, text and bytes, cached (one request renders the same few tokens many times)."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_ids or tokenizer is None
        self._cache: dict[int, tuple[str, str, list[int] | None]] = {}

    def __call__(self, token: int) -> str:
        """The name the token goes by in logprobs."""
        return self._entry(token)[0]

    def text(self, token: int) -> str:
        """What the token adds to the text on its own ("" without a tokenizer): where text_offset moves."""
        return self._entry(token)[1]

    def bytes(self, token: int) -> list[int] | None:
        return self._entry(token)[2]

    def _entry(self, token: int) -> tuple[str, str, list[int] | None]:
        entry = self._cache.get(token)
        if entry is None:
            entry = self._cache[token] = self._describe(token)
        return entry

    def _describe(self, token: int) -> tuple[str, str, list[int] | None]:
        if self._tokenizer is None:
            return f"token_id:{token}", "", None
        text = self._tokenizer.token_text(token)
        raw = self._tokenizer.token_bytes(token)
        if self._as_ids:
            name = f"token_id:{token}"
        elif raw is not None and "\ufffd" in text and not _is_utf8(raw):
            name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            name = text
        return name, text, list(raw) if raw is not None else list(text.encode())


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def completion_logprobs(texts: TokenTexts, entries: list[TokenLogprob | None], tokens: list[int],
                        text_offset: int = 0) -> dict[str, Any]:
    """The completions object for `tokens`, each scored by its entry (None: the unscored first prompt token)."""
    strings, values, tops, offsets = [], [], [], []
    for token, entry in zip(tokens, entries):
        strings.append(texts(token))
        offsets.append(text_offset)
        text_offset += len(texts.text(token))
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        tops.append(_top_logprobs(texts, entry))
    return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_logprobs(texts: TokenTexts, entry: TokenLogprob) -> dict[str, float]:
    """The alternatives by name, best first, and the chosen token under the name `tokens` gives it (listed
    last when it is not among them, as OpenAI does). Keys are unique: an alternative whose name is taken
    goes by its id, so no token's value overwrites another's."""
    chosen = texts(entry.token)
    owners = {chosen: entry.token}
    top = {}
    for token, value in entry.top:
        name = texts(token)
        if owners.setdefault(name, token) != token:
            name = f"token_id:{token}"
        top[name] = value
    top.setdefault(chosen, entry.logprob)
    return top


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {**_chat_token(texts, entry.token, entry.logprob),
         "top_logprobs": [_chat_token(texts, t, v) for t, v in entry.top]}
        for entry in entries
    ]}


def _chat_token(texts: TokenTexts, token: int, logprob: float) -> dict[str, Any]:
    return {"token": texts(token), "logprob": logprob, "bytes": texts.bytes(token)}
