"""`pt2serve bench --mode requests --request-rates`: one run of the workload per offered rate, goodput against
latency targets, the steps an in-process run took; in process and against a server, on the tiny artifact (CPU).
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pt2serve.bench import http_client
from pt2serve.bench.options import LatencyTargets, RequestsOptions, parse_rates
from pt2serve.bench.rates import RateSweepResult, run_request_rates
from pt2serve.bench.report import rates_table
from pt2serve.bench.request_timing import RequestsResult, RequestTiming, summarise
from pt2serve.bench.workload import arrival_times
from pt2serve.cli import app
from pt2serve.errors import Pt2ServeError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def hand_timings() -> list[RequestTiming]:
    """Six requests, times in seconds from the start; the last one ends at 1.0 s."""
    return [
        RequestTiming(0, 0.0, 8, submit=0.0, first_token=0.05, end=0.15, output_tokens=11),  # TTFT 50, TPOT 10 ms
        RequestTiming(1, 0.1, 8, submit=0.1, first_token=0.3, end=0.5, output_tokens=11),  # TTFT 200, TPOT 20 ms
        RequestTiming(2, 0.2, 8, submit=0.2, first_token=0.25, end=0.85, output_tokens=11),  # TTFT 50, TPOT 60 ms
        RequestTiming(3, 0.3, 8, submit=0.3, first_token=0.38, end=0.38, output_tokens=1),  # TTFT 80, no TPOT
        RequestTiming(4, 0.4, 8, submit=0.4, error="boom"),  # failed
        RequestTiming(5, 0.5, 8, submit=0.5, first_token=0.55, end=1.0, output_tokens=46),  # TTFT 50, TPOT 10 ms
    ]


def test_goodput_counts_the_requests_within_both_targets():
    tight = LatencyTargets(ttft_ms=100, tpot_ms=15)
    # 0 meets both; 1 misses TTFT; 2 misses TPOT; 3 has one token, so only TTFT counts; 4 failed; 5 meets both.
    assert [t.meets(tight) for t in hand_timings()] == [True, False, False, True, False, True]
    s = summarise(hand_timings(), tight)
    assert s["requests_per_second"] == pytest.approx(5.0)  # 5 completed from 0.0 to 1.0 s
    assert s["goodput"] == {"ttft_target_ms": 100, "tpot_target_ms": 15, "good_requests": 3,
                            "good_fraction": pytest.approx(0.5), "requests_per_second": pytest.approx(3.0)}
    loose = summarise(hand_timings(), LatencyTargets(ttft_ms=250, tpot_ms=70))
    assert loose["goodput"]["good_requests"] == 5 and loose["goodput"]["requests_per_second"] == pytest.approx(5.0)
    none = summarise(hand_timings(), LatencyTargets(ttft_ms=40, tpot_ms=70))
    assert none["goodput"]["good_requests"] == 0 and none["goodput"]["requests_per_second"] == 0


def test_rates_table_rows():
    targets = LatencyTargets(ttft_ms=100, tpot_ms=15)
    runs = []
    for rate, steps in ((2.0, 40), (8.0, 25)):
        options = RequestsOptions(requests=6, request_rate=rate, targets=targets)
        run = RequestsResult("in-process", options, hand_timings(), "cpu", num_steps=steps, mean_step_width=12.5,
                             step_budget={"token_budget": 48, "max_decode_sequences": 48, "min_prefill_chunk": 8})
        run.summary = summarise(run.requests, targets)
        runs.append(run)
    console = Console(width=250, record=True)
    console.print(rates_table(RateSweepResult(RequestsOptions(requests=6, targets=targets), runs)))
    text = console.export_text()
    (header,) = [[cell.strip() for cell in line.split("┃")[1:-1]] for line in text.splitlines() if "┃" in line]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if "│" in line]
    assert header[:5] == ["offered req/s", "req/s", "goodput req/s", "good", "output tok/s"]
    assert header[-2:] == ["steps", "mean width"]
    assert [row[0] for row in rows] == ["2", "8"]
    first = dict(zip(header, rows[0]))
    assert first["req/s"] == "5" and first["goodput req/s"] == "3" and first["good"] == "3/6"
    assert first["output tok/s"] == "80"  # 11 + 11 + 11 + 1 + 46 tokens of the completed requests in 1.0 s
    assert first["TTFT ms"].startswith("50 / ")  # completed TTFTs 50, 50, 50, 80, 200 ms: the median is 50
    assert (first["steps"], first["mean width"]) == ("40", "12.5")
    caption = " ".join(text.split())
    assert "within TTFT 100 ms and TPOT 15 ms" in caption and "token budget 48" in caption


def test_rate_sweep_in_process(tiny_artifact, tmp_path):
    out_json, out_png = tmp_path / "rates.json", tmp_path / "rates.png"
    result = cli(str(tiny_artifact), "--mode", "requests", "--request-rates", "50,400", "--requests", "6",
                 "--prompt-tokens", "16", "--max-new-tokens", "4", "--seed", "2", "--json", str(out_json),
                 "--plot", str(out_png),
                 # Targets no healthy run misses, however loaded the machine running the tests is.
                 "--ttft-target-ms", "60000", "--tpot-target-ms", "10000")
    assert result.exit_code == 0, result.output
    assert "offered req/s" in result.output and "goodput req/s" in result.output
    doc = json.loads(out_json.read_text())
    assert doc["options"]["targets"] == {"ttft_ms": 60000.0, "tpot_ms": 10000.0}
    assert [run["offered_rate"] for run in doc["rates"]] == [50, 400]
    for run in doc["rates"]:
        assert [r["arrival"] for r in run["requests"]] == arrival_times(
            RequestsOptions(requests=6, request_rate=run["offered_rate"], seed=2))
        s = run["summary"]
        assert s["completed"] == 6 and s["output_tokens"] == 24
        for metric in ("ttft_seconds", "tpot_seconds", "e2e_seconds"):
            assert s[metric]["count"] == 6 and s[metric]["p50"] <= s[metric]["p90"] <= s[metric]["p99"]
        assert s["goodput"]["good_requests"] == 6
        # Each request computes its 16 prompt tokens and feeds back 3 of its 4 sampled ones: 6 x 19 tokens.
        assert run["num_steps"] * run["mean_step_width"] == pytest.approx(6 * 19)
        assert run["step_budget"]["token_budget"] >= run["mean_step_width"]
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_rate_sweep_against_a_server(tiny_artifact, tiny_server):
    options = RequestsOptions(requests=4, prompt_tokens=10, max_new_tokens=5, url=tiny_server, seed=1)
    result = run_request_rates(tiny_artifact, options, (40.0, 300.0))
    assert [run.options.request_rate for run in result.runs] == [40.0, 300.0]
    for run in result.runs:
        assert run.target == options.url and run.num_steps is None
        assert run.summary["completed"] == 4 and run.summary["requests_per_second"] > 0
        assert [t.arrival for t in run.requests] == arrival_times(
            RequestsOptions(requests=4, request_rate=run.options.request_rate, seed=1))
    # Each run's own prompts: the second finds none of the first's in the server's prefix cache (with the same
    # prompts it reused 4 x 9 of their 40 tokens).
    assert result.runs[1].summary["prompt_tokens_reused"] < 10


def test_requests_through_a_server_run_as_in_process():
    """Greedy, and every token to max_tokens: a server's default temperature would sample (a slower step)."""
    body = http_client._completion("m", [1, 2], 7)
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["max_tokens"] == 7


def test_parse_rates():
    assert parse_rates("0.5, 2,8") == (0.5, 2.0, 8.0)
    for text, message in (("", "is empty"), ("1,x", "comma-separated positive numbers"), ("0,1", "positive"),
                          ("inf", "positive")):
        with pytest.raises(Pt2ServeError, match=message):
            parse_rates(text)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--request-rates", "1,0"], "--request-rates must be positive"),
        (["--request-rates", "1", "--request-rate", "2"], "not both"),
        (["--request-rates", "1", "--stagger-ms", "2"], "not both"),
        (["--ttft-target-ms", "0"], "--ttft-target-ms must be a positive number"),
        (["--tpot-target-ms", "-5"], "--tpot-target-ms must be a positive number"),
        (["--url", "http://127.0.0.1:9", "--token-budget", "8"], "only apply to in-process runs"),
        (["--url", "http://127.0.0.1:9", "--num-cells", "64"], "only apply to in-process runs"),
        (["--url", "http://127.0.0.1:9", "--kv-memory-fraction", "0.5"], "only apply to in-process runs"),
    ],
)
def test_bad_rate_flags_are_clear_errors(tiny_artifact, args, message):
    result = cli(str(tiny_artifact), "--mode", "requests", *args)
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output


def test_rate_flags_belong_to_requests_mode(tiny_artifact):
    for flag, value in (("--request-rates", "1,2"), ("--ttft-target-ms", "50"), ("--max-decode-sequences", "4")):
        result = cli(str(tiny_artifact), "--mode", "sweep", flag, value)
        assert result.exit_code != 0 and f"{flag} do not apply to --mode sweep" in result.output
