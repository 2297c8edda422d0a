"""How a request's choices are written out: the endpoint's format, echo, logprobs, token ids and tool calls,
for a whole response and chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pt2serve.runtime.events import StreamEvent
from pt2serve.runtime.logprobs import TokenLogprob
from pt2serve.serve.generation import Generation
from pt2serve.serve.logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from pt2serve.serve.openai_format import ChatFormat, Choice, CompletionFormat
from pt2serve.serve.tool_calls import ToolCallStream, ToolUse


@dataclass
class Rendering:
    """One request's rendering; streams keep per-choice state, so one instance serves one response."""

    fmt: ChatFormat | CompletionFormat
    texts: TokenTexts
    prompts: list[list[int]]
    echoed: list[str] | None  # per prompt, when echo was asked for
    logprobs: bool
    token_ids: bool
    tool_use: ToolUse | None = None
    # Per streamed choice that may call tools: its text so far, held back from where a call may begin.
    streams: dict[int, ToolCallStream] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return isinstance(self.fmt, ChatFormat)

    def choice(self, index: int, generation: Generation, reason: str) -> Choice:
        text = generation.text
        logprobs = None
        if self.echoed is not None:
            text = self.echoed[generation.prompt_index] + text
        if self.logprobs:
            logprobs = self.logprobs_of(generation, generation.logprobs, generation.token_ids, echo=True)
        calls = None
        if self.tool_use is not None:
            text, found = self.tool_use.parse(text)
            if found:
                calls, reason = [call.body() for call in found], "tool_calls"
        return Choice(index, text, reason, list(generation.token_ids) if self.token_ids else None, logprobs, calls)

    def logprobs_of(self, generation: Generation, entries: list[TokenLogprob], tokens: list[int],
                    echo: bool, text_offset: int = 0) -> dict[str, Any]:
        """`entries` (of `tokens`) in the endpoint's shape; with `echo`, after the prompt's when it was scored."""
        if self.chat:
            return chat_logprobs(self.texts, entries)
        scored = (generation.shares_prompt_of or generation).prompt_logprobs
        if echo and scored is not None:
            prompt = self.prompts[generation.prompt_index]
            return completion_logprobs(self.texts, [None, *scored, *entries],
                                       [*prompt, *tokens], text_offset)
        return completion_logprobs(self.texts, list(entries), list(tokens), text_offset)

    def stream_chunks(self, index: int, generation: Generation, event: StreamEvent, first: bool,
                      include_usage: bool, text_offset: int) -> tuple[list[dict[str, Any]], int]:
        """The chunks one token event adds (on a choice's first, the echoed prompt before it), and where the
        choice's text goes on after them."""
        chunks = []
        if first and self.echoed is not None:
            echoed = self.echoed[generation.prompt_index]
            logprobs = self.logprobs_of(generation, [], [], echo=True) if self.logprobs else None
            chunks.append(self.fmt.chunk(index, echoed, True, include_usage, logprobs))
            first, text_offset = False, len(echoed)
        logprobs = None
        if self.logprobs and event.logprob is not None:
            logprobs = self.logprobs_of(generation, [event.logprob], [event.token_id], False, text_offset)
        text = event.text
        if self.tool_use is not None:  # text from where a call may begin waits for finish_chunks
            text = self.streams.setdefault(index, self.tool_use.stream()).feed(text)
        chunks.append(self.fmt.chunk(index, text, first, include_usage, logprobs))
        return chunks, text_offset + len(text)

    def finish_chunks(self, index: int, reason: str, include_usage: bool) -> list[dict[str, Any]]:
        """A finished choice's last chunks: with tools, the text held back or the calls it made, then the
        finish reason."""
        chunks = []
        stream = self.streams.pop(index, None)
        if stream is not None:
            rest, calls = stream.finish(self.tool_use)
            if rest:
                chunks.append(self.fmt.chunk(index, rest, False, include_usage))
            if calls:
                chunks.append(self.fmt.tool_calls_chunk(index, [c.body(i) for i, c in enumerate(calls)],
                                                        include_usage))
                reason = "tool_calls"
        chunks.append(self.fmt.finish_chunk(index, reason, include_usage))
        return chunks
