"""A check of the C++ compiler AOTInductor will use, before minutes of compiling.

A wrapper library built by a g++ that links its own libstdc++ (not the one this Python process runs
with) makes loading ANY package segfault later. The exporter warns and records the mismatch in the
metadata, and the loader refuses such an artifact with a message instead of crashing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def compiler_libstdcxx(compiler: str) -> str | None:
    """The libstdc++ the compiler links against, resolved; None when it cannot say."""
    path = shutil.which(compiler)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    printed = out.stdout.strip()
    return os.path.realpath(printed) if os.path.isabs(printed) else None


def process_libstdcxx() -> str | None:
    """The libstdc++ mapped into this process (torch loads it), resolved."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libstdc++.so" in path:
                    return os.path.realpath(path)
    except OSError:
        return None
    return None


def libstdcxx_mismatch() -> str | None:
    """A description of the mismatch, when the compiler's libstdc++ is not the one this process runs."""
    compiler = os.environ.get("CXX", "g++")
    linked, loaded = compiler_libstdcxx(compiler), process_libstdcxx()
    if linked and loaded and linked != loaded:
        return f"the C++ compiler {compiler!r} links {linked}, but the exporting process ran with {loaded}"
    return None


def warn_about(mismatch: str) -> None:
    print(
        f"warning: {mismatch}; packages built this way crash when loaded, and pt2serve will refuse to load "
        "this one. Re-export with CXX=/usr/bin/g++ (a compiler using the system libstdc++).",
        file=sys.stderr,
    )
