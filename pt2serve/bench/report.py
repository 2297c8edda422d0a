"""Presenting results: a rich table, the JSON document, and a PNG plot."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from pt2serve.bench.environment import artifact_summary, machine_info, versions
from pt2serve.bench.quality import QualityResult
from pt2serve.bench.rates import RateSweepResult
from pt2serve.bench.request_timing import RequestsResult
from pt2serve.bench.sweep import SweepResult, SweepRow
from pt2serve.errors import Pt2ServeError


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ms(seconds: float | None) -> str:
    return _num(None if seconds is None else seconds * 1e3)


def _workload(row: SweepRow) -> str:
    if row.kind == "decode":
        return f"{row.num_decode} decode"
    return f"{row.num_decode} decode + {row.tokens - row.num_decode} prefill ({row.backlog_prompt_tokens}-tok prompts)"


def sweep_table(result: SweepResult, title: str | None = None) -> Table:
    limits = result.limits
    caption = (f"limit on {limits.device}: memory {limits.memory_bandwidth / 1e9:.1f} GB/s, "
               f"matmul ({limits.dtype}) {limits.matmul_flops / 1e12:.3g} TFLOP/s; "
               "% of limit = limit / step interval; KV / attn: the limit's KV-cell and attention terms alone; "
               "eager: the same step in uncompiled PyTorch")
    table = Table(title=title or "pt2serve bench: sweep", caption=caption)
    for name in ("T", "context", "workload", "method", "exec ms", "step ms", "tok/s", "limit ms", "bound",
                 "KV ms", "attn ms", "limit tok/s", "% of limit", "eager ms", "x eager", "flags"):
        table.add_column(name, justify="left" if name in ("workload", "method", "bound", "flags") else "right")
    for row in result.rows:
        percent = "-" if row.fraction_of_limit is None else f"{row.fraction_of_limit * 100:.1f}%"
        kv = None if row.kv_bytes is None else row.kv_bytes / limits.memory_bandwidth
        attention = None if row.attention_flops is None else row.attention_flops / limits.matmul_flops
        table.add_row(
            str(row.tokens), str(row.context), _workload(row), ",".join(row.methods) or "-", _ms(row.executor_seconds),
            _ms(row.interval_seconds), _num(row.tokens_per_second), _ms(row.limit_seconds), row.bound or "-",
            _ms(kv), _ms(attention),
            _num(row.limit_tokens_per_second), percent, _ms(row.eager_seconds),
            "-" if row.speedup_over_eager is None else f"{row.speedup_over_eager:.2g}x",
            "; ".join(row.flags) if row.flags else "ok",
            style="red" if row.flags else None,
        )
    return table


def requests_table(result: RequestsResult, title: str | None = None) -> Table:
    s = result.summary
    caption = (f"{s['completed']}/{s['requests']} completed, {s['output_tokens']} output tokens in "
               f"{_num(s['duration_seconds'])} s: {_num(s['output_tokens_per_second'])} output tok/s, "
               f"{_num(s['requests_per_second'])} req/s, {_num(s['prompt_tokens_per_second'])} computed prompt "
               f"tok/s ({result.target}); {_prompt_tokens(s)}; "
               f"{_goodput(s)}{_steps(result)}{_speculation(result)}{_client_cpu(s)}")
    table = Table(title=title or "pt2serve bench: requests", caption=caption)
    for name in ("metric", "p50 ms", "p90 ms", "p99 ms", "mean ms", "max ms", "n"):
        table.add_column(name, justify="left" if name == "metric" else "right")
    rows = [("TTFT", "ttft_seconds"), ("TPOT", "tpot_seconds"), ("E2E", "e2e_seconds")]
    if "ttft_first_turns_seconds" in s:  # the chat workload
        rows[1:1] = [("TTFT, first turns", "ttft_first_turns_seconds"),
                     ("TTFT, later turns", "ttft_later_turns_seconds")]
    for label, key in rows:
        d = s[key]
        table.add_row(label, _ms(d["p50"]), _ms(d["p90"]), _ms(d["p99"]), _ms(d["mean"]), _ms(d["max"]),
                      str(d["count"]))
    return table


def _client_cpu(s: dict[str, Any]) -> str:
    """Through a server: the client's CPU over the load (near its duration: the client limits the numbers)."""
    cpu, duration = s.get("client_cpu_seconds"), s.get("duration_seconds")
    if cpu is None or not duration:
        return ""
    return f"; the client's CPU {cpu:.2f} s ({cpu / duration:.0%} of a core over the load)"


def rates_table(result: RateSweepResult, title: str | None = None) -> Table:
    """One row per offered rate: what came out, goodput, and the latency percentiles."""
    o = result.options
    caption = (f"each rate: {o.requests} requests of {o.prompt_tokens} prompt + {o.max_new_tokens} new tokens, "
               f"Poisson arrivals ({result.target}); goodput: requests within TTFT {o.targets.ttft_ms:g} ms and "
               f"TPOT {o.targets.tpot_ms:g} ms, per second; latencies in ms as p50 / p90 / p99")
    in_process = result.runs[0].num_steps is not None
    if in_process:
        caption += f"; token budget {result.runs[0].step_budget['token_budget']}"
    table = Table(title=title or "pt2serve bench: request rates", caption=caption)
    columns = ["offered req/s", "req/s", "goodput req/s", "good", "output tok/s", "TTFT ms", "TPOT ms", "E2E ms"]
    for name in columns + (["steps", "mean width"] if in_process else []):
        table.add_column(name, justify="right")
    for run in result.runs:
        s, good = run.summary, run.summary["goodput"]
        cells = [f"{run.options.request_rate:g}", _num(s["requests_per_second"]), _num(good["requests_per_second"]),
                 f"{good['good_requests']}/{s['requests']}", _num(s["output_tokens_per_second"]),
                 *(_percentiles(s[key]) for key in ("ttft_seconds", "tpot_seconds", "e2e_seconds"))]
        if in_process:
            cells += [str(run.num_steps), _num(run.mean_step_width)]
        table.add_row(*cells, style="red" if s["failed"] else None)
    return table


def _percentiles(d: dict[str, Any]) -> str:
    return " / ".join(_ms(d[p]) for p in ("p50", "p90", "p99"))


def _prompt_tokens(s: dict[str, Any]) -> str:
    if s["prompt_tokens_reused"] is None:
        return f"{s['prompt_tokens']:,} prompt tokens"
    share = s["prompt_tokens_reused"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
    return (f"{s['prompt_tokens']:,} prompt tokens: {s['prompt_tokens_computed']:,} computed, "
            f"{s['prompt_tokens_reused']:,} reused ({share:.0%})")


def _goodput(s: dict[str, Any]) -> str:
    good = s["goodput"]
    return (f"goodput {_num(good['requests_per_second'])} req/s ({good['good_requests']}/{s['requests']} within "
            f"TTFT {good['ttft_target_ms']:g} ms and TPOT {good['tpot_target_ms']:g} ms)")


def _steps(result: RequestsResult) -> str:
    if result.num_steps is None:
        return ""
    budget = result.step_budget or {}
    return (f"; {result.num_steps} steps, mean width {_num(result.mean_step_width)} tokens (token budget "
            f"{budget.get('token_budget', '-')}, up to {budget.get('max_decode_sequences', '-')} decodes)")


def _speculation(result: RequestsResult) -> str:
    spec = result.speculation
    if spec is None:
        return ""
    rate = f"{spec['acceptance_rate']:.0%}" if spec["acceptance_rate"] is not None else "-"
    return (f"; speculation: {spec['accepted_tokens']:,} of {spec['draft_tokens']:,} drafted tokens accepted ({rate}), "
            f"{_num(spec['accepted_per_step'])} accepted tokens per verifying step")


def sweep_document(result: SweepResult, artifact: str | None, raw: dict[str, Any] | None,
                   flags: dict[str, Any]) -> dict[str, Any]:
    return {
        **_header("sweep", artifact, raw, result.device, flags),
        "options": _plain(result.options.__dict__),
        "num_cells": result.num_cells,
        "limits": result.limits.to_dict(),
        "model_cost": result.model_cost.to_dict(),
        "seconds": result.seconds,
        "rows": [row.to_dict() for row in result.rows],
    }


def requests_document(result: RequestsResult, artifact: str | None, raw: dict[str, Any] | None,
                      flags: dict[str, Any]) -> dict[str, Any]:
    return {
        **_header("requests", artifact, raw, result.device, flags),
        "options": _plain(asdict(result.options)),
        **_run(result),
    }


def rates_document(result: RateSweepResult, artifact: str | None, raw: dict[str, Any] | None,
                   flags: dict[str, Any]) -> dict[str, Any]:
    return {
        **_header("requests", artifact, raw, result.device, flags),
        "options": _plain(asdict(result.options)),
        "target": result.target,
        "rates": [{"offered_rate": run.options.request_rate, **_run(run)} for run in result.runs],
    }


def _run(result: RequestsResult) -> dict[str, Any]:
    return {
        "target": result.target,
        "num_steps": result.num_steps,
        "mean_step_width": result.mean_step_width,
        "step_budget": result.step_budget,
        "num_cells": result.num_cells,
        "speculation": result.speculation,
        "summary": result.summary,
        "requests": [r.to_dict() for r in result.requests],
    }


def quality_table(result: QualityResult, title: str | None = None) -> Table:
    caption = (f"{result.positions} generated positions (the reference's greedy continuation, fed to both); "
               "KL(reference || artifact) of next-token distributions, nats")
    table = Table(title=title or "pt2serve bench: quality", caption=caption)
    for name in ("positions", "top-1 agreement", "mean KL", "max KL", "prompts agreeing throughout"):
        table.add_column(name, justify="right")
    table.add_row(str(result.positions), f"{result.top1_agreement * 100:.2f}%", f"{result.mean_kl:.3g}",
                  f"{result.max_kl:.3g}", str(result.prompts_fully_agreeing))
    return table


def quality_document(result: QualityResult, artifact: str, raw: dict[str, Any] | None,
                     flags: dict[str, Any]) -> dict[str, Any]:
    return {**_header("quality", artifact, raw, result.device, flags), "result": result.to_dict()}


def document_header(mode: str, artifact: str | None, raw: dict[str, Any] | None, device: str | None,
                    flags: dict[str, Any]) -> dict[str, Any]:
    """The fields every mode's JSON document starts with (the modes in their own files use it too)."""
    return _header(mode, artifact, raw, device, flags)


def _header(mode: str, artifact: str | None, raw: dict[str, Any] | None, device: str | None,
            flags: dict[str, Any]) -> dict[str, Any]:
    return {
        "mode": mode,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device),
        "versions": versions(),
        "artifact": artifact_summary(artifact, raw),
        "flags": _plain(flags),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(document: dict[str, Any], path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")
    except OSError as err:
        raise Pt2ServeError(f"cannot write {path}: {err}") from None


def check_plot_support() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise Pt2ServeError("--plot needs matplotlib: pip install 'pt2serve[plot]' (or pip install matplotlib)") from None


def _pyplot():
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(result: SweepResult, path: Path, title: str) -> None:
    plt = _pyplot()
    rows = [r for r in result.rows if r.tokens_per_second is not None]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    contexts = sorted({r.context for r in rows})
    for context in contexts:  # one set of lines per context (one context: the labels as they always read)
        at = [r for r in rows if r.context == context]
        suffix = f", context {context:,}" if len(contexts) > 1 else ""
        ts = [r.tokens for r in at]
        measured, = ax.plot(ts, [r.tokens_per_second for r in at], "o-", label=f"measured (T / step interval){suffix}")
        ax.plot(ts, [r.executor_tokens_per_second for r in at], ".--", alpha=0.6, color=measured.get_color(),
                label=f"executor only (T / executor time){suffix}")
        ax.plot(ts, [r.limit_tokens_per_second for r in at], "s:", color="black" if len(contexts) == 1
                else measured.get_color(), label=f"physical limit (T / limit){suffix}")
        eager = [r for r in at if r.eager_seconds is not None]
        if eager:
            ax.plot([r.tokens for r in eager], [r.tokens / r.eager_seconds for r in eager], "^-.", color="tab:gray",
                    label=f"eager PyTorch peer (T / eager time){suffix}")
    flagged = [r for r in rows if r.flags]
    if flagged:
        ax.plot([r.tokens for r in flagged], [r.tokens_per_second for r in flagged], "x", color="red",
                markersize=10, label="flagged row")
    ts = sorted({r.tokens for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ts, [str(t) for t in ts])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("step width T (tokens per step)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, plt, path)


def plot_requests(result: RequestsResult, path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, max(3, min(12, 0.15 * len(result.requests) + 2))), dpi=120)
    for r in result.requests:
        if r.submit is None:
            continue
        if r.first_token is not None:
            ax.plot([r.submit, r.first_token], [r.index, r.index], color="tab:orange", linewidth=2)
        if r.first_token is not None and r.end is not None:
            ax.plot([r.first_token, r.end], [r.index, r.index], color="tab:blue", linewidth=2)
        if r.error is not None:
            ax.plot([r.submit], [r.index], "x", color="red")
    ax.plot([], [], color="tab:orange", label="waiting for the first token (TTFT)")
    ax.plot([], [], color="tab:blue", label="generating")
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("request")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    _save(fig, plt, path)


def plot_rates(result: RateSweepResult, path: Path, title: str) -> None:
    """Throughput and latency percentiles against the offered rate: where the target saturates."""
    plt = _pyplot()
    runs = result.runs
    rates = [run.options.request_rate for run in runs]
    targets = result.options.targets
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), dpi=120, sharex=True)
    ax = axes[0][0]
    ax.plot(rates, rates, ":", color="gray", label="offered")
    ax.plot(rates, [run.summary["requests_per_second"] for run in runs], "o-", label="achieved")
    ax.plot(rates, [run.summary["goodput"]["requests_per_second"] for run in runs], "s--", label="goodput")
    ax.set_ylabel("requests / s")
    ax.legend()
    ax = axes[0][1]
    ax.plot(rates, [run.summary["output_tokens_per_second"] for run in runs], "o-")
    ax.set_ylabel("output tokens / s")
    for ax, key, label, target in ((axes[1][0], "ttft_seconds", "TTFT", targets.ttft_ms),
                                   (axes[1][1], "tpot_seconds", "TPOT", targets.tpot_ms)):
        for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            values = [run.summary[key][p] for run in runs]
            ax.plot(rates, [None if v is None else v * 1e3 for v in values], style, label=p)
        ax.axhline(target, color="red", alpha=0.5, label="target")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_yscale("log")
        ax.legend()
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{rate:g}" for rate in rates])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("offered rate (requests / s, Poisson)")
    fig.suptitle(title)
    _save(fig, plt, path)


def _save(fig, plt, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, format="png")
    except OSError as err:
        raise Pt2ServeError(f"cannot write {path}: {err}") from None
    finally:
        plt.close(fig)
