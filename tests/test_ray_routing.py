"""The replicas' routing, calls and metrics without Ray: route keys, the prefix table and the ring, a call
answered by the server's own app in process (asgi.py) exactly as over HTTP, metrics merged with a replica
label, and the autoscaling arithmetic."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pt2serve.cluster.asgi import call_app
from pt2serve.cluster.autoscale import QueueAndKvPolicy, desired_replicas
from pt2serve.cluster.calls import HttpCall, ResponseStart, route_key
from pt2serve.cluster.config import ClusterConfig, parse_autoscale
from pt2serve.cluster.metrics_merge import merge_metrics
from pt2serve.cluster.routing import (
    BLOCK_TOKENS,
    FirstTokensRing,
    PrefixTable,
    RouteKey,
    RoutePolicy,
    Routing,
    block_hashes,
)
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.engine import open_runner, read_tokenizer
from pt2serve.serve.app import create_app
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.metrics import ServerMetrics
from servers import ServerThread

REPLICAS = ["r0", "r1", "r2"]


def test_block_hashes_chain_whole_blocks_only():
    ids = list(range(3 * BLOCK_TOKENS + 5))
    hashes = block_hashes(ids)
    assert len(hashes) == 3
    assert block_hashes(ids[:2 * BLOCK_TOKENS]) == hashes[:2]  # a prefix's blocks are the prefix of the blocks
    changed = [ids[0] + 1, *ids[1:]]
    assert all(a != b for a, b in zip(block_hashes(changed), hashes))  # a change in block 0 changes every later one
    assert block_hashes(ids[:BLOCK_TOKENS - 1]) == ()


def test_a_conversation_goes_home_and_new_ones_spread_by_load():
    policy = RoutePolicy()
    system = list(range(100, 100 + 4 * BLOCK_TOKENS))
    first = system + [1] * 2 * BLOCK_TOKENS
    policy.record(RouteKey.of(system + [7] * 2 * BLOCK_TOKENS), "r0")
    policy.record(RouteKey.of(first), "r1")
    later_turn = first + [2] * 3 * BLOCK_TOKENS  # the history, the reply and the next user message
    assert policy.rank(RouteKey.of(later_turn), REPLICAS) == [["r1"], ["r0", "r2"]]
    # A new conversation shares only the system prompt, which r0 and r1 both hold: either, by load (Ray).
    assert policy.rank(RouteKey.of(system + [9] * BLOCK_TOKENS), REPLICAS) == [["r0", "r1"], ["r2"]]
    # Nothing in common with anything routed: no preference.
    assert policy.rank(RouteKey.of([5] * 3 * BLOCK_TOKENS), REPLICAS) == [REPLICAS]
    assert policy.rank(None, REPLICAS) == [REPLICAS]


def test_a_busy_home_is_passed_over_so_a_shared_system_prompt_spreads():
    """The first replica to take a system prompt is the only one holding it: new conversations go there until
    it has more than `imbalance` requests beyond the least loaded; then one goes elsewhere, that replica holds
    the prompt too, and from then on they tie (Ray takes the least loaded of a rank)."""
    policy = RoutePolicy(imbalance=2)
    system = list(range(4 * BLOCK_TOKENS))
    policy.record(RouteKey.of(system + [1] * BLOCK_TOKENS), "r0")
    policy.record(RouteKey.of(system + [2] * BLOCK_TOKENS), "r0")  # the system prompt is shared now
    new = RouteKey.of(system + [3] * BLOCK_TOKENS)
    assert policy.rank(new, REPLICAS, {"r0": 2})[0] == ["r0"]
    assert policy.rank(new, REPLICAS, {"r0": 3}) == [REPLICAS]  # 3 beyond r1's and r2's none: by load
    policy.record(new, "r1")
    assert policy.rank(RouteKey.of(system + [4] * BLOCK_TOKENS), REPLICAS, {"r0": 3})[0] == ["r0", "r1"]
    # A later turn's own history is not shared: it stays home however busy home is (until Ray finds it full).
    later = RouteKey.of(system + [1] * 3 * BLOCK_TOKENS)
    assert policy.rank(later, REPLICAS, {"r0": 30})[0] == ["r0"]


def test_a_session_goes_where_it_went_whatever_its_prompt():
    policy = RoutePolicy()
    policy.record(RouteKey.of([1] * BLOCK_TOKENS, session_id="s"), "r2")
    assert policy.rank(RouteKey.of([9] * BLOCK_TOKENS, session_id="s"), REPLICAS) == [["r2"], ["r0", "r1"]]
    policy.forget("r2")  # its replica died: the session starts afresh, by load
    assert policy.rank(RouteKey.of([9] * BLOCK_TOKENS, session_id="s"), REPLICAS) == [REPLICAS]


def test_only_live_replicas_are_preferred():
    policy = RoutePolicy()
    policy.record(RouteKey.of([3] * 2 * BLOCK_TOKENS), "gone")
    assert policy.rank(RouteKey.of([3] * 2 * BLOCK_TOKENS), REPLICAS) == [REPLICAS]


def test_prefix_table_is_bounded_and_forgets_a_replica():
    table = PrefixTable(max_blocks=4)
    table.record(range(10), "r0")
    assert len(table) == 4  # the most recent blocks stay
    assert table.longest_match([6, 7, 8, 9], REPLICAS) == (4, {"r0"}, False)
    table.record([6, 7], "r1")
    assert table.longest_match([6, 7, 8], REPLICAS) == (3, {"r0"}, False)
    assert table.longest_match([6, 7], REPLICAS) == (2, {"r0", "r1"}, False)
    table.forget("r0")
    assert table.longest_match([6, 7, 8], REPLICAS) == (2, {"r1"}, False)


def test_prefix_table_knows_where_prompts_branch():
    table = PrefixTable()
    table.record([1, 2, 3], "r0")
    assert table.longest_match([1, 2, 9], REPLICAS) == (2, {"r0"}, False)
    table.record([1, 2, 4], "r1")  # a second prompt went on from block 2 another way: 1, 2 are shared
    assert table.longest_match([1, 2, 9], REPLICAS) == (2, {"r0", "r1"}, True)
    assert table.longest_match([1, 2, 3, 5], REPLICAS) == (3, {"r0"}, False)
    table.record_held([3, 2, 1], "r2")  # a replica's report: held blocks, no order to learn from
    assert table.longest_match([1, 2, 3], REPLICAS) == (3, {"r0", "r2"}, False)


def test_first_tokens_ring_is_stable_and_moves_few_keys():
    keys = [hash(tuple(range(i, i + 8))) for i in range(2000)]
    three = FirstTokensRing(REPLICAS)
    assert [three.lookup(k) for k in keys] == [FirstTokensRing(reversed(REPLICAS)).lookup(k) for k in keys]
    four = FirstTokensRing([*REPLICAS, "r3"])
    moved = sum(three.lookup(k) != four.lookup(k) for k in keys)
    assert all(four.lookup(k) == "r3" for k in keys if three.lookup(k) != four.lookup(k))
    assert 0.1 < moved / len(keys) < 0.45  # about a quarter move, all of them to the new replica


def test_first_tokens_sends_a_shared_system_prompt_to_one_replica():
    """What the measurement in docs/replicas.md shows: consistent hashing on the first tokens cannot tell
    conversations apart that share a system prompt longer than the hashed head."""
    policy = RoutePolicy(Routing.FIRST_TOKENS)
    system = list(range(300))
    homes = {policy.rank(RouteKey.of(system + [c] * 40), REPLICAS)[0][0] for c in range(32)}
    assert len(homes) == 1


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_artifact):
    return read_tokenizer(tiny_artifact)


def test_route_key_is_the_prompt_as_the_server_encodes_it(tiny_tokenizer):
    messages = [{"role": "system", "content": "be brief " * 10}, {"role": "user", "content": "hello there"}]
    body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
    key = route_key("/v1/chat/completions", {"x-session-id": "abc"}, body, tiny_tokenizer)
    assert key == RouteKey.of(tiny_tokenizer.encode_chat(messages), "abc")
    text = route_key("/v1/completions", {}, json.dumps({"prompt": "hi " * 20}).encode(), tiny_tokenizer)
    assert text.blocks == block_hashes(tiny_tokenizer.encode("hi " * 20))
    ids = route_key("/v1/completions", {}, json.dumps({"prompt": list(range(40)), "session_id": "s"}).encode(), None)
    assert ids == RouteKey.of(list(range(40)), "s")
    # What the server refuses still routes (by session, else by load); other paths have no key.
    assert route_key("/v1/completions", {"x-session-id": "s"}, b"{not json", None) == RouteKey(session_id="s")
    assert route_key("/v1/completions", {}, json.dumps({"prompt": 5}).encode(), None) == RouteKey()
    assert route_key("/v1/models", {}, b"", tiny_tokenizer) is None


@pytest.fixture(scope="module")
def tiny_runner_url(tiny_artifact):
    """A runner over the tiny artifact, and the server's app over it served over HTTP (for comparison)."""
    runner = open_runner(tiny_artifact, device="cpu")
    thread = ServerThread(create_app(ServerConfig(model_name="tiny"), runner)).start()
    yield runner, thread.url
    thread.stop()
    runner.close()


@pytest.fixture
def tiny_app(tiny_runner_url):
    """A fresh app over the same runner (an app bridges engine events into the one loop that first used it,
    so each test, with its own asyncio.run, gets its own), and the HTTP server's URL."""
    runner, url = tiny_runner_url
    return create_app(ServerConfig(model_name="tiny"), runner), url


def _call(method: str, path: str, body: dict | None = None) -> HttpCall:
    raw = json.dumps(body).encode() if body is not None else b""
    headers = ((b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()))
    return HttpCall(method, path, b"", headers, raw)


async def _collect(app, call: HttpCall) -> tuple[ResponseStart, bytes]:
    items = [item async for item in call_app(app, call)]
    start = items[0]
    assert isinstance(start, ResponseStart) and all(isinstance(item, bytes) for item in items[1:])
    return start, start.body + b"".join(items[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_answers_as_the_server_does_over_http(tiny_app, stream):
    app, url = tiny_app
    body = {"prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0, "stream": stream}
    start, answer = asyncio.run(_collect(app, _call("POST", "/v1/completions", body)))
    over_http = httpx.post(f"{url}/v1/completions", json=body)
    assert start.status == over_http.status_code == 200
    assert start.is_event_stream == stream
    if stream:
        texts = [[json.loads(line[6:])["choices"][0]["text"] for line in raw.decode().split("\n\n")
                  if line.startswith("data: {")] for raw in (answer, over_http.content)]
        assert texts[0] == texts[1] and len(texts[0]) == 7  # a chunk per token, then the finish
        assert answer.endswith(b"data: [DONE]\n\n")
    else:
        mine, theirs = json.loads(answer), over_http.json()
        assert mine["choices"] == theirs["choices"] and mine["usage"]["completion_tokens"] == 6


def test_a_call_answers_errors_as_the_server_does(tiny_app):
    app, url = tiny_app
    body = {"prompt": "x", "max_tokens": "many"}

    async def both():
        return await _collect(app, _call("POST", "/v1/completions", body)), await _collect(app, _call("GET", "/nowhere"))

    (start, answer), (missing, _) = asyncio.run(both())
    over_http = httpx.post(f"{url}/v1/completions", json=body)
    assert (start.status, json.loads(answer)) == (over_http.status_code, over_http.json())
    assert missing.status == 404


def test_a_call_whose_caller_leaves_cancels_its_request(tiny_app):
    app, _ = tiny_app
    runner = app.state.pt2serve.runner

    async def leave_after_first_token() -> None:
        body = {"prompt": "a long one", "max_tokens": 200, "stream": True, "ignore_eos": True}
        responses = call_app(app, _call("POST", "/v1/completions", body))
        await responses.__anext__()
        await responses.aclose()
        for _ in range(500):
            if runner.num_active == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(leave_after_first_token())
    assert runner.num_active == 0


def test_metrics_merge_labels_every_sample_with_its_replica():
    texts = {}
    for replica, tokens in (("a", 10), ("b", 20)):
        metrics = ServerMetrics(lambda: None)
        metrics.request_finished("stop", tokens, 5, 3, 0.1, 0.01)
        texts[replica] = metrics.render().decode()
    merged = merge_metrics(texts).decode()
    assert 'pt2serve_prompt_tokens_total{replica="a"} 10.0' in merged
    assert 'pt2serve_prompt_tokens_total{replica="b"} 20.0' in merged
    assert 'pt2serve_requests_total{finish_reason="stop",replica="a"} 1.0' in merged
    assert merged.count("# TYPE pt2serve_prompt_tokens_total counter") == 1  # one family, both replicas' samples


def test_desired_replicas_follows_the_scarcer_of_queue_and_kv():
    assert desired_replicas([10, 6], [0.1, 0.1], target_active=8, target_kv_use=0.8) == 2
    assert desired_replicas([20, 20], [0.1, 0.1], target_active=8, target_kv_use=0.8) == 5
    assert desired_replicas([1, 1], [0.9, 0.9], target_active=8, target_kv_use=0.8) == 3
    assert desired_replicas([0, 0], [0.0, 0.0], target_active=8, target_kv_use=0.8) == 0  # min_replicas bounds it


def test_the_policy_keeps_the_replicas_until_they_report():
    class Context:
        aggregated_metrics = {}
        target_num_replicas = 3

    assert QueueAndKvPolicy()(Context()) == (3, {})
    with pytest.raises(ValueError):
        QueueAndKvPolicy(target_kv_use=1.5)


def test_cluster_config_refuses_what_cannot_run():
    assert parse_autoscale("1:4") == (1, 4)
    for text in ("4", "a:b", "1-4"):
        with pytest.raises(Pt2ServeError, match="MIN:MAX"):
            parse_autoscale(text)
    with pytest.raises(Pt2ServeError, match="MIN <= MAX"):
        ClusterConfig(autoscale=(3, 2))
    with pytest.raises(Pt2ServeError, match="replicas"):
        ClusterConfig(replicas=0)
    assert ClusterConfig(routing="first-tokens").routing is Routing.FIRST_TOKENS


@pytest.mark.parametrize("args, message", [
    (["--autoscale", "3"], "MIN:MAX"),
    (["--autoscale", "3:2"], "MIN <= MAX"),
    (["--routing", "random"], "--routing must be"),
    (["--max-ongoing-requests", "300"], "must not exceed"),
])
def test_serve_ray_refuses_bad_flags_before_starting_anything(tiny_artifact, args, message):
    from typer.testing import CliRunner

    from pt2serve.cli import app

    if args[0] == "--max-ongoing-requests":
        pytest.importorskip("ray")  # checked by build_app, which needs Ray
    result = CliRunner().invoke(app, ["serve-ray", str(tiny_artifact), *args])
    assert result.exit_code != 0 and message in result.output, result.output


def test_the_server_keeps_asyncios_loop_where_the_ray_extra_brings_uvloop(tiny_app):
    """ray[serve] installs uvloop, which uvicorn's "auto" loop would take; under it the connection budget
    (connections.py) did not close the longest-waiting connection past max_connections."""
    from pt2serve.serve.connections import uvicorn_config

    app, _ = tiny_app
    assert uvicorn_config(app).loop == "asyncio"
