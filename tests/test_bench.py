"""`pt2serve bench` on the tiny artifact (CPU): sweeps, request runs, the JSON/PNG reports, the URL client
(against the real server and a minimal stand-in on 127.0.0.1), and clear errors for bad flags.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from typer.testing import CliRunner

from pt2serve.bench import RequestsOptions, SweepOptions, drive_runner, run_requests, sweep_executor
from pt2serve.bench.options import parse_tokens, resolve_tokens
from pt2serve.bench.peer import EagerPeer
from pt2serve.bench.request_timing import RequestTiming, summarise
from pt2serve.bench.roofline import MachineLimits, ModelCost, step_cost
from pt2serve.bench.sweep import RowPlan, _analyse, plan_row, row_keys
from pt2serve.bench.timing import StepShape, StepTiming
from pt2serve.bench.workload import arrival_times
from pt2serve.cli import app
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.artifact import load_artifact, read_metadata
from pt2serve.runtime.engine import artifact_tokenizer
from pt2serve.model.presets import toy_greedy_continuation, toy_successor
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.pipeline import StepRecord
from pt2serve.runtime.runner import Runner, RunnerConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk

SWEEP_TOKENS = (1, 4, 16, 80)  # 80 is wider than the tiny artifact's widest static size (64): a mixed row
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def executor(tiny_artifact):
    return Executor(load_artifact(tiny_artifact, device="cpu"))


@pytest.fixture(scope="module")
def tokenizer(executor):
    return artifact_tokenizer(executor.artifact.tokenizer_json, executor.artifact.metadata.raw.get("tokenizer"))


@pytest.fixture(scope="module")
def sweep_result(executor, tokenizer):
    options = SweepOptions(tokens=SWEEP_TOKENS, warmup=2, iters=3)
    return sweep_executor(executor, tokenizer, options)


def cli(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


# -- sweep --------------------------------------------------------------------------------------------------


def test_sweep_rows_are_exactly_t_wide(sweep_result, executor):
    assert [row.tokens for row in sweep_result.rows] == list(SWEEP_TOKENS)
    for row in sweep_result.rows:
        assert row.flags == [], (row.tokens, row.flags)
        assert row.width_ok
        assert row.measured_steps == 3
        assert row.widths == [row.tokens] * 3
        assert row.decodes == [row.num_decode] * 3
        assert row.interval_seconds >= row.executor_seconds > 0  # the interval holds the step
        assert row.tokens_per_second > 0 and row.limit_seconds > 0 and row.fraction_of_limit > 0
        assert row.eager_seconds > 0 and row.speedup_over_eager > 0
    kinds = {row.tokens: (row.kind, row.num_decode) for row in sweep_result.rows}
    assert kinds[16] == ("decode", 16)
    assert kinds[80] == ("mixed", 32)
    # On the CPU (no CUDA graphs) the executor sends every step to forward_others.
    assert all(row.methods == ["forward_others"] for row in sweep_result.rows)
    assert executor.allocator.num_used == 0  # every request of every row is gone


def test_sweep_then_requests_share_one_executor(sweep_result, executor, tokenizer):
    runner = Runner(executor, tokenizer, RunnerConfig())  # closing it empties the prefix cache too
    try:
        result = drive_runner(runner, RequestsOptions(requests=6, prompt_tokens=20, max_new_tokens=6, stagger_ms=3))
    finally:
        runner.close()
    assert result.summary["completed"] == 6 and result.summary["failed"] == 0
    for r in result.requests:
        assert r.output_tokens == 6 and r.finish_reason == "length"
        assert 0 <= r.ttft <= r.e2e and r.tpot > 0
    assert executor.allocator.num_used == 0


def test_sweep_cli_writes_json_and_png(tiny_artifact, tmp_path):
    """The installed command in a subprocess, as a user runs it."""
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = subprocess.run(
        [sys.executable, "-m", "pt2serve.cli", "bench", str(tiny_artifact), "--mode", "sweep", "--tokens",
         ",".join(map(str, SWEEP_TOKENS)), "--warmup", "2", "--iters", "3", "--json", str(out_json),
         "--plot", str(out_png)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stdout and "% of limit" in proc.stdout and "x eager" in proc.stdout
    doc = json.loads(out_json.read_text())
    for key in ("mode", "created", "machine", "versions", "artifact", "flags", "options", "num_cells", "limits",
                "model_cost", "seconds", "rows"):
        assert key in doc, key
    assert doc["mode"] == "sweep"
    for key in ("platform", "cpu_count", "gpu_name", "device"):
        assert key in doc["machine"]
    assert doc["versions"]["torch"] and doc["versions"]["pt2serve"]
    assert doc["artifact"]["metadata"]["max_step_tokens"] == 128
    assert doc["flags"]["tokens"] == "1,4,16,80" and doc["flags"]["iters"] == 3
    assert doc["limits"]["memory_bandwidth"] > 0 and doc["limits"]["matmul_flops"] > 0
    assert [row["tokens"] for row in doc["rows"]] == list(SWEEP_TOKENS)
    for row in doc["rows"]:
        assert row["widths"] == [row["tokens"]] * 3, row  # every measured step was exactly T wide
        assert row["width_ok"] and row["flags"] == []
        for key in ("executor_seconds", "interval_seconds", "tokens_per_second", "bytes", "flops",
                    "limit_seconds", "fraction_of_limit", "bound", "executor_step_seconds", "interval_step_seconds",
                    "eager_seconds", "speedup_over_eager"):
            assert row[key] is not None, key
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_sweep_without_eager_peer_and_cuda_graphs(tiny_artifact, tmp_path, monkeypatch):
    """--no-eager-peer leaves the eager columns empty (no peer is built); --no-cuda-graphs reaches the
    executor's config (on a GPU, tests/test_cuda.py checks its effect)."""
    from pt2serve.bench import sweep

    built = []
    monkeypatch.setattr(sweep, "Executor", lambda artifact, config: built.append(config) or Executor(artifact, config))
    monkeypatch.setattr(sweep, "EagerPeer", lambda executor: pytest.fail("--no-eager-peer built a peer"))
    out_json = tmp_path / "sweep.json"
    result = cli(str(tiny_artifact), "--tokens", "1,2", "--warmup", "1", "--iters", "2", "--no-eager-peer",
                 "--no-cuda-graphs", "--json", str(out_json))
    assert result.exit_code == 0, result.output
    assert [config.use_cuda_graphs for config in built] == [False]
    doc = json.loads(out_json.read_text())
    assert doc["flags"]["eager_peer"] is False and doc["flags"]["no_cuda_graphs"] is True
    assert [(row["eager_seconds"], row["speedup_over_eager"]) for row in doc["rows"]] == [(None, None)] * 2
    assert all(row["tokens_per_second"] > 0 for row in doc["rows"])


def test_eager_peer_computes_the_designed_tokens(toy_artifact):
    """The peer runs the real computation: on toy-greedy its tokens are the designed successors, for a mixed
    step of decodes and a prompt chunk, and for one wider than max_step_tokens (sliced like the executor)."""
    executor = Executor(load_artifact(toy_artifact, device="cpu"), ExecutorConfig(num_cells=1024))
    peer = EagerPeer(executor)
    rng = np.random.default_rng(1)
    for lengths in ((1, 1, 5, 1), (100, 60)):
        chunks = []
        for length in lengths:
            prompt = rng.integers(0, 256, 1).tolist()
            tokens = prompt + toy_greedy_continuation(prompt, length - 1)
            cells = executor.allocator.allocate(length)
            chunks.append(Chunk(cells, tuple(tokens), 0, SamplingParams()))
        assert peer.step(chunks) == [toy_successor(c.tokens[-1]) for c in chunks]
        for chunk in chunks:
            executor.allocator.free(chunk.cells)


def test_rows_with_wrong_widths_are_flagged_not_hidden():
    plan = RowPlan(tokens=4, kind="decode", num_decode=4, prompt_tokens=8, max_new_tokens=50,
                   backlog_prompt_tokens=0, backlog_requests=0)
    decode = StepShape(4, 4, 4, 40, 40)
    short = StepShape(3, 3, 3, 30, 30)
    shapes = [StepShape(8, 4, 0, 8, 20), decode, decode, short, decode, decode]
    timings = [StepTiming(0.01 * i, 0.01 * i + 0.009, shape, ("forward_4",), 0.004) for i, shape in enumerate(shapes)]
    history = [StepRecord(i + 1, s.width, 0 if i == 0 else s.num_chunks, (), 0.009, 0.004)
               for i, s in enumerate(shapes)]
    limits = MachineLimits("cpu", "fp32", 1e10, 1e10, 0, 0, 0.0)
    cost = ModelCost(1000, 1000, 100, 10, 16, 8)
    row = _analyse(plan, timings, history, [], SweepOptions(warmup=1, iters=3), cost, limits)
    assert row.steady_from == 1 and row.measured_steps == 3
    assert row.widths == [4, 3, 4] and not row.width_ok
    assert any("not 4 wide" in flag for flag in row.flags)
    assert any("without 4 decodes" in flag for flag in row.flags)
    assert row.executor_seconds == pytest.approx(0.004) and row.interval_seconds == pytest.approx(0.01)
    few = _analyse(plan, timings, history, [], SweepOptions(warmup=1, iters=10), cost, limits)
    assert few.measured_steps == 3 and "only 3 of 10 steady steps measured" in few.flags


def test_row_numbers_are_the_hand_computed_ones():
    """A decode row of T=4 from made-up step times, model constants and machine limits, against numbers
    worked out by hand (see each comment)."""
    plan = RowPlan(tokens=4, kind="decode", num_decode=4, prompt_tokens=8, max_new_tokens=50,
                   backlog_prompt_tokens=0, backlog_requests=0)
    # Four decodes at position 9: 4 x 10 context cells, 4 x 10 query-key pairs.
    decode = StepShape(width=4, num_chunks=4, num_sampled=4, context_cells=40, attention_pairs=40)
    starts = [0.000, 0.010, 0.020, 0.032, 0.040, 0.052]
    durations = [0.004, 0.005, 0.006, 0.008, 0.004, 0.005]
    shapes = [StepShape(32, 4, 4, 32, 144)] + [decode] * 5  # a prefill step, then steady decodes
    timings = [StepTiming(start, start + took, shape, ("forward_4",), took)
               for start, took, shape in zip(starts, durations, shapes)]
    history = [StepRecord(i + 1, s.width, 0 if i == 0 else 4, (), took, None)
               for i, (s, took) in enumerate(zip(shapes, durations))]
    cost = ModelCost(weight_bytes=1000, weight_bytes_per_call=1000, matmul_params=100, head_params=10,
                     kv_bytes_per_cell=16, attention_flops_per_pair=8)
    limits = MachineLimits("cpu", "fp32", memory_bandwidth=1e6, matmul_flops=1e5, copy_bytes=0, matmul_size=0,
                           seconds=0.0)
    row = _analyse(plan, timings, history, [], SweepOptions(warmup=1, iters=3), cost, limits)
    # Steady from step 1; one warmup step; steps 2, 3, 4 measured (step 5 ends the last interval).
    assert (row.steady_from, row.measured_steps, row.flags) == (1, 3, [])
    assert row.executor_step_seconds == pytest.approx([0.006, 0.008, 0.004])
    assert row.interval_step_seconds == pytest.approx([0.012, 0.008, 0.012])
    assert row.executor_seconds == pytest.approx(0.006)  # medians
    assert row.interval_seconds == pytest.approx(0.012)
    assert row.tokens_per_second == pytest.approx(333.333, rel=1e-5)  # 4 tokens / 12 ms
    assert row.executor_tokens_per_second == pytest.approx(666.667, rel=1e-5)  # 4 / 6 ms
    # Bytes: 1000 of weights (one call) + 40 cells x 16 = 1640 -> 1.64 ms at 1 MB/s.
    # FLOPs: 2 x 90 body params x 4 tokens + 2 x 10 head params x 4 rows + 8 x 40 pairs = 1120 -> 11.2 ms.
    assert (row.bytes, row.flops) == (1640, 1120)
    assert (row.kv_bytes, row.attention_flops) == (640, 320)  # 40 cells x 16; 8 x 40 pairs
    assert row.memory_seconds == pytest.approx(0.00164) and row.compute_seconds == pytest.approx(0.0112)
    assert row.limit_seconds == pytest.approx(0.0112) and row.bound == "compute"
    assert row.limit_tokens_per_second == pytest.approx(357.143, rel=1e-5)  # 4 / 11.2 ms
    assert row.fraction_of_limit == pytest.approx(0.93333, rel=1e-5)  # 11.2 / 12
    assert row.executor_fraction_of_limit == pytest.approx(1.86667, rel=1e-5)  # 11.2 / 6
    two_calls = [StepTiming(t.start, t.end, t.shape, ("forward_others", "forward_4"), t.seconds) for t in timings]
    row = _analyse(plan, two_calls, history, [], SweepOptions(warmup=1, iters=3), cost, limits)
    assert row.bytes == 2640  # the weights are read once per compiled call
    # A mixed step: one decode sampled, a 4-token prompt piece not. FLOPs: 2 x 90 x 5 tokens + 2 x 10 x 1
    # sampled row (the head runs only where a token is sampled) + 8 x 20 pairs; bytes 1000 + 14 x 16.
    mixed = step_cost(StepShape(width=5, num_chunks=2, num_sampled=1, context_cells=14, attention_pairs=20), 1,
                      cost, limits)
    assert (mixed.bytes, mixed.flops) == (1224, 1080)


def test_model_cost_of_hand_made_metadata():
    """ModelCost from a metadata document written here, against counts done by hand."""
    def weight(name, *shape, dtype="float32"):
        return {"name": name, "shape": list(shape), "dtype": dtype}

    layer = "layers.0."
    raw = {
        "model_config": {"hidden_size": 8, "vocab_size": 10, "num_layers": 1, "num_heads": 2, "head_dim": 4,
                         "tie_word_embeddings": False},
        "cache": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "bf16"},
        "weights": [
            weight("embed_tokens.weight", 10, 8), weight("lm_head.weight", 10, 8), weight("norm.weight", 8),
            weight(layer + "self_attn.qkv_proj.weight", 16, 8), weight(layer + "self_attn.o_proj.weight", 8, 8),
            weight(layer + "mlp.gate_up_proj.weight", 32, 8), weight(layer + "mlp.down_proj.weight", 8, 16),
            weight(layer + "input_layernorm.weight", 8), weight("inv_freq", 2),
        ],
    }
    cost = ModelCost.from_metadata(raw)
    # numel: embed 80, head 80, norms 8 + 8, qkv 128, o 64, gate_up 256, down 128, inv_freq 2 = 754 -> x 4 bytes
    assert cost.weight_bytes == 3016
    assert cost.weight_bytes_per_call == 3016 - 320  # the untied embedding is gathered, not read whole
    assert cost.matmul_params == 80 + 128 + 64 + 256 + 128  # head + the layer's projections
    assert cost.head_params == 80
    assert cost.kv_bytes_per_cell == 16  # 1 layer x (K and V) x 1 kv head x 4 dims x 2 bytes (bf16)
    assert cost.attention_flops_per_pair == 32  # 4 x 1 layer x 2 heads x 4 dims
    tied = ModelCost.from_metadata({**raw, "model_config": {**raw["model_config"], "tie_word_embeddings": True},
                                    "weights": [w for w in raw["weights"] if w["name"] != "lm_head.weight"]})
    assert tied.weight_bytes == tied.weight_bytes_per_call == 2696  # the embedding is the head: read whole
    assert tied.matmul_params == 80 + 128 + 64 + 256 + 128


def test_model_cost_of_the_tiny_artifact_matches_what_loading_allocates(executor):
    """The cost constants against independent measures: the bytes of the weights the loader read and of
    the KV pool the executor allocated."""
    cost = ModelCost.from_metadata(executor.artifact.metadata.raw)
    assert cost.weight_bytes == executor.artifact.report.weight_bytes
    assert cost.kv_bytes_per_cell * executor.memory.num_cells == executor.memory.pool_bytes
    assert cost.head_params == executor.artifact.weights["lm_head.weight"].numel()


# -- requests -----------------------------------------------------------------------------------------------


def test_requests_cli_poisson_in_process(tiny_artifact, tmp_path):
    out_json, out_png = tmp_path / "req.json", tmp_path / "req.png"
    result = cli(str(tiny_artifact), "--mode", "requests", "--requests", "8", "--prompt-tokens", "24",
                 "--max-new-tokens", "5", "--request-rate", "200", "--seed", "3", "--json", str(out_json),
                 "--plot", str(out_png))
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "TPOT" in result.output
    doc = json.loads(out_json.read_text())
    for key in ("mode", "machine", "versions", "artifact", "flags", "options", "target", "summary", "requests"):
        assert key in doc, key
    summary = doc["summary"]
    assert summary["completed"] == 8 and summary["output_tokens"] == 40
    assert summary["output_tokens_per_second"] > 0
    for metric in ("ttft_seconds", "tpot_seconds", "e2e_seconds"):
        assert set(summary[metric]) >= {"p50", "p90", "p99", "mean"}
    arrivals = [r["arrival"] for r in doc["requests"]]
    assert arrivals == arrival_times(RequestsOptions(requests=8, request_rate=200, seed=3))
    for r in doc["requests"]:
        assert r["output_tokens"] == 5
        assert 0 <= r["ttft"] <= r["e2e"]
        assert r["tpot"] > 0  # its formula: test_arrivals_and_summary, on hand-computed numbers
    assert out_png.read_bytes()[:8] == PNG_MAGIC


CHAT = ["--workload", "chat", "--requests", "4", "--turns", "3", "--system-tokens", "60", "--prompt-tokens", "12",
        "--max-new-tokens", "6", "--stagger-ms", "50"]


def chat_turns(doc: dict) -> dict[tuple[int, int], dict]:
    return {(r["conversation"], r["turn"]): r for r in doc["requests"]}


def test_chat_workload_reuses_the_system_prompt_and_every_earlier_turn(tiny_artifact, tmp_path):
    out_json = tmp_path / "chat.json"
    result = cli(str(tiny_artifact), "--mode", "requests", *CHAT, "--json", str(out_json))
    assert result.exit_code == 0, result.output
    assert "TTFT, first turns" in result.output and "TTFT, later turns" in result.output
    doc = json.loads(out_json.read_text())
    s = doc["summary"]
    assert s["completed"] == 12 and s["output_tokens"] == 12 * 6
    assert s["prompt_tokens_reused"] + s["prompt_tokens_computed"] == s["prompt_tokens"]
    assert s["ttft_first_turns_seconds"]["count"] == 4 and s["ttft_later_turns_seconds"]["count"] == 8
    turns = chat_turns(doc)
    system = 60  # at least: the template wraps the shared system prompt in more tokens
    computed = turns[0, 0]["first_token"]  # the first conversation's system prompt is in the cache from here on
    later_starts = 0
    for (conversation, turn), r in turns.items():
        if turn:  # everything the turn before it sent is reused (the reply after it came back as text)
            assert r["cached_tokens"] >= turns[conversation, turn - 1]["prompt_tokens"]
            assert r["arrival"] >= turns[conversation, turn - 1]["end"]
        elif conversation and r["submit"] >= computed:  # a later conversation starts from that system prompt
            assert r["cached_tokens"] >= system
            later_starts += 1
    assert later_starts, "no conversation started after the first one's prompt was computed"
    cold = tmp_path / "cold.json"
    assert cli(str(tiny_artifact), "--mode", "requests", *CHAT, "--no-prefix-cache", "--json", str(cold)).exit_code == 0
    s_cold = json.loads(cold.read_text())["summary"]
    assert s_cold["prompt_tokens_reused"] == 0 and s_cold["prompt_tokens_computed"] == s_cold["prompt_tokens"]


def test_chat_workload_against_the_real_server(tiny_artifact, tiny_server):
    options = RequestsOptions(workload="chat", requests=3, turns=3, system_tokens=60, prompt_tokens=12,
                              max_new_tokens=6, url=tiny_server, seed=9)
    result = run_requests(tiny_artifact, options)
    assert result.summary["completed"] == 9
    turns = {(r.conversation, r.turn): r for r in result.requests}
    for (conversation, turn), r in turns.items():
        if turn:
            assert r.cached_tokens >= turns[conversation, turn - 1].prompt_tokens
    assert result.summary["prompt_tokens_reused"] > result.summary["prompt_tokens"] / 2


def test_chat_workload_without_a_tokenizer_keeps_token_ids(toy_artifact):
    """The benchmark presets carry no tokenizer: their conversations are token ids, replies as sampled, so
    each turn reuses the whole turn before it but its last sampled token (never fed back)."""
    runner = Runner(Executor(load_artifact(toy_artifact), ExecutorConfig(num_cells=2000)), None, RunnerConfig())
    try:
        options = RequestsOptions(workload="chat", requests=3, turns=3, system_tokens=30, prompt_tokens=8,
                                  max_new_tokens=5, stagger_ms=2)
        result = drive_runner(runner, options)
    finally:
        runner.close()
    assert result.summary["completed"] == 9
    turns = {(r.conversation, r.turn): r for r in result.requests}
    for (conversation, turn), r in turns.items():
        if turn:
            before = turns[conversation, turn - 1]
            assert r.prompt_tokens == before.prompt_tokens + 5 + 8
            assert r.cached_tokens == before.prompt_tokens + 5 - 1
        else:
            assert r.prompt_tokens == 30 + 8


def test_chat_script_sizes_text_in_tokens(tiny_artifact):
    from pt2serve.bench.conversations import chat_script
    from pt2serve.runtime.engine import read_tokenizer

    tokenizer = read_tokenizer(tiny_artifact)
    options = RequestsOptions(workload="chat", requests=2, turns=2, system_tokens=50, prompt_tokens=20)
    script = chat_script(options, tokenizer)
    count = [len(tokenizer.encode(text, add_bos=False)) for text in [script.system, *sum(script.users, [])]]
    assert 50 - 10 < count[0] <= 50 and all(20 - 10 < n <= 20 for n in count[1:])  # a word is a few bytes
    assert script.users[0] != script.users[1]
    messages = script.messages(1, ["the first reply"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == script.users[1][1]


def test_arrivals_and_summary():
    stagger = arrival_times(RequestsOptions(requests=4, stagger_ms=250))
    assert stagger == [0.0, 0.25, 0.5, 0.75]
    poisson = arrival_times(RequestsOptions(requests=50, request_rate=10, seed=1))
    assert poisson[0] == 0 and all(b >= a for a, b in zip(poisson, poisson[1:]))
    assert poisson == arrival_times(RequestsOptions(requests=50, request_rate=10, seed=1))
    assert 2 < poisson[-1] < 10  # ~49 gaps of mean 0.1 s
    timings = [RequestTiming(0, 0, 4, submit=0.0, first_token=0.1, end=0.5, output_tokens=5),
               RequestTiming(1, 0, 4, submit=0.2, first_token=0.4, end=1.0, output_tokens=1),
               RequestTiming(2, 0, 4, submit=0.3, error="boom")]
    s = summarise(timings)
    assert s["completed"] == 2 and s["failed"] == 1 and s["output_tokens"] == 6
    assert s["duration_seconds"] == pytest.approx(1.0)
    assert s["ttft_seconds"]["p50"] == pytest.approx(0.15)
    assert s["tpot_seconds"]["count"] == 1 and s["tpot_seconds"]["p50"] == pytest.approx(0.1)  # 0.4 s / 4 gaps
    assert s["e2e_seconds"]["p50"] == pytest.approx(0.65)  # 0.5 and 0.8
    assert s["output_tokens_per_second"] == pytest.approx(6.0)  # 6 tokens from 0.0 to 1.0 s
    assert s["prompt_tokens_per_second"] == pytest.approx(8.0)  # two completed 4-token prompts in 1.0 s


# -- the URL client -----------------------------------------------------------------------------------------


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `max_tokens` OpenAI completion chunks over SSE; the last one carries finish_reason."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    bodies: list[dict] = []
    send_usage = True

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, value: dict) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.path != "/v1/completions" or not isinstance(body.get("prompt"), list):
            self._json(400, {"error": {"message": "bad request"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]

        def event(value) -> None:
            self.wfile.write(f"data: {json.dumps(value) if not isinstance(value, str) else value}\n\n".encode())
            self.wfile.flush()

        for i in range(n):
            time.sleep(0.003)
            finish = "length" if i == n - 1 else None
            event({"id": "c", "object": "text_completion", "model": body["model"],
                   "choices": [{"index": 0, "text": f"t{i}", "finish_reason": finish}]})
        if self.send_usage:
            event({"id": "c", "object": "text_completion", "choices": [],
                   "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": n}})
        event("[DONE]")


@pytest.fixture()
def fake_server():
    FakeOpenAI.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("usage", [True, False])
def test_url_mode_against_a_stand_in_server(fake_server, usage, monkeypatch):
    monkeypatch.setattr(FakeOpenAI, "send_usage", usage)
    options = RequestsOptions(requests=5, prompt_tokens=12, max_new_tokens=4, stagger_ms=2, url=fake_server)
    result = run_requests(None, options)
    assert result.target == fake_server
    assert result.summary["completed"] == 5 and result.summary["output_tokens"] == 20
    for r in result.requests:
        assert r.output_tokens == 4 and r.finish_reason == "length" and r.error is None
        assert 0 <= r.ttft <= r.e2e and r.tpot > 0
    timed = FakeOpenAI.bodies[1:]  # the first is the warm-up request
    assert len(timed) == 5
    for body in timed:
        assert body["stream"] is True and body["max_tokens"] == 4 and body["model"] == "fake-model"
        assert len(body["prompt"]) == 12 and all(isinstance(t, int) for t in body["prompt"])


def test_url_mode_cli_with_json(fake_server, tmp_path):
    out_json = tmp_path / "url.json"
    result = cli("--mode", "requests", "--url", fake_server + "/v1", "--requests", "3", "--max-new-tokens", "3",
                 "--prompt-tokens", "5", "--json", str(out_json))
    assert result.exit_code == 0, result.output
    doc = json.loads(out_json.read_text())
    assert doc["target"] == fake_server and doc["artifact"] is None
    assert doc["summary"]["output_tokens"] == 9


def test_url_mode_against_the_real_server(tiny_artifact, tiny_server):
    options = RequestsOptions(requests=4, prompt_tokens=10, max_new_tokens=6, stagger_ms=5, url=tiny_server, seed=5)
    result = run_requests(tiny_artifact, options)
    assert result.summary["completed"] == 4
    for r in result.requests:
        assert 1 <= r.output_tokens <= 6  # the server does not ignore EOS
        assert 0 <= r.ttft <= r.e2e


def test_url_unreachable_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    result = cli("--mode", "requests", "--url", f"http://127.0.0.1:{port}", "--requests", "1")
    assert result.exit_code != 0
    assert "cannot reach" in result.output and "Traceback" not in result.output


# -- pieces -------------------------------------------------------------------------------------------------


def test_step_shape():
    chunks = [Chunk(np.arange(10), (5,), 9, SamplingParams()),  # a decode at position 9: context 10
              Chunk(np.arange(4), (1, 2, 3, 4), 0, None)]  # a 4-token prefill piece
    shape = StepShape.of(chunks)
    assert (shape.width, shape.num_chunks, shape.num_sampled) == (5, 2, 1)
    assert shape.context_cells == 14  # 10 + 4
    assert shape.attention_pairs == 20  # the decode sees 10; the prefill tokens 1, 2, 3, 4


def test_row_plans(tiny_artifact):
    raw = read_metadata(tiny_artifact).raw
    decode = plan_row(64, 8, SweepOptions(), raw, 4096)
    assert (decode.kind, decode.num_decode, decode.backlog_requests) == ("decode", 64, 0)
    assert 64 * (decode.prompt_tokens + decode.max_new_tokens) <= 4096
    mixed = plan_row(128, 8, SweepOptions(decode_cap=16, prefill_chunk=50), raw, 4096)
    assert (mixed.kind, mixed.num_decode, mixed.backlog_prompt_tokens) == ("mixed", 16, 50)
    assert mixed.backlog_requests * 50 >= 2 * (128 - 16)
    with pytest.raises(Pt2ServeError, match="KV pool"):
        plan_row(64, 8, SweepOptions(), raw, 200)
    with pytest.raises(Pt2ServeError, match="max context"):
        plan_row(4, 250, SweepOptions(), raw, 4096)
    long = plan_row(4, 200, SweepOptions(), raw, 4096)
    assert (long.prompt_tokens, long.num_decode) == (200, 4)
    assert row_keys(SweepOptions(tokens=(1, 4), contexts=(8, 200)), 128) == [(1, 8), (4, 8), (1, 200), (4, 200)]
    with pytest.raises(Pt2ServeError, match="--context must be positive"):
        SweepOptions(contexts=(8, 0)).check()
    assert resolve_tokens(None, 128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert resolve_tokens(None, 100) == (1, 2, 4, 8, 16, 32, 64)
    assert parse_tokens(" 4, 1 ,8") == (4, 1, 8)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "fast"], "unknown --mode"),
        (["--tokens", "1,x"], "positive integers"),
        (["--tokens", "0,4"], "positive integers"),
        (["--tokens", ""], "--tokens is empty"),
        (["--tokens", "64,129"], "max_step_tokens (128)"),
        (["--iters", "0"], "--iters must be at least 1"),
        (["--warmup", "-1"], "--warmup"),
        (["--decode-cap", "0"], "--decode-cap"),
        (["--prefill-chunk", "256"], "max context"),
        (["--num-cells", "1"], "--num-cells"),
        (["--mode", "sweep", "--url", "http://127.0.0.1:9"], "do not apply to --mode sweep"),
        (["--mode", "requests", "--tokens", "4"], "do not apply to --mode requests"),
        (["--mode", "requests", "--stagger-ms", "1", "--request-rate", "2"], "not both"),
        (["--mode", "requests", "--request-rate", "0"], "--request-rate"),
        (["--mode", "requests", "--requests", "0"], "--requests"),
        (["--mode", "requests", "--prompt-tokens", "200", "--max-new-tokens", "100"], "max context"),
        (["--mode", "requests", "--url", "ftp://x"], "--url must start with"),
    ],
)
def test_bad_flags_are_clear_errors(tiny_artifact, args, message):
    result = cli(str(tiny_artifact), *args)
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_missing_artifact_and_no_artifact(tmp_path):
    result = cli(str(tmp_path / "nope.pt2"))
    assert result.exit_code != 0 and "does not exist" in result.output and "Traceback" not in result.output
    result = cli("--mode", "requests")
    assert result.exit_code != 0 and "give the artifact" in result.output


def test_plot_without_matplotlib_is_a_clear_error(tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = cli(str(tiny_artifact), "--tokens", "1", "--plot", str(tmp_path / "x.png"))
    assert result.exit_code != 0 and "needs matplotlib" in result.output
    assert not (tmp_path / "x.png").exists()
