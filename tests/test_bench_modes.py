"""The bench modes of one measurement each, on the CPU with the tiny artifact: --mode profile (a decode step's
operators), --mode matmuls (a step's weight matmuls against the bandwidth floor) and --mode startup (the server
from launch to ready). On a GPU the same code times kernels; here the flags' plumbing, the tables and the JSON.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pt2serve.bench.matmul_floor import step_matmuls
from pt2serve.bench.startup import parse_load_line
from pt2serve.cli import app
from pt2serve.runtime.artifact import read_metadata


def cli(*args: str):
    return CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "200"})


def test_profile_mode_lists_the_operators_of_each_width(tiny_artifact, tmp_path):
    out = tmp_path / "profile.json"
    result = cli(str(tiny_artifact), "--mode", "profile", "--tokens", "1,4", "--warmup", "1", "--iters", "2",
                 "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "T=1 (forward_1)" in result.output and "T=4 (forward_4)" in result.output
    assert "ms of operators per step" in result.output
    doc = json.loads(out.read_text())
    assert doc["mode"] == "profile" and doc["context"] == 64 and doc["timer"] == "operators (self CPU time)"
    assert doc["options"] == {"tokens": [1, 4], "warmup": 1, "iters": 2}
    assert doc["num_cells"] == 4 * (64 + 1 + 2 + 1) + 1  # a pool just big enough: 4 sequences and the scratch cell
    for row, width in zip(doc["rows"], (1, 4)):
        assert row["tokens"] == width and row["methods"] == [f"forward_{width}"]  # static methods, no graphs
        assert row["ms_per_step"] > 0 and row["kernels_per_step"] > 0
        assert 0 < len(row["top"]) <= 16
        assert sum(k["share"] for k in row["top"]) <= 1.0 + 1e-9
        assert row["top"] == sorted(row["top"], key=lambda k: -k["ms_per_step"])


def test_matmuls_mode_times_every_weight_matmul_against_the_floor(tiny_artifact, tmp_path):
    out = tmp_path / "matmuls.json"
    result = cli(str(tiny_artifact), "--mode", "matmuls", "--tokens", "1,8", "--iters", "2", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "% of floor" in result.output and "Triton calls" in result.output
    doc = json.loads(out.read_text())
    cfg = read_metadata(tiny_artifact).raw["model_config"]
    assert doc["num_matmuls"] == 4 * cfg["num_layers"] + 1 == len(step_matmuls(cfg))
    q, kv = cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"]
    hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
    params = cfg["num_layers"] * ((q + 2 * kv) * hidden + hidden * q + 2 * inner * hidden + hidden * inner)
    assert doc["weight_bytes"] == 4 * (params + cfg["vocab_size"] * hidden)  # fp32
    assert doc["floor_ms"] == pytest.approx(doc["weight_bytes"] / doc["bandwidth"] * 1e3)
    assert [row["tokens"] for row in doc["rows"]] == [1, 8]
    for row in doc["rows"]:
        # A CPU export chose no Triton kernel: the chosen way is the plain one.
        assert row["plain_ms"] > 0 and row["chosen_ms"] == row["plain_ms"] and row["num_chosen"] == 0


def test_startup_mode_times_the_server_from_launch_to_ready(tiny_artifact, tmp_path):
    out = tmp_path / "startup.json"
    result = cli(str(tiny_artifact), "--mode", "startup", "--runs", "1", "--num-cells", "600", "--token-budget",
                 "32", "--timeout", "240", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["mode"] == "startup"
    command = doc["command"]
    assert command[command.index("--num-cells") + 1] == "600" and command[command.index("--token-budget") + 1] == "32"
    (run,) = doc["runs"]
    assert run["flags"] == [] and run["exit_code"] == 0  # stopped by SIGINT, cleanly
    assert run["ready_seconds"] > 0 and run["server_ready_seconds"] > 0
    assert run["load_seconds"] <= run["server_ready_seconds"]
    assert set(run["parts"]) == {"weights", "methods", "binding", "KV pool", "graph capture"}
    assert "599 tokens" in run["load_line"] and "steps of up to 32 tokens" in run["load_line"]  # the flags reached it


def test_the_load_line_parses_with_and_without_the_launch_time():
    line = ("loaded in 9.1 s on cuda:0 (weights 3.30 s at 4.9 GB/s, methods 4.10 s beside them, binding 0.40 s, "
            "KV pool 0.20 s, graph capture 1.20 s): weights 16.06 GB, KV pool 90.00 GB for 700,000 tokens")
    parsed = parse_load_line("INFO: started\n" + line + "; ready 21.0 s after launch\n")
    assert parsed["total"] == 9.1 and parsed["ready"] == 21.0 and parsed["rate"] == "4.9 GB/s"
    assert parsed["parts"] == {"weights": 3.3, "methods": 4.1, "binding": 0.4, "KV pool": 0.2, "graph capture": 1.2}
    assert parse_load_line(line.replace("4.9 GB/s", "91.0 MB/s"))["ready"] is None
    assert parse_load_line("serving tiny at http://127.0.0.1:8000/v1 (ready)") is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "profile", "--url", "http://127.0.0.1:9"], "--url do not apply to --mode profile"),
        (["--mode", "profile", "--context", "100"], "--context do not apply to --mode profile"),
        (["--mode", "profile", "--tokens", "0"], "positive integers"),
        (["--mode", "profile", "--iters", "0"], "--iters must be at least 1"),
        (["--mode", "matmuls", "--token-budget", "64"], "--token-budget do not apply to --mode matmuls"),
        (["--mode", "matmuls", "--iters", "0"], "--iters must be at least 1"),
        (["--mode", "startup", "--tokens", "4"], "--tokens do not apply to --mode startup"),
        (["--mode", "startup", "--runs", "0"], "--runs must be at least 1"),
        (["--mode", "sweep", "--runs", "2"], "--runs do not apply to --mode sweep"),
        (["--mode", "requests", "--runs", "2"], "--runs do not apply to --mode requests"),
    ],
)
def test_bad_flags_of_the_measurement_modes_are_clear_errors(tiny_artifact, args, message):
    result = cli(str(tiny_artifact), *args)
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output
