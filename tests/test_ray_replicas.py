"""pt2serve on a local Ray cluster: two replicas of the tiny artifact behind Ray Serve's HTTP ingress, on
127.0.0.1. Conversations go home (their later turns' cached_tokens cover their history), responses are the
server's, /metrics has a replica label, killing a replica mid-load loses no request, and the autoscaler takes
one replica to two under a queue and back.

Needs the `ray` extra (skipped without it); the Ray cluster starts once per module (about 15 s on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from pt2serve.cluster.app import app_builder, build_app  # noqa: E402
from pt2serve.cluster.config import ClusterConfig  # noqa: E402
from pt2serve.errors import Pt2ServeError  # noqa: E402
from pt2serve.runtime.executor import ExecutorConfig  # noqa: E402
from pt2serve.serve.config import ServerConfig  # noqa: E402

TWO = "two"
SYSTEM = "You answer in one word. " * 2  # shared by every conversation: 48 byte tokens, 3 blocks
TURNS = 3
CONVERSATIONS = 32
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # about 40 s on 2 cores: a Ray cluster of its own
def test_serve_ray_serves_until_signalled_then_exits_0(tiny_artifact):
    """The command: a cluster of its own, the ready line once its replica has loaded, the server's answers,
    and SIGINT shuts it down. (First in the module: before the module's own cluster starts.)"""
    port = _free_port()
    command = [sys.executable, "-m", "pt2serve.cli", "serve-ray", str(tiny_artifact), "--replicas", "1",
               "--port", str(port), "--threads", "1", "--model-name", "cli-model"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while not lines or "(ready)" not in lines[-1]:
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)[-3000:]
            lines.append(process.stdout.readline())
        assert f"serving cli-model at http://127.0.0.1:{port}/v1 with 1 replica (ready)" in lines[-1]
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "cli-model", "prompt": "hi",
                                                                            "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def ray_url():
    # Replicas report their load every half second (Ray's default is 10 s), so the autoscaling test is short.
    push_interval = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"
    before = os.environ.get(push_interval)
    os.environ[push_interval] = "0.5"  # read by the cluster's processes, which inherit this environment
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="pt2serve-tests",
             _node_ip_address="127.0.0.1")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    if before is None:
        os.environ.pop(push_interval)
    else:
        os.environ[push_interval] = before


def _app(artifact, cluster: ClusterConfig):
    # Served as "tiny", as the single server the replicas are compared with (tiny_server); 1 torch thread per
    # replica: two replicas and the test share 2 cores.
    return build_app(artifact, cluster, server=ServerConfig(model_name="tiny"),
                     executor=ExecutorConfig(num_cells=4097), threads=1)


@pytest.fixture(scope="module")
def two_replicas(ray_url, tiny_artifact):
    serve.run(_app(tiny_artifact, ClusterConfig(replicas=2, report_period_s=0.5)), name=TWO, route_prefix="/")
    yield ray_url
    serve.delete(TWO)


async def _chat(client: httpx.AsyncClient, url: str, messages, stream: bool, session: str | None) -> tuple[str, dict]:
    """(reply text, usage) of one chat turn, streamed or not."""
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    headers = {"X-Session-ID": session} if session else {}
    if not stream:
        reply = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        return data["choices"][0]["message"]["content"], data["usage"]
    body["stream_options"] = {"include_usage": True}
    parts, usage = [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
                usage = chunk.get("usage") or usage
    return "".join(parts), usage


def test_later_turns_go_home(two_replicas):
    """32 conversations at once, a third streamed, half with a session header: >= 95% of the later turns find
    their history cached (cached_tokens reach the previous turn's prompt), so they ran where it did."""
    url = two_replicas

    async def converse(client, c: int) -> list[tuple[int, int]]:
        messages = [{"role": "system", "content": SYSTEM}]
        turns = []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"conversation {c} asks question {turn}"})
            reply, usage = await _chat(client, url, messages, stream=c % 3 == 0,
                                       session=f"s{c}" if c % 2 else None)
            messages.append({"role": "assistant", "content": reply})
            turns.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        return turns

    async def run() -> list[list[tuple[int, int]]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(converse(client, c) for c in range(CONVERSATIONS)))

    conversations = asyncio.run(run())
    later = [(previous[0], cached) for turns in conversations for previous, (_, cached) in zip(turns, turns[1:])]
    home = sum(cached >= previous_prompt - 1 for previous_prompt, cached in later)
    print(f"{home} of {len(later)} later turns routed home")
    assert home / len(later) >= 0.95, f"{home} of {len(later)} later turns found their history: {conversations}"


def test_responses_are_the_servers(two_replicas, tiny_server):
    """The same greedy request through Ray and from serve-artifact's app: equal choices, equal errors."""
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
    ours, theirs = (httpx.post(f"{url}/v1/completions", json=body, timeout=60) for url in (two_replicas, tiny_server))
    assert ours.status_code == theirs.status_code == 200
    assert ours.json()["choices"] == theirs.json()["choices"]
    assert ours.headers["content-type"] == theirs.headers["content-type"]
    streamed = httpx.post(f"{two_replicas}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.split("\n\n")
             if line.startswith("data: {")]
    assert "".join(texts) == theirs.json()["choices"][0]["text"] and streamed.text.endswith("data: [DONE]\n\n")
    bad = {"model": "tiny", "prompt": "x", "max_tokens": -1}
    ours, theirs = (httpx.post(f"{url}/v1/completions", json=bad, timeout=60) for url in (two_replicas, tiny_server))
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()) == (400, theirs.json())
    models = httpx.get(f"{two_replicas}/v1/models", timeout=60)
    assert models.json()["data"][0]["id"] == "tiny"


def _replica_requests(url: str) -> dict[str, float]:
    """Requests ended per replica, from the gateway's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pt2serve_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            replica = labels.split('replica="')[1].split('"')[0]
            counts[replica] = counts.get(replica, 0.0) + float(value)
    return counts


def _gateway_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("pt2serve_gateway_"))
    return {"retries": float(values["pt2serve_gateway_retries_total"]),
            "lost": float(values["pt2serve_gateway_requests_lost_total"])}


def test_metrics_are_labelled_by_replica(two_replicas):
    """Rounds of 4 concurrent requests with prompts of their own (new prefixes spread by load) until both
    replicas' counts reach the gateway's /metrics: replicas post every second, late on a loaded machine."""

    async def round_of_four(round_index: int) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(http.post(f"{two_replicas}/v1/completions", json={
                "prompt": f"metrics {round_index} {i}", "max_tokens": 2}) for i in range(4)))

    deadline, round_index = time.monotonic() + 60, 0
    while len(counts := _replica_requests(two_replicas)) < 2 and time.monotonic() < deadline:
        asyncio.run(round_of_four(round_index))
        round_index += 1
        time.sleep(1.0)
    assert len(counts) == 2 and sum(counts.values()) >= 4, counts


def test_killing_a_replica_mid_load_loses_no_request(two_replicas):
    """24 requests, half streamed; one replica is killed once tokens flow. Every request completes (those it
    held before their first bytes are sent again to the other replica), but a stream that had begun on it,
    which ends with a replica_lost error event and [DONE]."""
    url = two_replicas
    streaming_started = asyncio.Event()

    async def one(client, i: int) -> str:
        body = {"model": "tiny", "prompt": f"request {i} of the kill test", "max_tokens": 160, "ignore_eos": True,
                "stream": i % 2 == 0}
        if not body["stream"]:
            reply = await client.post(f"{url}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 160
            return "complete"
        tokens, error = 0, None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            lines = [line async for line in _lines(reply, streaming_started)]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["code"]
            else:
                tokens += bool(chunk["choices"][0]["text"]) or chunk["choices"][0]["finish_reason"] is None
        assert error in (None, "replica_lost")
        return "complete" if error is None else "cut"

    async def kill_one_replica() -> str:
        await streaming_started.wait()
        await asyncio.sleep(0.3)
        prefix = f"SERVE_REPLICA::{TWO}#Engine#"
        name = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))[0]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
        return name

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            killer = asyncio.ensure_future(kill_one_replica())
            outcomes = await asyncio.gather(*(one(client, i) for i in range(24)))
            return await killer, outcomes

    before = _gateway_counts(url)
    killed, outcomes = asyncio.run(run())
    after = _gateway_counts(url)
    assert all(outcome in ("complete", "cut") for outcome in outcomes)
    assert outcomes.count("complete") >= 12  # every non-streamed one at least
    cut = outcomes.count("cut")
    print(f"killed {killed}: {after['retries'] - before['retries']:.0f} requests sent again, {cut} streams cut")
    assert after["lost"] - before["lost"] == cut  # no request lost but the streams cut
    # The kill hit requests: some were sent again (those it held before their first bytes), or cut.
    assert after["retries"] - before["retries"] + cut >= 1, (killed, outcomes)
    # The deployment brings the killed replica back.
    deadline = time.monotonic() + 120
    while _running(TWO) < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)


async def _lines(reply, started: asyncio.Event):
    async for line in reply.aiter_lines():
        if line.startswith("data:"):
            started.set()
            yield line


def _running(app: str) -> int:
    states = serve.status().applications[app].deployments["Engine"].replica_states
    return states.get("RUNNING", 0)


@pytest.mark.slow  # about 35 s on 2 cores
def test_autoscaling_goes_to_two_under_a_queue_and_back(ray_url, tiny_artifact):
    cluster = ClusterConfig(autoscale=(1, 2), target_active=2, upscale_delay_s=0, downscale_delay_s=3,
                            look_back_s=1, max_ongoing_requests=32)
    serve.run(_app(tiny_artifact, cluster), name="scaled", route_prefix="/scaled")
    url = f"{ray_url}/scaled"
    try:
        assert _running("scaled") == 1

        async def load() -> None:
            async with httpx.AsyncClient(timeout=180) as client:
                body = {"prompt": "keep busy", "max_tokens": 200, "ignore_eos": True}
                while _running("scaled") < 2:
                    replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body)
                                                     for _ in range(12)))
                    assert all(reply.status_code == 200 for reply in replies)

        asyncio.run(asyncio.wait_for(load(), 150))
        deadline = time.monotonic() + 120
        while _running("scaled") > 1:
            assert time.monotonic() < deadline, "the idle deployment did not scale back to one replica"
            time.sleep(0.5)
    finally:
        serve.delete("scaled")


def test_a_serve_config_builds_the_app_from_its_args(tiny_artifact):
    """What a Ray Serve config file (or KubeRay's serveConfigV2) hands app_builder."""
    assert isinstance(app_builder({"artifact": str(tiny_artifact), "autoscale": "1:3", "routing": "first-tokens",
                                   "model_name": "m"}), serve.Application)
    with pytest.raises(Pt2ServeError, match="artifact"):
        app_builder({"replicas": 2})
    with pytest.raises(Pt2ServeError, match="unknown"):
        app_builder({"artifact": str(tiny_artifact), "gpus": 2})
