"""Presenting results: a rich table, the JSON document, and a PNG plot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from pt2serve.bench.environment import artifact_summary, machine_info, versions
from pt2serve.bench.quality import QualityResult
from pt2serve.bench.requests_mode import RequestsResult
from pt2serve.bench.sweep import SweepResult, SweepRow
from pt2serve.errors import Pt2ServeError


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _workload(row: SweepRow) -> str:
    if row.kind == "decode":
        return f"{row.num_decode} decode"
    return f"{row.num_decode} decode + {row.tokens - row.num_decode} prefill ({row.backlog_prompt_tokens}-tok prompts)"


def sweep_table(result: SweepResult, title: str | None = None) -> Table:
    limits = result.limits
    caption = (f"limit on {limits.device}: memory {limits.memory_bandwidth / 1e9:.1f} GB/s, "
               f"matmul ({limits.dtype}) {limits.matmul_flops / 1e12:.3g} TFLOP/s; "
               "% of limit = limit / step interval; eager: the same step in uncompiled PyTorch")
    table = Table(title=title or "pt2serve bench: sweep", caption=caption)
    for name in ("T", "workload", "method", "exec ms", "step ms", "tok/s", "limit ms", "bound", "limit tok/s",
                 "% of limit", "eager ms", "x eager", "flags"):
        table.add_column(name, justify="left" if name in ("workload", "method", "bound", "flags") else "right")
    for row in result.rows:
        percent = "-" if row.fraction_of_limit is None else f"{row.fraction_of_limit * 100:.1f}%"
        table.add_row(
            str(row.tokens), _workload(row), ",".join(row.methods) or "-", _ms(row.executor_seconds),
            _ms(row.interval_seconds), _num(row.tokens_per_second), _ms(row.limit_seconds), row.bound or "-",
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
               f"{_num(s['requests_per_second'])} req/s ({result.target})")
    table = Table(title=title or "pt2serve bench: requests", caption=caption)
    for name in ("metric", "p50 ms", "p90 ms", "p99 ms", "mean ms", "max ms", "n"):
        table.add_column(name, justify="left" if name == "metric" else "right")
    for label, key in (("TTFT", "ttft_seconds"), ("TPOT", "tpot_seconds"), ("E2E", "e2e_seconds")):
        d = s[key]
        table.add_row(label, _ms(d["p50"]), _ms(d["p90"]), _ms(d["p99"]), _ms(d["mean"]), _ms(d["max"]),
                      str(d["count"]))
    return table


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
        "options": _plain(result.options.__dict__),
        "target": result.target,
        "num_steps": result.num_steps,
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
    ts = [r.tokens for r in rows]
    ax.plot(ts, [r.tokens_per_second for r in rows], "o-", label="measured (T / step interval)")
    ax.plot(ts, [r.executor_tokens_per_second for r in rows], ".--", alpha=0.6, label="executor only (T / executor time)")
    ax.plot(ts, [r.limit_tokens_per_second for r in rows], "s:", color="black", label="physical limit (T / limit)")
    eager = [r for r in rows if r.eager_seconds is not None]
    if eager:
        ax.plot([r.tokens for r in eager], [r.tokens / r.eager_seconds for r in eager], "^-.", color="tab:gray",
                label="eager PyTorch peer (T / eager time)")
    flagged = [r for r in rows if r.flags]
    if flagged:
        ax.plot([r.tokens for r in flagged], [r.tokens_per_second for r in flagged], "x", color="red",
                markersize=10, label="flagged row")
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


def _save(fig, plt, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, format="png")
    except OSError as err:
        raise Pt2ServeError(f"cannot write {path}: {err}") from None
    finally:
        plt.close(fig)
