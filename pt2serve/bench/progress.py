"""A live one-line status on stderr while a benchmark runs (silent when stderr is not a terminal)."""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console
from rich.live import Live
from rich.text import Text


Progress = Callable[[str], None]  # told what a benchmark is doing now


class StatusLine:
    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        self._enabled = enabled and self._console.is_terminal
        self._live: Live | None = None
        self._started = time.perf_counter()

    def __enter__(self) -> "StatusLine":
        if self._enabled:
            self._live = Live(Text(""), console=self._console, transient=True, refresh_per_second=8)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def __call__(self, text: str) -> None:
        if self._live is not None:
            elapsed = time.perf_counter() - self._started
            self._live.update(Text(f"[{elapsed:6.1f} s] {text}", style="cyan"))
