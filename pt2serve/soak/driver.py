"""One soak run: learn the server's shape, run the clients until the deadline, wait for the server to go
idle, read its own numbers for the checks, and ask some seeded sampled requests again alone."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai

from pt2serve.errors import Pt2ServeError
from pt2serve.soak.calls import Target
from pt2serve.soak.options import SoakOptions
from pt2serve.soak.oracle import Oracle, SampledLog
from pt2serve.soak.replay import replay_sampled
from pt2serve.soak.report import SoakReport
from pt2serve.soak.traffic import Shape, Traffic
from pt2serve.soak.watch import HealthLog, MemoryLog, poll_health, read_metrics, sample_memory, wait_until_idle

MEMORY_INTERVAL_S = 1.0


def run_soak(options: SoakOptions) -> SoakReport:
    return asyncio.run(_run(options))


async def _run(options: SoakOptions) -> SoakReport:
    root = options.root
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    # The watchers get their own connections, so a busy traffic pool never delays a /health poll.
    watch_http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, connect=10))
    pool = options.burst_size + 2 * options.concurrency
    http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(options.request_timeout_s, connect=10),
                             limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool))
    client = openai.AsyncOpenAI(base_url=f"{root}/v1", api_key=options.api_key or "none", max_retries=0,
                                timeout=options.request_timeout_s)
    async with watch_http, http, client:
        model, max_context = await _model(watch_http, root)
        has_tokenizer = await _has_tokenizer(http, root, model)
        rng = random.Random(options.seed)
        shape = Shape(max_context, has_tokenizer, [rng.randrange(256) for _ in range(min(64, max_context // 4))])
        target = Target(root, model, http, client, Oracle(options.designed, has_tokenizer), SampledLog())
        traffic = Traffic(target, shape, options.burst_size, session_prefix=f"soak-{options.seed}-{time.time_ns()}",
                          scenario_timeout_s=options.scenario_timeout_s)
        before = await read_metrics(watch_http, root)

        stop = asyncio.Event()
        health, memory = HealthLog(), MemoryLog()
        watchers = [
            asyncio.create_task(poll_health(watch_http, root, options.health_interval_s, options.max_health_latency_s,
                                            health, stop)),
            asyncio.create_task(sample_memory(watch_http, root, memory, options.warmup_s, MEMORY_INTERVAL_S, stop)),
        ]
        outcomes = []
        started = time.monotonic()
        deadline = started + options.duration_s

        async def one_client(index: int) -> None:
            rng = random.Random(f"{options.seed}:{index}")
            while time.monotonic() < deadline:
                outcomes.extend(await traffic.run_one(rng))

        try:
            await asyncio.gather(*(one_client(i) for i in range(options.concurrency)))
            traffic_s = time.monotonic() - started
            after, idle_wait_s = await wait_until_idle(watch_http, root, options.drain_timeout_s)
            if memory.baseline_rss is not None:
                memory.add(after)
            replay = await replay_sampled(target, target.sampled, options.sampled_replays)
        finally:
            stop.set()
            await asyncio.gather(*watchers, return_exceptions=True)
    return SoakReport(options, model, traffic_s, outcomes, health, memory, before, after, idle_wait_s, replay)


async def _model(http: httpx.AsyncClient, root: str) -> tuple[str, int]:
    try:
        reply = await http.get(f"{root}/v1/models")
    except httpx.HTTPError as err:
        raise Pt2ServeError(f"cannot reach a server at {root}: {err or type(err).__name__}") from None
    if reply.status_code != 200:
        raise Pt2ServeError(f"GET {root}/v1/models answered {reply.status_code}: {reply.text[:200]}")
    card = reply.json()["data"][0]
    return card["id"], int(card["max_model_len"])


async def _has_tokenizer(http: httpx.AsyncClient, root: str, model: str) -> bool:
    """Whether text and chat work: a one-token chat request answers 200, or 400 on its messages."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    reply = await http.post(f"{root}/v1/chat/completions", json=body)
    if reply.status_code == 200:
        return True
    if reply.status_code == 400 and "tokenizer" in reply.text:
        return False
    raise Pt2ServeError(f"the server answered a plain chat request with {reply.status_code}: {reply.text[:200]}")
