"""Loading an artifact's weights onto a device: read in place from their (uncompressed) records by a pool of
threads, each piece hashed as it is read, and on a GPU copied up through pinned staging buffers; refused
unless they match the artifact's content hash.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from pt2serve.contract import CONTENT_HASH_SCHEME, ContentHasher, content_hash
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.archive import WeightRecord
from pt2serve.runtime.metadata import Metadata

# Weights are read in pieces of this size: on the CPU straight into the weight's own tensor, on a GPU into one
# of two pinned staging buffers per loading thread (the next piece is read while the last one is copied up).
# Each piece is hashed right after it is read, while it is still in the CPU's cache.
_PIECE_BYTES = 16 << 20
_MAX_LOAD_THREADS = 16


def load_weights(
    path: Path,
    metadata: Metadata,
    located: list[WeightRecord],
    device: torch.device,
    verify_hash: bool,
    show_progress: bool,
) -> tuple[dict[str, torch.Tensor], float]:
    """Every weight read from its (uncompressed) record, hashed and moved to `device` by a pool of threads
    (file reads, sha256 and copies to the device all release the GIL); returns them and the seconds taken."""
    started = time.perf_counter()
    scheme = metadata.raw.get("content_hash_scheme", 1)
    with open(path, "rb") as file:
        reader = _WeightReader(file.fileno(), device, digest=verify_hash and scheme == CONTENT_HASH_SCHEME)
        num_threads = min(_MAX_LOAD_THREADS, os.cpu_count() or 1, max(1, len(located)))
        with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="pt2serve-weight") as pool, \
                tqdm(total=sum(r.num_bytes for r in located), desc="loading weights", unit="B", unit_scale=True,
                     disable=not show_progress) as progress:
            # Scheme 1 is one serial sha256 stream: it runs beside the copies, reading the mapped file.
            serial_hash = pool.submit(_scheme_1_hash, file.fileno(), metadata, located) \
                if verify_hash and scheme == 1 else None
            # Largest first, so that no big weight starts last and leaves the other threads idle.
            loads: dict[str, Future] = {}
            for record in sorted(located, key=lambda r: -r.num_bytes):
                loads[record.name] = pool.submit(reader.read, record)
                loads[record.name].add_done_callback(lambda _, n=record.num_bytes: progress.update(n))
            loaded = {name: future.result() for name, future in loads.items()}
            hash_found = serial_hash.result() if serial_hash is not None else None
    if verify_hash and scheme == CONTENT_HASH_SCHEME:
        hash_found = content_hash(metadata.raw["model_config"], {
            r.name: (r.dtype_name, r.shape, loaded[r.name][1]) for r in located})
    if verify_hash and hash_found != metadata.raw["content_hash"]:
        raise Pt2ServeError(f"{path}: weights do not match the artifact's content hash (tampered or damaged)")
    weights = {r.name: loaded[r.name][0] for r in sorted(located, key=lambda r: r.name)}
    return weights, time.perf_counter() - started


class _WeightReader:
    """Reads one weight at a time per calling thread: piece by piece from the file, each piece hashed (sha256
    of the whole weight) and, on a GPU, copied up from a pinned staging buffer on the thread's own stream."""

    def __init__(self, fd: int, device: torch.device, digest: bool) -> None:
        self._fd = fd
        self._device = device
        self._digest = digest
        self._local = threading.local()  # per thread: its CUDA stream and two (pinned buffer, event) slots

    def read(self, record: WeightRecord) -> tuple[torch.Tensor, str | None]:
        """The weight on the device, and the hex sha256 of its bytes (None when not hashing)."""
        hasher = hashlib.sha256() if self._digest else None
        on_host = self._device.type == "cpu"
        target = torch.empty(record.num_bytes, dtype=torch.uint8, device=self._device)
        host_view = memoryview(target.numpy()) if on_host else None
        stream, slots = (None, None) if on_host else self._staging()
        for index, start in enumerate(range(0, record.num_bytes, _PIECE_BYTES)):
            length = min(_PIECE_BYTES, record.num_bytes - start)
            if on_host:  # straight into the weight's own memory
                piece = host_view[start:start + length]
            else:
                staging, copied = slots[index % 2]
                copied.synchronize()  # the copy that last read this buffer is done
                piece = memoryview(staging.numpy())[:length]
            _read_exactly(self._fd, piece, record.offset + start)
            if hasher is not None:
                hasher.update(piece)
            if not on_host:
                with torch.cuda.stream(stream):
                    target[start:start + length].copy_(staging[:length], non_blocking=True)
                    copied.record(stream)
        if stream is not None:
            stream.synchronize()  # the weight is on the device before anyone uses it
        weight = target.view(record.dtype).reshape(record.shape)
        return weight, hasher.hexdigest() if hasher is not None else None

    def _staging(self) -> tuple[torch.cuda.Stream, list[tuple[torch.Tensor, torch.cuda.Event]]]:
        if not hasattr(self._local, "slots"):
            self._local.stream = torch.cuda.Stream(device=self._device)
            self._local.slots = [(torch.empty(_PIECE_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                                 for _ in range(2)]
        return self._local.stream, self._local.slots


def _read_exactly(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        count = os.preadv(fd, [into[done:]], offset + done)
        if count == 0:
            raise Pt2ServeError("the artifact ended inside a weight (it changed while loading?); re-export it")
        done += count


def _scheme_1_hash(fd: int, metadata: Metadata, located: list[WeightRecord]) -> str:
    """The serial content hash of artifacts written before CONTENT_HASH_SCHEME 2, read from the mapped file."""
    hasher = ContentHasher(metadata.raw["model_config"])
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        for record in sorted(located, key=lambda r: r.name):
            data = memoryview(mapped)[record.offset:record.offset + record.num_bytes]
            hasher.update(record.name, record.dtype_name, record.shape, data)
            data.release()
    return hasher.hexdigest()
