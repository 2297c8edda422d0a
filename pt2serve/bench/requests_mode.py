"""--mode requests: N requests arriving over time; aggregate throughput and per-request latency.

A run is a workload (workload.py: random prompts of token ids; conversations.py: --workload chat) driven
on one target: a Runner loaded in process (in_process.py), or with a URL a running server's OpenAI API
(http_client.py). Either way the requests are timed from the client side and the run summarised alike
(request_timing.py says what each metric is), and one short untimed request runs first.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from pt2serve.bench.in_process import drive_runner
from pt2serve.bench.options import RequestsOptions
from pt2serve.bench.progress import Progress
from pt2serve.bench.request_timing import RequestsResult
from pt2serve.bench.workload import check_lengths
from pt2serve.errors import Pt2ServeError


def run_requests(
    path: str | Path | None,
    options: RequestsOptions = RequestsOptions(),
    device: str | None = None,
    executor_config=None,
    runner_config=None,
    progress: Progress | None = None,
) -> RequestsResult:
    """In-process on the artifact at `path`, or against `options.url` (then `path` is optional)."""
    with open_target(path, options, device, executor_config, runner_config, progress) as drive:
        return drive(options, progress)


Drive = Callable[[RequestsOptions, Progress | None], RequestsResult]  # one workload, one result


@contextmanager
def open_target(
    path: str | Path | None,
    options: RequestsOptions,
    device: str | None = None,
    executor_config=None,
    runner_config=None,
    progress: Progress | None = None,
) -> Iterator[Drive]:
    """A function that runs one workload: on a Runner loaded once (closed on exit), or against options.url."""
    from pt2serve.runtime.artifact import read_metadata
    from pt2serve.runtime.engine import read_tokenizer

    options.check()
    meta = read_metadata(path).raw if path is not None else None
    if meta is not None:
        check_lengths(options, meta["max_context"])
    if options.url is not None:
        from pt2serve.bench.http_client import drive_server

        vocab_size = meta["vocab_size"] if meta else None
        tokenizer = read_tokenizer(path) if path is not None else None  # sizes chat text in tokens
        yield lambda run_options, run_progress: drive_server(run_options, vocab_size, tokenizer, run_progress)
        return
    if path is None:
        raise Pt2ServeError("give an artifact to run in-process, or --url to drive a running server")
    from pt2serve.runtime.engine import open_runner
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig

    if progress is not None:
        progress(f"loading {path}")
    runner = open_runner(path, device, executor_config or ExecutorConfig(), runner_config or RunnerConfig())
    try:
        yield lambda run_options, run_progress: drive_runner(runner, run_options, run_progress)
    finally:
        runner.close()
