"""Faults stay with their own request (a failing tokenizer, a callback that raises, a stalled client), the
server's limits, load failures, graceful shutdown and the API key check.

A failing step has its tests beside the runner's and the server's other tests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from conftest import assert_only_the_cache_holds_cells, wait_until_idle
from pt2serve.errors import Pt2ServeError
from pt2serve.model.presets import byte_tokenizer_files, toy_greedy_continuation
from pt2serve.runtime import executor as executor_module
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.serve import app as app_module
from pt2serve.serve.app import create_app
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.errors import UnexpectedErrors
from pt2serve.tokenizer import Tokenizer
from servers import TOY_MODEL, ServeProcess, ServerThread

TOKENIZER = Tokenizer(byte_tokenizer_files())
BOS = 256
MODEL = TOY_MODEL
CELLS = ExecutorConfig(num_cells=4097)


def slow_steps(runner, monkeypatch, seconds: float = 0.01) -> None:
    """Each engine step takes at least `seconds`, so a long request is surely running when a test acts."""
    launch = runner.executor.launch  # what the runner calls (step() is launch then wait)

    def slow_launch(chunks, *args):
        time.sleep(seconds)
        return launch(chunks, *args)

    monkeypatch.setattr(runner.executor, "launch", slow_launch)


# -- faults stay with their own request ------------------------------------------------------------------------

POISON = 0x20  # in the 30 ids toy-greedy generates after 0x10, not in those after 0x20 (asserted below)


def test_a_failing_detokenizer_fails_only_its_request(toy_runner, monkeypatch):
    poisoned, clean = [BOS, 0x10], [BOS, 0x20]
    assert POISON in toy_greedy_continuation(poisoned, 30)
    assert POISON not in toy_greedy_continuation(clean, 30)
    decode = toy_runner.tokenizer.decode

    def failing_decode(ids):
        if POISON in ids:
            raise RuntimeError("tokenizer exploded")
        return decode(ids)

    monkeypatch.setattr(toy_runner.tokenizer, "decode", failing_decode)
    # Submitted together: both run in the same steps, and only the one whose text fails ends.
    bad = toy_runner.submit(poisoned, max_new_tokens=30)
    good = toy_runner.submit(clean, max_new_tokens=30)
    failed = bad.result(timeout=60)
    assert failed.finish_reason is FinishReason.ERROR and "tokenizer exploded" in failed.error
    done = good.result(timeout=60)
    assert done.finish_reason is FinishReason.LENGTH
    assert done.token_ids == toy_greedy_continuation(clean, 30) and done.text == decode(done.token_ids)
    assert_only_the_cache_holds_cells(toy_runner)


def test_a_raising_callback_fails_only_its_request(toy_runner):
    seen = []

    def on_event(event):
        seen.append(event)
        if len(seen) == 3:
            raise ValueError("the caller's callback broke")

    bad = toy_runner.submit([BOS, 1], max_new_tokens=50, on_event=on_event)
    good = toy_runner.submit([BOS, 2], max_new_tokens=50)
    failed = bad.result(timeout=60)
    assert failed.finish_reason is FinishReason.ERROR and "callback broke" in failed.error
    assert seen[-1].finish_reason is FinishReason.ERROR  # the callback still heard how it ended
    assert good.result(timeout=60).token_ids == toy_greedy_continuation([BOS, 2], 50)
    assert_only_the_cache_holds_cells(toy_runner)


def test_a_failing_tokenizer_call_answers_only_its_request(toy_server, toy_runner, monkeypatch):
    encode = toy_runner.tokenizer.encode

    def failing_encode(text, add_bos=True):
        if "poison" in text:
            raise RuntimeError("tokenizer exploded at 0xdeadbeef")
        return encode(text, add_bos)

    monkeypatch.setattr(toy_runner.tokenizer, "encode", failing_encode)
    with httpx.Client(base_url=toy_server, timeout=60) as http:
        bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "poison", "max_tokens": 4})
        good = http.post("/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 4,
                                                  "temperature": 0})
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    assert "deadbeef" not in bad.text and "Traceback" not in bad.text
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] == TOKENIZER.decode(toy_greedy_continuation(encode("fine"), 4))


def test_a_stalled_client_holds_up_only_itself(toy_server, toy_runner):
    wait_until_idle(toy_runner)
    body = json.dumps({"model": MODEL, "prompt": [BOS, 7], "max_tokens": 240, "stream": True}).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # fills at once: the server's writes block
    stalled.connect(address(toy_server))
    try:
        stalled.sendall(http_request(body))  # and never read
        with openai.OpenAI(base_url=f"{toy_server}/v1", api_key="x", timeout=30, max_retries=0) as client:
            for i in range(8):
                done = client.completions.create(model=MODEL, prompt=[BOS, i], max_tokens=20, temperature=0)
                assert done.choices[0].text == TOKENIZER.decode(toy_greedy_continuation([BOS, i], 20))
        # The stalled request ran to its end in the engine and gave its cells back, unread.
        assert_only_the_cache_holds_cells(toy_runner)
    finally:
        stalled.close()


def handling_completions(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Events set when the server starts handling a completion request (its headers are in) and once it is done
    with it, whatever the outcome: around the outermost middleware, which logs what nothing else expected."""
    started, done = threading.Event(), threading.Event()
    handle = UnexpectedErrors.__call__

    async def watched(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await handle(self, scope, receive, send)
        started.set()
        try:
            await handle(self, scope, receive, send)
        finally:
            done.set()

    monkeypatch.setattr(UnexpectedErrors, "__call__", watched)
    return started, done


def test_a_client_that_leaves_while_sending_its_request_is_no_server_error(toy_server, caplog, monkeypatch):
    started, done = handling_completions(monkeypatch)
    body = json.dumps({"model": MODEL, "prompt": [BOS, 7], "max_tokens": 4}).encode()
    with socket.create_connection(address(toy_server)) as sock:
        sock.sendall(http_request(body)[: -len(body) // 2])  # the headers promise the whole body; half comes
        assert started.wait(timeout=10), "the server did not start on the request"
    assert done.wait(timeout=10), "the server did not notice the disconnect"
    assert httpx.get(f"{toy_server}/health").status_code == 200
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]


# -- limits ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_server(tiny_artifact):
    served = ServeProcess(tiny_artifact, "--max-connections", "3", "--max-queued", "2")
    yield served
    code, stderr = served.stop()
    assert code == 0, stderr


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def http_request(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response with a Content-Length."""
    sock.settimeout(30)
    data = b""

    def more() -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    while b"\r\n\r\n" not in data:
        data += more()
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += more()
    return int(lines[0].split()[1]), body


def test_idle_connections_past_the_bound_give_way_to_new_ones(cli_server):
    """Three idle connections fill --max-connections 3: each new one closes the one that has waited longest,
    so /health and requests are answered (every request got a plain-text 503 while idle ones stayed open)."""
    idle = [socket.create_connection(address(cli_server.url)) for _ in range(3)]
    try:
        time.sleep(0.2)  # let the server accept them
        assert httpx.get(f"{cli_server.url}/health").json() == {"status": "ok"}
        done = httpx.post(f"{cli_server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert done.status_code == 200
        idle[0].settimeout(5)  # long before the header timeout
        assert idle[0].recv(1) == b""
    finally:
        for sock in idle:
            sock.close()


def test_an_idle_connection_outlives_the_clients_keep_alive(cli_server):
    """httpx, and so the openai client, reuses a connection for 5 s: the server must keep it open longer."""
    body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
    with socket.create_connection(address(cli_server.url)) as sock:
        sock.sendall(http_request(body))
        assert read_response(sock)[0] == 200
        time.sleep(5.5)
        sock.sendall(http_request(body))
        assert read_response(sock)[0] == 200


def test_max_connections_must_exceed_max_queued():
    with pytest.raises(Pt2ServeError, match="must exceed max_queued"):
        ServerConfig(max_queued=8, max_connections=8)


# -- load failures ---------------------------------------------------------------------------------------------


def test_a_pool_larger_than_free_memory_is_refused_before_allocating(tiny_artifact, monkeypatch):
    monkeypatch.setattr("pt2serve.runtime.cells.available_memory_bytes", lambda device: 100_000)
    with pytest.raises(Pt2ServeError, match=r"a KV pool of 4000 cells needs 0\.00 GB, but only 0\.00 GB of host "
                                            r"memory is available: lower --num-cells"):
        open_runner(tiny_artifact, executor_config=ExecutorConfig(num_cells=4000))


def test_out_of_device_memory_while_loading_is_a_clear_error(tiny_artifact, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(executor_module, "allocate_kv_pools", no_memory)
    with pytest.raises(Pt2ServeError, match="out of device memory allocating a KV pool of 64 cells: lower --num-cells"):
        open_runner(tiny_artifact, executor_config=ExecutorConfig(num_cells=64))


def serve_and_fail(*args: str, setup: str = "") -> subprocess.CompletedProcess:
    """Run `pt2serve serve-artifact ARGS` (after `setup` Python code) expecting it to give up."""
    code = f"import sys\n{setup}\nfrom pt2serve.cli import main\nmain()"
    return subprocess.run([sys.executable, "-c", code, "serve-artifact", *args, "--port", "0"],
                          capture_output=True, text=True, timeout=120)


def test_cli_refuses_a_pool_that_does_not_fit_without_traceback(tiny_artifact):
    result = serve_and_fail(str(tiny_artifact), "--num-cells", "4000",
                            setup="import pt2serve.runtime.cells as c; c.available_memory_bytes = lambda d: 100_000")
    assert result.returncode != 0
    assert "lower --num-cells" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_says_when_there_is_no_gpu(tiny_artifact):
    result = serve_and_fail(str(tiny_artifact), "--device", "cuda")
    assert result.returncode != 0
    assert "no CUDA GPU is visible" in result.stderr and "Traceback" not in result.stderr


# -- graceful shutdown -----------------------------------------------------------------------------------------


@pytest.fixture
def slow_server(toy_artifact, monkeypatch):
    """Makes a server over its own slow-stepping runner (draining closes it) with a given drain timeout."""
    servers = []

    def make(drain_timeout_s: float) -> ServerThread:
        runner = open_runner(toy_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
        slow_steps(runner, monkeypatch)
        config = ServerConfig(model_name=MODEL, drain_timeout_s=drain_timeout_s)
        servers.append(ServerThread(create_app(config, runner, owns_runner=True)).start())
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def data_lines(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def assert_stops_by_itself(server: ServerThread, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while server.is_running:
        assert time.monotonic() < deadline, "the server did not exit after draining"
        time.sleep(0.05)


def test_draining_finishes_running_requests_and_refuses_new_ones(slow_server):
    draining_server = slow_server(drain_timeout_s=30)
    url = draining_server.url
    prompt = [BOS, 9]
    with httpx.Client(base_url=url, timeout=30) as http:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            draining_server.drain()
            refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "shutting_down"
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            rest = data_lines(lines)
    events = [json.loads(first[6:])] + [json.loads(line) for line in rest[:-1]]
    assert rest[-1] == "[DONE]"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events) == TOKENIZER.decode(toy_greedy_continuation(prompt, 40))
    assert_stops_by_itself(draining_server)


def test_draining_cuts_what_outlasts_the_timeout(slow_server):
    draining_server = slow_server(drain_timeout_s=1)
    url = draining_server.url
    prompt = [BOS, 3]
    long = {"model": MODEL, "prompt": prompt, "max_tokens": 240, "temperature": 0}  # over 2.4 s: past the drain
    waiting: dict = {}
    whole = threading.Thread(target=lambda: waiting.update(response=httpx.post(f"{url}/v1/completions", json=long,
                                                                               timeout=30)))
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            whole.start()
            time.sleep(0.1)
            draining_server.drain()
            started = time.monotonic()
            rest = data_lines(lines)  # ends: no hang past the drain timeout
            assert time.monotonic() - started < 10
    whole.join(timeout=30)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "cancelled" and "shutting down" in error["message"]
    chunks = [json.loads(first[6:])] + [json.loads(line) for line in rest[:-2]]
    texts = [c["choices"][0]["text"] for c in chunks]
    # Nothing lost: the pieces join to the decode of the tokens that came, however the cut fell. One chunk
    # per token, and one more without a token when the cut found text held back (bytes that decode to U+FFFD
    # at the end, which later bytes might have completed).
    joined = "".join(texts)
    came = toy_greedy_continuation(prompt, len(texts))
    if joined != TOKENIZER.decode(came):
        came = came[:-1]
        assert TOKENIZER.decode(came).endswith("\ufffd") and joined == TOKENIZER.decode(came)
    assert 0 < len(came) < 240
    response = waiting["response"]
    assert response.status_code == 503 and response.json()["error"]["code"] == "cancelled"
    assert response.headers["Retry-After"] == "1"  # every 503 says when to come back
    assert_stops_by_itself(draining_server)


# -- the API key ------------------------------------------------------------------------------------------------


def test_the_api_key_is_compared_in_constant_time_on_equal_lengths(monkeypatch):
    compared, compare = [], hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    key = "s3cret-key"
    assert app_module.key_matches(key, key)
    for wrong in ("", "s", "s3cret-kez", key + "x", "ключ", "x" * 1000):
        assert not app_module.key_matches(wrong, key)
    assert compared and all(a == b == hashlib.sha256().digest_size for a, b in compared)


