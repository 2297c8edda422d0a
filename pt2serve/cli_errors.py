"""How every `pt2serve` command reports a user error: one red line on stderr, no traceback, exit code 2.

Its own module so that the subcommands registered by cli.py (serve/command.py, bench/command.py) report
errors the same way without importing the CLI that imports them.
"""

from __future__ import annotations

import typer
from rich.console import Console


def fail(message: str) -> None:
    """Print a user error without a traceback and exit non-zero."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code=2)
