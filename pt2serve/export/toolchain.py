"""A check of the C++ compiler AOTInductor will use, before minutes of compiling.

A wrapper library built by a g++ that links its own libstdc++ (not the one this Python process runs
with) makes loading ANY package segfault later. We cannot always tell for sure, so we warn.
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


def warn_if_mismatched_libstdcxx() -> None:
    compiler = os.environ.get("CXX", "g++")
    linked, loaded = compiler_libstdcxx(compiler), process_libstdcxx()
    if linked and loaded and linked != loaded:
        print(
            f"warning: the C++ compiler {compiler!r} links {linked}, but this process runs with {loaded}; "
            "packages built this way can crash when loaded. If loading segfaults, re-export with "
            "CXX=/usr/bin/g++ (a compiler using the system libstdc++).",
            file=sys.stderr,
        )
