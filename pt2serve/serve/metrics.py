"""Prometheus metrics on a private registry: request counters and latency histograms, updated as requests
finish; runner gauges read from `runner.stats`, device memory and the process's own (RSS, CPU, open
files) read when /metrics is scraped."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pt2serve.runtime.runner import Runner, RunnerStats

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, runner: Callable[[], Runner | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("pt2serve_requests", "Requests that ended, by finish reason.", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("pt2serve_requests_rejected", "Requests answered with an error status before "
                                "running, by status code.", ["status"], registry=r)
        self.prompt_tokens = Counter("pt2serve_prompt_tokens", "Prompt tokens of ended requests.", registry=r)
        self.cached_tokens = Counter("pt2serve_cached_prompt_tokens", "Prompt tokens whose KV another request "
                                     "computed (the prefix cache, or the first of n choices).", registry=r)
        self.completion_tokens = Counter("pt2serve_completion_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("pt2serve_time_to_first_token_seconds", "From receiving a request to its first "
                              "token.", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pt2serve_time_per_output_token_seconds", "Mean time between a request's tokens "
                              "after the first.", buckets=TPOT_BUCKETS, registry=r)
        r.register(_RunnerCollector(runner))
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends (Linux)

    def request_finished(self, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                         completion_tokens: int, ttft: float | None, tpot: float | None) -> None:
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.completion_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def request_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RunnerCollector(Collector):
    """The runner's current state, read at scrape time (zeros while the model loads)."""

    _GAUGES = (
        ("pt2serve_requests_waiting", "Requests queued for their first step (or preempted).", "num_waiting"),
        ("pt2serve_requests_running", "Sequences holding KV cells.", "num_running"),
        ("pt2serve_kv_cells_used", "KV cells in use (by requests, and by the prefix cache).", "cells_used"),
        ("pt2serve_kv_cells_free", "KV cells free.", "cells_free"),
        ("pt2serve_kv_cells_leaked", "KV cells in use that no request or prefix-cache node holds, "
         "counted while idle (0 unless cells leak).", "cells_leaked"),
        ("pt2serve_prefix_cache_cells", "KV cells held only by the prefix cache for reuse (freed as steps need "
         "them).", "prefix_cache_cells"),
        ("pt2serve_prefix_cache_hit_rate", "Share of the tokens of admitted requests whose KV cells another request "
         "computed (reused through the prefix cache), since start; a request resumed after a preemption "
         "counts once.", "prefix_cache_hit_rate"),
    )
    _COUNTERS = (
        ("pt2serve_engine_steps", "Steps the engine ran (each one batch of decodes and prompt chunks).", "num_steps"),
        ("pt2serve_preemptions", "Running requests whose cells were taken to make room (recomputed later).",
         "num_preemptions"),
        ("pt2serve_spec_draft_tokens", "Speculative decoding: drafted tokens verified.", "draft_tokens"),
        ("pt2serve_spec_accepted_tokens", "Speculative decoding: drafted tokens accepted.", "accepted_tokens"),
        ("pt2serve_spec_verify_steps", "Speculative decoding: a request's steps that verified drafts (one per "
         "request and step; each emits its accepted drafts plus one token).", "verify_steps"),
    )
    # torch's caching allocator on the runner's GPU (Runner.device_memory's keys); absent on the CPU, where
    # process RSS tells the story.
    _DEVICE_MEMORY = (
        ("pt2serve_device_memory_allocated_bytes", "Device memory held by tensors.", "allocated"),
        ("pt2serve_device_memory_reserved_bytes", "Device memory reserved by the caching allocator.", "reserved"),
        ("pt2serve_device_memory_peak_reserved_bytes", "Most device memory ever reserved.", "peak_reserved"),
    )

    def __init__(self, runner: Callable[[], Runner | None]) -> None:
        self._runner = runner

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name, help_text, _ in self._GAUGES:
            yield GaugeMetricFamily(name, help_text)
        for name, help_text, _ in self._COUNTERS:
            yield CounterMetricFamily(name, help_text)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        runner = self._runner()
        stats = runner.stats if runner is not None else RunnerStats()
        for name, help_text, attribute in self._GAUGES:
            yield GaugeMetricFamily(name, help_text, value=float(getattr(stats, attribute)))
        for name, help_text, attribute in self._COUNTERS:
            yield CounterMetricFamily(name, help_text, value=float(getattr(stats, attribute)))
        memory = runner.device_memory() if runner is not None else None
        if memory is not None:
            for name, help_text, key in self._DEVICE_MEMORY:
                yield GaugeMetricFamily(name, help_text, value=float(memory[key]))
