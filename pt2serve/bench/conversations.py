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
"""

from __future__ import annotations

import queue
import random
import time
from dataclasses import dataclass
from typing import Callable

from pt2serve.bench.options import RequestsOptions
from pt2serve.bench.requests_mode import Progress, RequestTiming, arrival_times, event_timer
from pt2serve.errors import Pt2ServeError
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


def drive_runner_conversations(runner, options: RequestsOptions, progress: Progress | None) -> list[RequestTiming]:
    """The conversations on an open Runner: templates rendered and tokenized here, replies as their text
    (without a tokenizer: token ids throughout)."""
    prompt_of = _prompt_renderer(runner, options)
    timings = conversation_timings(options)
    replies: list[list[tuple[str, list[int]]]] = [[] for _ in range(options.requests)]
    said: dict[int, tuple[list[str], list[int]]] = {}  # the text and ids of each turn in flight, by timing index
    handles = {}
    ended: queue.SimpleQueue[int] = queue.SimpleQueue()  # timing indices of turns that ended
    origin = time.perf_counter()

    def send(timing: RequestTiming) -> None:
        timing.submit = time.perf_counter() - origin
        if timing.turn:
            timing.arrival = timing.submit  # sent as soon as the turn before it ended
        prompt = prompt_of(timing.conversation, replies[timing.conversation])
        timing.prompt_tokens = len(prompt)
        said[timing.index] = parts, ids = [], []
        timer = event_timer(timing, origin, lambda: ended.put(timing.index))

        def on_event(event) -> None:  # the engine thread
            parts.append(event.text)
            if event.token_id is not None:
                ids.append(event.token_id)
            timer(event)

        try:
            handles[timing.index] = runner.submit(prompt, max_new_tokens=options.max_new_tokens, ignore_eos=True,
                                                  on_event=on_event)
        except Pt2ServeError as err:
            timing.error = str(err)
            ended.put(timing.index)

    firsts = [t for t in timings if t.turn == 0]
    remaining = len(timings)
    deadline = origin + options.timeout
    while remaining:
        now = time.perf_counter() - origin
        while firsts and firsts[0].arrival <= now:
            send(firsts.pop(0))
        wait = min(0.1, firsts[0].arrival - now) if firsts else 0.1
        try:
            index = ended.get(timeout=max(wait, 0.0))
        except queue.Empty:
            if time.perf_counter() > deadline:
                raise Pt2ServeError(f"the conversations did not finish within --timeout {options.timeout:.0f} s")
            _report(progress, timings)
            continue
        timing = timings[index]
        remaining -= 1
        if index in handles:
            timing.cached_tokens = handles[index].stats.reused_tokens
        later = timings[index + 1: index + options.turns - timing.turn]
        if timing.error is not None:  # the conversation ends here
            for turn in later:
                turn.error = f"turn {timing.turn} of its conversation failed"
            remaining -= len(later)
        elif later:
            parts, ids = said.pop(index)
            replies[timing.conversation].append(("".join(parts), ids))
            send(later[0])
    return timings


def _prompt_renderer(runner, options: RequestsOptions) -> Callable[[int, list[tuple[str, list[int]]]], list[int]]:
    """How a conversation's next prompt is made from its replies so far (each as text and as ids)."""
    tokenizer = runner.tokenizer
    if tokenizer is not None:
        script = chat_script(options, tokenizer)
        return lambda conversation, replies: tokenizer.encode_chat(
            script.messages(conversation, [text for text, _ in replies]))
    system, users = token_script(options, runner.vocab_size)

    def token_ids(conversation: int, replies: list[tuple[str, list[int]]]) -> list[int]:
        prompt = list(system)
        for turn, (_, ids) in enumerate(replies):
            prompt += users[conversation][turn] + ids
        return prompt + users[conversation][len(replies)]

    return token_ids


def _report(progress: Progress | None, timings: list[RequestTiming]) -> None:
    if progress is not None:
        sent = sum(t.submit is not None for t in timings)
        done = sum(t.end is not None or t.error is not None for t in timings)
        tokens = sum(t.output_tokens for t in timings)
        progress(f"conversations: {sent}/{len(timings)} turns sent, {done} ended, {tokens} tokens out")
