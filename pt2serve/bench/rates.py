"""--request-rates: the requests workload once per offered rate, to show where the server saturates.

Each rate is a full run of the same workload (prompts of the same lengths, but each run's own, so a server's
prefix cache finds none of them from the run before; Poisson arrivals of that rate drawn with the same seed) on one
target: an in-process runner loaded once, or a server at --url. Below saturation the
achieved request rate follows the offered one and latencies stay flat; past it the achieved rate levels off,
TTFT grows with the queue, and goodput (requests per second that met the latency targets) falls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pt2serve.bench.options import RequestsOptions
from pt2serve.bench.progress import Progress
from pt2serve.bench.request_timing import RequestsResult
from pt2serve.bench.requests_mode import open_target


@dataclass
class RateSweepResult:
    options: RequestsOptions  # the workload; each run's own options carry its rate
    runs: list[RequestsResult]  # one per offered rate, in the order given

    @property
    def target(self) -> str:
        return self.runs[0].target

    @property
    def device(self) -> str | None:
        return self.runs[0].device


def run_request_rates(
    path: str | Path | None,
    options: RequestsOptions,
    rates: tuple[float, ...],
    device: str | None = None,
    executor_config=None,
    runner_config=None,
    progress: Progress | None = None,
) -> RateSweepResult:
    """The workload at each rate in `rates` (requests/s), on one target."""
    plans = [replace(options, request_rate=rate, stagger_ms=0.0, prompt_set=number)
             for number, rate in enumerate(rates)]
    for plan in plans:
        plan.check()
    runs = []
    with open_target(path, plans[0], device, executor_config, runner_config, progress) as drive:
        for number, plan in enumerate(plans, 1):
            label = f"rate {plan.request_rate:g} req/s ({number}/{len(plans)})"
            runs.append(drive(plan, None if progress is None else lambda text, label=label: progress(f"{label}: {text}")))
    return RateSweepResult(options, runs)
