"""--workload chat: multi-turn conversations that all start with one shared system prompt.

Conversation c arrives as request c of the random workload would (on the stagger or Poisson schedule); its
turn k is sent as soon as turn k-1 has ended, as the whole conversation so far rendered by the chat
template: the system prompt, k+1 user messages of --prompt-tokens each, and the k replies between them as
the text they came back as (which may encode to other ids than the ones sampled). So every turn repeats
what came before it, and what the prefix cache reuses shows in the prompt tokens reused against computed.

Text is random words from a fixed list, sized in tokens with the artifact's tokenizer (without one, against
a server and no artifact given, one token per word). In process, an artifact without a tokenizer (the
benchmark presets) has conversations of token ids instead: the system prompt, then each turn's user ids and
reply ids appended as they were, with no template.

What is said, and when each conversation starts; the drivers (in_process.py, http_client.py) send it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from pt2serve.bench.options import RequestsOptions
from pt2serve.bench.request_timing import RequestTiming
from pt2serve.bench.workload import arrival_times
from pt2serve.tokenizer import Tokenizer

WORDS = (
    "time", "year", "people", "way", "day", "thing", "life", "child", "world", "school", "state", "family",
    "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program",
    "question", "work", "number", "night", "point", "home", "water", "room", "area", "money", "story", "fact",
    "month", "right", "study", "book", "word", "business", "issue", "side", "kind", "head", "house", "service",
    "friend", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "name", "team", "minute",
)


@dataclass(frozen=True)
class ChatScript:
    """What the clients say: one system prompt, and each conversation's user messages in turn order."""

    system: str
    users: list[list[str]]  # [conversation][turn]

    def messages(self, conversation: int, replies: list[str]) -> list[dict[str, str]]:
        """The conversation up to its next turn's user message, with `replies` to the turns before it."""
        said = [{"role": "system", "content": self.system}]
        for turn, reply in enumerate(replies):
            said += [{"role": "user", "content": self.users[conversation][turn]},
                     {"role": "assistant", "content": reply}]
        return said + [{"role": "user", "content": self.users[conversation][len(replies)]}]


def chat_script(options: RequestsOptions, tokenizer: Tokenizer | None) -> ChatScript:
    rng = random.Random(options.seed + 2)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_bos=False)) if tokenizer is not None else len(text.split())

    system = sized_text(rng, options.system_tokens, count)
    users = [[sized_text(rng, options.prompt_tokens, count) for _ in range(options.turns)]
             for _ in range(options.requests)]
    return ChatScript(system, users)


def sized_text(rng: random.Random, num_tokens: int, count: Callable[[str], int]) -> str:
    """Random words, as many as fit in `num_tokens` tokens."""
    words = [rng.choice(WORDS) for _ in range(num_tokens)]  # a word is at least one token
    fitting, over = 0, len(words) + 1  # the longest prefix of words that fits: binary search
    while over - fitting > 1:
        middle = (fitting + over) // 2
        if count(" ".join(words[:middle])) <= num_tokens:
            fitting = middle
        else:
            over = middle
    return " ".join(words[:fitting])


def token_script(options: RequestsOptions, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """A system prompt and each conversation's user messages as random token ids."""
    rng = random.Random(options.seed + 2)
    system = [rng.randrange(vocab_size) for _ in range(options.system_tokens)]
    users = [[[rng.randrange(vocab_size) for _ in range(options.prompt_tokens)] for _ in range(options.turns)]
             for _ in range(options.requests)]
    return system, users


def conversation_timings(options: RequestsOptions) -> list[RequestTiming]:
    """One timing per turn, conversation-major; later turns' arrivals are set when they are sent."""
    timings = []
    for conversation, arrival in enumerate(arrival_times(options)):
        for turn in range(options.turns):
            timings.append(RequestTiming(len(timings), arrival, 0, conversation=conversation, turn=turn))
    return timings
