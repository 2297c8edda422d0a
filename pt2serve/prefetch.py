"""Start reading an artifact into the page cache before the Python imports that precede loading it.

Importing torch and the server takes seconds; a cold 16 GB artifact takes seconds more to come off the disk.
Asking the kernel for the file first (posix_fadvise WILLNEED, on a daemon thread because it may block while it
queues the reads) lets the two overlap. It only advises: nothing fails if the platform lacks it, and a file
already cached costs nothing. This module imports nothing heavy, so it can run first.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def prefetch(path: str | Path) -> threading.Thread | None:
    """Begin reading `path` into the page cache in the background; the thread doing it, None if unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=_advise, args=(str(path),), name="pt2serve-prefetch", daemon=True)
    thread.start()
    return thread


def _advise(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the loader reports a missing or unreadable file with its own message
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
