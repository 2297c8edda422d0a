"""A soak's result: the outcomes by kind, the end-of-run checks, a table and a JSON document.

The server's ledger (from /metrics, counted from just before the traffic to the idle end) must match
what the clients saw:
    requests that ended = answered 200 (+ at most those whose clients left before a status)
    rejections by status >= the clients' (4xx), and in all <= the clients' + those that left
    no request ended with an error; cancelled <= the clients that disconnected on purpose
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.table import Table

from pt2serve.bench.stats import summary
from pt2serve.soak.calls import Outcome
from pt2serve.soak.options import SoakOptions
from pt2serve.soak.replay import SampledReplay
from pt2serve.soak.watch import HealthLog, MemoryLog, Metrics

MB = 1e6


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class SoakReport:
    options: SoakOptions
    model: str
    traffic_s: float
    outcomes: list[Outcome]
    health: HealthLog
    memory: MemoryLog
    before: Metrics
    after: Metrics
    idle_wait_s: float
    sampled: SampledReplay
    checks: list[Check] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.checks = _checks(self)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def by_kind(self) -> dict[str, dict[str, Any]]:
        kinds: dict[str, list[Outcome]] = defaultdict(list)
        for outcome in self.outcomes:
            kinds[outcome.kind].append(outcome)
        rows = {}
        for kind in sorted(kinds):
            outcomes = kinds[kind]
            problems = [o.problem for o in outcomes if o.problem]
            rows[kind] = {
                "requests": len(outcomes),
                "statuses": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
                "problems": len(problems),
                "some_problems": problems[:3],
                "cached_tokens": sum(o.cached_tokens for o in outcomes),
                "latency_s": summary(o.latency_s for o in outcomes),
                "ttft_s": summary(o.ttft_s for o in outcomes),
            }
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "options": asdict(self.options) | {"api_key": "***" if self.options.api_key else None},
            "model": self.model,
            "passed": self.passed,
            "requests": len(self.outcomes),
            "traffic_seconds": self.traffic_s,
            "idle_wait_seconds": self.idle_wait_s,
            "checks": [asdict(check) for check in self.checks],
            "by_kind": self.by_kind(),
            "server": _server_deltas(self.before, self.after),
            "health": asdict(self.health),
            "memory": asdict(self.memory),
            "sampled": asdict(self.sampled),
        }

    def tables(self) -> list[Table]:
        o = self.options
        kinds = Table(title=f"pt2serve soak: {len(self.outcomes)} requests in {self.traffic_s:.0f} s against "
                      f"{o.root} ({self.model}), seed {o.seed}, {o.concurrency} clients")
        for name in ("kind", "requests", "statuses", "problems", "p50 ms", "p99 ms", "p99 TTFT ms", "cached tok"):
            kinds.add_column(name, justify="left" if name in ("kind", "statuses") else "right")
        for kind, row in self.by_kind().items():
            kinds.add_row(kind, str(row["requests"]), " ".join(f"{s}:{n}" for s, n in row["statuses"].items()),
                          str(row["problems"]), _ms(row["latency_s"]["p50"]), _ms(row["latency_s"]["p99"]),
                          _ms(row["ttft_s"]["p99"]), str(row["cached_tokens"]),
                          style="red" if row["problems"] else None)
        checks = Table(title="end-of-run checks", show_header=False)
        for check in self.checks:
            checks.add_row("ok" if check.passed else "FAILED", check.name, check.detail,
                           style=None if check.passed else "red")
        return [kinds, checks]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f}"


def _server_deltas(before: Metrics, after: Metrics) -> dict[str, Any]:
    def delta(name: str, label: str) -> dict[str, float]:
        was = before.labelled(name, label)
        return {key: value - was.get(key, 0.0) for key, value in after.labelled(name, label).items()}

    return {
        "ended_by_finish_reason": delta("pt2serve_requests_total", "finish_reason"),
        "rejected_by_status": delta("pt2serve_requests_rejected_total", "status"),
        "preemptions": after.get("pt2serve_preemptions_total") - before.get("pt2serve_preemptions_total"),
        "running": after.get("pt2serve_requests_running"),
        "waiting": after.get("pt2serve_requests_waiting"),
        "kv_cells_used": after.get("pt2serve_kv_cells_used"),
        "kv_cells_free": after.get("pt2serve_kv_cells_free"),
        "kv_cells_leaked": after.get("pt2serve_kv_cells_leaked"),
    }


def _checks(report: SoakReport) -> list[Check]:
    o, outcomes = report.options, report.outcomes
    server = _server_deltas(report.before, report.after)
    rate = len(outcomes) / report.traffic_s if report.traffic_s else 0.0
    problems = [x for x in outcomes if x.problem]
    statuses = Counter(x.status for x in outcomes)
    server_errors = sum(n for status, n in statuses.items() if status is not None and status >= 500)
    checks = [
        Check("requests", len(outcomes) >= o.min_requests, f"{len(outcomes)} sent ({rate:.1f}/s; at least "
              f"{o.min_requests} wanted)"),
        Check("answers", not problems, f"{len(outcomes) - len(problems)} of {len(outcomes)} as they must be"
              + "".join(f"; {x.kind}: {x.problem}" for x in problems[:3])),
        Check("no 5xx", server_errors == 0, f"{server_errors} answers with a 5xx status"),
        _health_check(report.health, o),
        _ledger_check(outcomes, server),
        Check("idle at the end", server["running"] == 0 and server["waiting"] == 0,
              f"{server['running']:.0f} running, {server['waiting']:.0f} waiting after {report.idle_wait_s:.1f} s"),
        Check("KV cells", server["kv_cells_leaked"] == 0,
              f"{server['kv_cells_leaked']:.0f} leaked; {server['kv_cells_used']:.0f} in use (kept for sessions "
              f"and the prefix cache), {server['kv_cells_free']:.0f} free"),
        Check("load shedding", o.max_queued is None or statuses[429] > 0,
              f"{statuses[429]} answers 429 to bursts of {o.burst_size}"
              + (f" past --max-queued {o.max_queued}" if o.max_queued is not None else "")),
        Check("preemption", not o.expect_preemption or server["preemptions"] > 0,
              f"{server['preemptions']:.0f} requests preempted" + (" (expected some)" if o.expect_preemption else "")),
        _sampled_check(report.sampled, o),
        _memory_check("host RSS", report.memory.baseline_rss, report.memory.max_rss, o.max_rss_growth_mb),
        _memory_check("device memory", report.memory.baseline_device, report.memory.max_device,
                      o.max_device_growth_mb, peak=report.memory.peak_device),
    ]
    return checks


def _sampled_check(replay: SampledReplay, o: SoakOptions) -> Check:
    """Seeded sampled answers under load equal the same requests alone; on a designed preset some depart from
    the greedy design (a sampled request turned greedy would agree with its replay, and depart in none)."""
    if o.sampled_replays == 0:
        return Check("seeded sampling", True, "not checked (--sampled-replays 0)")
    agreed = replay.identical >= o.min_sampled_agreement * replay.replayed
    sampling = o.designed is None or replay.departing > 0
    detail = (f"{replay.identical} of {replay.replayed} replayed alone came back the same (of {replay.recorded} "
              f"seeded sampled answers; {o.min_sampled_agreement:.0%} wanted)")
    if o.designed is not None:
        detail += f"; {replay.departing} of {replay.recorded} depart from the greedy design (some wanted)"
    return Check("seeded sampling", replay.replayed > 0 and agreed and sampling,
                 detail + "".join(f"; {d}" for d in replay.differences))


def _health_check(health: HealthLog, o: SoakOptions) -> Check:
    detail = (f"{health.polls} polls, {health.num_failures} not answered 200 within "
              f"{o.max_health_latency_s:g} s, slowest {health.max_latency_s * 1e3:.0f} ms")
    if health.failures:
        detail += f" ({'; '.join(health.failures)})"
    return Check("/health throughout", health.polls > 0 and health.num_failures == 0, detail)


def _ledger_check(outcomes: list[Outcome], server: dict[str, Any]) -> Check:
    admitted = sum(1 for x in outcomes if x.status == 200)
    unknown = sum(1 for x in outcomes if x.status is None)
    left = sum(1 for x in outcomes if x.left_early and x.status == 200)
    client_rejected = Counter(str(x.status) for x in outcomes if x.status is not None and 400 <= x.status < 500)
    ended = server["ended_by_finish_reason"]
    rejected = server["rejected_by_status"]
    num_ended = sum(ended.values())
    failures = []
    if not admitted <= num_ended <= admitted + unknown:
        failures.append(f"{num_ended:.0f} ended on the server, {admitted} answered 200 (+{unknown} left early)")
    if ended.get("error", 0):
        failures.append(f"{ended['error']:.0f} ended with an error")
    if ended.get("cancelled", 0) > left + unknown:
        failures.append(f"{ended['cancelled']:.0f} cancelled, but only {left + unknown} clients left early")
    for status, count in client_rejected.items():
        if rejected.get(status, 0) < count:
            failures.append(f"{count} answers {status} seen, the server counted {rejected.get(status, 0):.0f}")
    if sum(rejected.values()) > sum(client_rejected.values()) + unknown:
        failures.append(f"the server counted {sum(rejected.values()):.0f} rejections, clients saw "
                        f"{sum(client_rejected.values())}")
    detail = (f"server: {num_ended:.0f} ended ({', '.join(f'{k} {v:.0f}' for k, v in sorted(ended.items()))}), "
              f"{sum(rejected.values()):.0f} rejected; clients: {admitted} answered 200, "
              f"{sum(client_rejected.values())} 4xx, {unknown} left before a status")
    return Check("server ledger", not failures, "; ".join(failures) if failures else detail)


def _memory_check(name: str, baseline: float | None, highest: float, bound_mb: float,
                  peak: float | None = None) -> Check:
    if baseline is None:
        return Check(name, True, "not reported by this server (no GPU)" if name == "device memory" else
                     "no baseline: the run ended within its warm-up")
    growth = highest - baseline
    detail = (f"{baseline / MB:,.0f} MB after warm-up, at most {highest / MB:,.0f} MB (+{growth / MB:,.1f} MB; "
              f"bound +{bound_mb:g} MB)")
    if peak:
        detail += f"; allocator peak {peak / MB:,.0f} MB"
    return Check(name, growth <= bound_mb * MB, detail)
