"""Watching the server while the traffic runs: /health polled throughout, /metrics read as samples.

The server's own numbers (its request ledger, KV cells, preemptions, host RSS, device memory) come from
its Prometheus endpoint, so the checks hold for any deployment the soak can reach.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pt2serve.errors import Pt2ServeError

RSS = "process_resident_memory_bytes"
DEVICE_RESERVED = "pt2serve_device_memory_reserved_bytes"
DEVICE_PEAK = "pt2serve_device_memory_peak_reserved_bytes"


class Metrics(dict):
    """One /metrics scrape: sample value by name, labels as 'name{k="v"}' (sorted), e.g.
    'pt2serve_requests_total{finish_reason="stop"}'."""

    def get(self, key: str, default: float = 0.0) -> float:
        return super().get(key, default)

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """{label value: sample} of one labelled family, e.g. requests by finish_reason."""
        prefix = f'{name}{{{label}="'
        return {key[len(prefix):-2]: value for key, value in self.items() if key.startswith(prefix)}


async def read_metrics(client: httpx.AsyncClient, root: str) -> Metrics:
    reply = await client.get(f"{root}/metrics")
    if reply.status_code != 200:
        raise Pt2ServeError(f"GET {root}/metrics answered {reply.status_code}: {reply.text[:200]}")
    samples = Metrics()
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@dataclass
class HealthLog:
    polls: int = 0
    failures: list[str] = field(default_factory=list)  # the first few, with when they happened
    num_failures: int = 0
    max_latency_s: float = 0.0


async def poll_health(client: httpx.AsyncClient, root: str, interval_s: float, max_latency_s: float,
                      log: HealthLog, stop: asyncio.Event) -> None:
    """GET /health every `interval_s` until `stop`; a poll fails on anything but a 200 within the bound."""
    started = time.perf_counter()
    while not stop.is_set():
        sent = time.perf_counter()
        try:
            reply = await client.get(f"{root}/health", timeout=max_latency_s)
            failure = None if reply.status_code == 200 else f"status {reply.status_code}"
        except httpx.HTTPError as err:
            failure = f"{type(err).__name__}"
        latency = time.perf_counter() - sent
        log.polls += 1
        log.max_latency_s = max(log.max_latency_s, latency)
        if failure is not None:
            log.num_failures += 1
            if len(log.failures) < 5:
                log.failures.append(f"{failure} at {sent - started:.1f} s")
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, interval_s - latency))
        except asyncio.TimeoutError:
            pass


@dataclass
class MemoryLog:
    baseline_rss: float | None = None
    max_rss: float = 0.0
    baseline_device: float | None = None  # None on a CPU server (no device memory metrics)
    max_device: float = 0.0
    peak_device: float = 0.0  # the allocator's own high-water mark
    samples: int = 0

    def add(self, metrics: Metrics) -> None:
        self.samples += 1
        self.max_rss = max(self.max_rss, metrics.get(RSS))
        if DEVICE_RESERVED in metrics:
            self.max_device = max(self.max_device, metrics[DEVICE_RESERVED])
            self.peak_device = max(self.peak_device, metrics.get(DEVICE_PEAK))

    def set_baseline(self, metrics: Metrics) -> None:
        self.baseline_rss = metrics.get(RSS)
        self.baseline_device = metrics[DEVICE_RESERVED] if DEVICE_RESERVED in metrics else None
        self.max_rss, self.max_device = self.baseline_rss, self.baseline_device or 0.0
        self.add(metrics)


async def sample_memory(client: httpx.AsyncClient, root: str, log: MemoryLog, baseline_after_s: float,
                        interval_s: float, stop: asyncio.Event) -> None:
    """After `baseline_after_s` (the warm-up) read the baseline, then sample until `stop`."""
    try:
        await asyncio.wait_for(stop.wait(), baseline_after_s)
        return
    except asyncio.TimeoutError:
        pass
    log.set_baseline(await read_metrics(client, root))
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
        log.add(await read_metrics(client, root))


async def wait_until_idle(client: httpx.AsyncClient, root: str, timeout_s: float) -> tuple[Metrics, float]:
    """The server's metrics once nothing runs or waits, and how long that took (the timeout: still busy)."""
    started = time.perf_counter()
    while True:
        metrics = await read_metrics(client, root)
        idle = metrics.get("pt2serve_requests_running") == 0 and metrics.get("pt2serve_requests_waiting") == 0
        waited = time.perf_counter() - started
        if idle or waited > timeout_s:  # the engine counts leaked cells in the same look that finds it idle
            return metrics, waited
        await asyncio.sleep(0.1)
