"""Log probabilities in OpenAI's two shapes: the legacy completions object and chat's `content` list.

    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
                  "text_offset": [...]}   (an echoed prompt's first token has None for both logprobs)
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token's text is its own decode (special tokens included); a model without a tokenizer names tokens
"token_id:N".
"""

from __future__ import annotations

from typing import Any

from pt2serve.runtime.logprobs import TokenLogprob
from pt2serve.tokenizer import Tokenizer


class TokenTexts:
    """Each token's text, cached (one request decodes the same few tokens many times)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._tokenizer.token_text(token) if self._tokenizer is not None else f"token_id:{token}"
            self._cache[token] = text
        return text


def completion_logprobs(texts: TokenTexts, entries: list[TokenLogprob | None], tokens: list[int],
                        text_offset: int = 0) -> dict[str, Any]:
    """The completions object for `tokens`, each scored by its entry (None: the unscored first prompt token)."""
    strings, values, tops, offsets = [], [], [], []
    for token, entry in zip(tokens, entries):
        text = texts(token)
        strings.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        # The chosen token is listed beside the alternatives, as OpenAI does.
        top = {texts(t): v for t, v in entry.top}
        top.setdefault(texts(entry.token), entry.logprob)
        tops.append(top)
    return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {**_chat_token(texts, entry.token, entry.logprob),
         "top_logprobs": [_chat_token(texts, t, v) for t, v in entry.top]}
        for entry in entries
    ]}


def _chat_token(texts: TokenTexts, token: int, logprob: float) -> dict[str, Any]:
    text = texts(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
