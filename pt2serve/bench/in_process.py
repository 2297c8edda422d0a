"""Driving an open Runner in process: every workload's requests submitted straight to it.

Requests run with ignore_eos, so each produces max_new_tokens tokens; their tokens are timed in the runner's
event callback (on the engine thread), and the runner's step history gives the steps taken and their mean
width. One short untimed request runs first, and the prefix cache starts empty. With --workload chat each
turn's prompt is rendered and tokenized here (an artifact without a tokenizer has conversations of token
ids: conversations.py).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from pt2serve.bench.conversations import chat_script, conversation_timings, token_script
from pt2serve.bench.options import RequestsOptions
from pt2serve.bench.progress import Progress
from pt2serve.bench.request_timing import RequestsResult, RequestTiming, speculation_summary, summarise
from pt2serve.bench.workload import arrival_times, check_lengths, make_prompts
from pt2serve.errors import Pt2ServeError


def drive_runner(runner, options: RequestsOptions, progress: Progress | None = None) -> RequestsResult:
    """Run the requests on an open Runner (left open)."""
    options.check()
    check_lengths(options, runner.max_context)
    if options.warmup_request:
        runner.generate([runner.vocab_size - 1] * 8, max_new_tokens=2, ignore_eos=True)
    runner.clear_prefix_cache()  # each run starts cold: what it reuses, it computed itself
    steps_before = runner.scheduler.step  # steps numbered after this one are the workload's
    scheduler = runner.scheduler
    drafts_before = (scheduler.num_draft_tokens, scheduler.num_accepted_tokens, scheduler.num_verify_steps)
    if options.workload == "chat":
        timings = _drive_runner_conversations(runner, options, progress)
    else:
        timings = _drive_runner_random(runner, options, progress)
    widths = [record.num_tokens for record in list(runner.step_history) if record.step > steps_before]
    budget = runner.scheduler.config
    result = RequestsResult(
        "in-process", options, timings, str(runner.executor.device), num_steps=len(widths),
        mean_step_width=sum(widths) / len(widths) if widths else None,
        step_budget={"token_budget": budget.token_budget, "max_decode_sequences": budget.max_decode_sequences,
                     "min_prefill_chunk": budget.min_prefill_chunk},
        num_cells=runner.executor.memory.num_cells,
    )
    result.summary = summarise(timings, options.targets)
    if runner.drafter is not None:
        drafts_after = (scheduler.num_draft_tokens, scheduler.num_accepted_tokens, scheduler.num_verify_steps)
        result.speculation = speculation_summary(*(a - b for a, b in zip(drafts_after, drafts_before)))
    return result


def event_timer(timing: RequestTiming, origin: float, on_end: Callable[[], None]) -> Callable:
    """A runner event callback (called on the engine thread) that times `timing`'s tokens and calls
    `on_end` once the request has ended."""
    def on_event(event) -> None:
        now = time.perf_counter() - origin
        if event.token_id is not None:
            timing.output_tokens += 1
            if timing.first_token is None:
                timing.first_token = now
        if event.finish_reason is not None:
            timing.end = now
            timing.finish_reason = event.finish_reason.value
            timing.error = event.error
            on_end()
    return on_event


def _drive_runner_random(runner, options: RequestsOptions, progress: Progress | None) -> list[RequestTiming]:
    prompts = make_prompts(options, runner.vocab_size)
    timings = [RequestTiming(i, t, options.prompt_tokens) for i, t in enumerate(arrival_times(options))]
    finished = [threading.Event() for _ in timings]
    origin = time.perf_counter()
    deadline = origin + options.timeout
    handles = {}
    for timing, prompt, done in zip(timings, prompts, finished):
        while (wait := origin + timing.arrival - time.perf_counter()) > 0:
            time.sleep(min(wait, 0.1))
            _report_requests(progress, timings, finished)
        timing.submit = time.perf_counter() - origin
        try:
            handles[timing.index] = runner.submit(prompt, max_new_tokens=options.max_new_tokens, ignore_eos=True,
                                                  on_event=event_timer(timing, origin, done.set))
        except Pt2ServeError as err:
            timing.error = str(err)
            done.set()
    while not all(done.wait(0) for done in finished):
        if time.perf_counter() > deadline:
            raise Pt2ServeError(f"the requests did not finish within --timeout {options.timeout:.0f} s")
        _report_requests(progress, timings, finished)
        time.sleep(0.1)
    for index, handle in handles.items():
        timings[index].cached_tokens = handle.stats.reused_tokens
    return timings


def _report_requests(progress: Progress | None, timings: list[RequestTiming],
                     finished: list[threading.Event]) -> None:
    if progress is None:
        return
    submitted = sum(t.submit is not None for t in timings)
    done = sum(e.is_set() for e in finished)
    tokens = sum(t.output_tokens for t in timings)
    progress(f"requests: {submitted}/{len(timings)} submitted, {done} finished, {tokens} tokens out")


def _drive_runner_conversations(runner, options: RequestsOptions, progress: Progress | None) -> list[RequestTiming]:
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
            _report_conversations(progress, timings)
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


def _report_conversations(progress: Progress | None, timings: list[RequestTiming]) -> None:
    if progress is not None:
        sent = sum(t.submit is not None for t in timings)
        done = sum(t.end is not None or t.error is not None for t in timings)
        tokens = sum(t.output_tokens for t in timings)
        progress(f"conversations: {sent}/{len(timings)} turns sent, {done} ended, {tokens} tokens out")
