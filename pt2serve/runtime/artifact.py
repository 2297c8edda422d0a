"""Opening a .pt2: check it against this machine, load its weights once, bind them to every method.

Nothing here imports model or export code: the package and its metadata are the whole contract.
Every check runs before any compiled method runs, because AOTInductor crashes (not raises) on a method
whose constants are missing and silently accepts wrong shapes.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
import time
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pt2serve.contract import (
    CONTENT_HASH_SCHEME,
    DRAFT_CONTEXT,
    FORMAT_VERSION,
    FORWARD_OTHERS,
    METADATA_RECORD,
    SAMPLE,
    SAMPLE_ARGMAX,
    TOKENIZER_RECORD,
    ContentHasher,
    content_hash,
    draft_name,
    forward_name,
    is_fp8,
)
from pt2serve.errors import Pt2ServeError

# Weights: floats, FP8 layers' e4m3 values, and the packed integers, zero points (uint8) and input orders
# (int64) of integer-quantized layers.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
           "int64": torch.int64, "float8_e4m3fn": torch.float8_e4m3fn}
# FP8 tensor-core instructions arrived with Ada (sm_89) and Hopper (sm_90).
_FP8_MIN_CAPABILITY = (8, 9)
_KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
# Weights are read in pieces of this size: on the CPU straight into the weight's own tensor, on a GPU into one
# of two pinned staging buffers per loading thread (the next piece is read while the last one is copied up).
# Each piece is hashed right after it is read, while it is still in the CPU's cache.
_PIECE_BYTES = 16 << 20
_MAX_LOAD_THREADS = 16


@dataclass(frozen=True)
class Metadata:
    """The artifact's metadata document, with the fields the runtime relies on."""

    raw: dict[str, Any]

    @property
    def forward_sizes(self) -> tuple[int, ...]:
        return tuple(self.raw["forward_sizes"])

    @property
    def max_step_tokens(self) -> int:
        return self.raw["max_step_tokens"]

    @property
    def max_context(self) -> int:
        return self.raw["max_context"]

    @property
    def max_cells(self) -> int:
        return self.raw["max_cells"]

    @property
    def vocab_size(self) -> int:
        return self.raw["vocab_size"]

    @property
    def backend(self) -> str:
        return self.raw["backend"]

    @property
    def cache(self) -> dict[str, Any]:
        return self.raw["cache"]

    @property
    def kv_dtype(self) -> torch.dtype:
        return _KV_DTYPES[self.cache["dtype"]]

    @property
    def min_prefill_chunk(self) -> int:
        return self.raw["min_prefill_chunk"]

    def entries_of(self, width: int) -> int:
        """The fixed context index length of a static forward."""
        return self.raw["methods"][forward_name(width)]["num_entries"]

    def internal_name(self, method: str) -> str:
        return self.raw["methods"][method]["internal_name"]

    @property
    def draft(self) -> dict[str, Any] | None:
        """The DFlash draft's description (block size, mask token, pool geometry, sizes), or None."""
        return self.raw.get("draft")

    @property
    def method_names(self) -> tuple[str, ...]:
        return tuple(self.raw["methods"])

    @property
    def is_fp8(self) -> bool:
        """Whether the linear layers hold e4m3 weights (the quantization record's format)."""
        return is_fp8(self.raw)


_REQUIRED_FIELDS = (
    "format_version", "model_config", "vocab_size", "max_context", "cache", "max_cells", "forward_sizes",
    "max_step_tokens", "min_prefill_chunk", "dtype", "backend", "methods", "weights", "content_hash", "built_with",
)


def read_metadata(path: str | Path) -> Metadata:
    """The metadata document alone: no method or weight is loaded."""
    with _open_zip(path) as archive:
        return Metadata(_read_metadata(archive, path))


def read_tokenizer_json(path: str | Path) -> str | None:
    """The checkpoint's tokenizer.json the artifact carries (None without one); nothing else is loaded."""
    with _open_zip(path) as archive:
        return _tokenizer_json(archive)


@dataclass
class LoadReport:
    load_seconds: float = 0.0
    weight_bytes: int = 0
    methods: tuple[str, ...] = ()
    # The parts of load_seconds (weights and methods load at the same time, so they may sum to more):
    weights_seconds: float = 0.0  # read, hash and copy every weight to the device
    methods_seconds: float = 0.0  # open every compiled method
    bind_seconds: float = 0.0  # hand the device weights to every method


@dataclass
class Artifact:
    """A loaded artifact: its metadata, device weights, and one runner per method."""

    path: Path
    metadata: Metadata
    device: torch.device
    weights: dict[str, torch.Tensor]
    runners: dict[str, Any]  # method name -> torch._C._aoti.AOTIModelPackageLoader
    tokenizer_json: str | None
    report: LoadReport = field(default_factory=LoadReport)

    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.runners[method].run(inputs)


def load_artifact(
    path: str | Path, device: str | None = None, verify_hash: bool = True, show_progress: bool = False
) -> Artifact:
    """Open, check and load an artifact onto `device` (default: the one it was built for)."""
    started = time.perf_counter()
    path = Path(path)
    with _open_zip(path) as archive:
        metadata = Metadata(_read_metadata(archive, path))
        target = torch.device(device or ("cuda" if metadata.backend == "cuda" else "cpu"))
        check_machine(metadata, target)
        records = _check_records(archive, metadata, path)
        tokenizer_json = _tokenizer_json(archive)
    # The weights load on a thread pool while this thread opens the methods (which reads the zip, unpacks
    # each method's files and dlopens them: a second or two for ten methods).
    located = _locate_weights(path, metadata, records)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pt2serve-weights") as background:
        loading = background.submit(_load_weights, path, metadata, located, target, verify_hash, show_progress)
        methods_started = time.perf_counter()
        try:
            device_index = target.index if target.index is not None else (0 if target.type == "cuda" else -1)
            runners = {
                method: torch._C._aoti.AOTIModelPackageLoader(
                    str(path), metadata.internal_name(method), True, 1, device_index)
                for method in metadata.method_names
            }
        except Exception:
            loading.exception()  # a damaged weight explains more than the method loader's own error
            raise
        methods_seconds = time.perf_counter() - methods_started
        weights, weights_seconds = loading.result()
    bind_started = time.perf_counter()
    for method, runner in runners.items():
        _bind_weights(runner, method, weights, path)
    report = LoadReport(
        load_seconds=time.perf_counter() - started,
        weight_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
        methods=metadata.method_names,
        weights_seconds=weights_seconds,
        methods_seconds=methods_seconds,
        bind_seconds=time.perf_counter() - bind_started,
    )
    return Artifact(path, metadata, target, weights, runners, tokenizer_json, report)


def check_machine(metadata: Metadata, device: torch.device) -> None:
    """Refuse an artifact this machine cannot run, saying how to fix it."""
    built = metadata.raw["built_with"]
    if device.type == "cuda":  # first: without a GPU, nothing else about the artifact matters
        if not torch.cuda.is_available():
            raise Pt2ServeError("no CUDA GPU is visible here (torch.cuda.is_available() is False): serve on a machine "
                                "with a GPU, or export the model with --backend cpu and serve that on the CPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise Pt2ServeError(f"there is no GPU {device}: this machine has {torch.cuda.device_count()}")
    if metadata.backend == "cuda" and device.type != "cuda":
        raise Pt2ServeError("this artifact was exported for cuda; serve it on a GPU, or re-export with --backend cpu")
    if metadata.backend == "cpu" and device.type != "cpu":
        raise Pt2ServeError("this artifact was exported for cpu; re-export with --backend cuda to run on a GPU")
    if built.get("libstdcxx_mismatch"):
        raise Pt2ServeError(
            f"this artifact's compiled methods were built against a different libstdc++ ({built['libstdcxx_mismatch']}); "
            "loading them would crash the process: re-export with CXX=/usr/bin/g++"
        )
    if _major_minor(built["torch"]) != _major_minor(torch.__version__):
        raise Pt2ServeError(
            f"this artifact was built with torch {built['torch']}, but this machine has torch {torch.__version__}; "
            "compiled methods only load under the torch release that built them: re-export it here"
        )
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        here = f"sm_{major}{minor}"
        if metadata.is_fp8 and (major, minor) < _FP8_MIN_CAPABILITY:
            raise Pt2ServeError(
                f"this artifact's linear layers are FP8, which needs a GPU of compute capability 8.9 or later (Ada, "
                f"Hopper); this GPU ({torch.cuda.get_device_name(device)}) is {here}: export it without "
                "--quantize fp8 (or with int8 / int4) for this GPU"
            )
        if built.get("gpu_arch") and built["gpu_arch"] != here:
            raise Pt2ServeError(
                f"this artifact was built for {built['gpu_arch']} ({built.get('gpu_name')}), but this GPU is {here}; "
                "re-export it on this GPU"
            )


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def _open_zip(path: str | Path) -> zipfile.ZipFile:
    path = Path(path)
    if not path.is_file():
        raise Pt2ServeError(f"artifact {str(path)!r} does not exist")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise Pt2ServeError(f"{path} is not a readable .pt2 package ({err}); it may be truncated: re-export it") from None


def _find_record(archive: zipfile.ZipFile, suffix: str) -> str | None:
    """The record whose name is <archive root>/<suffix> (the root folder is the name it was written under)."""
    for name in archive.namelist():
        if name.split("/", 1)[-1] == suffix:
            return name
    return None


def _tokenizer_json(archive: zipfile.ZipFile) -> str | None:
    name = _find_record(archive, "extra/" + TOKENIZER_RECORD)
    return archive.read(name).decode() if name else None


def _read_metadata(archive: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    name = _find_record(archive, "extra/" + METADATA_RECORD)
    if name is None:
        raise Pt2ServeError(f"{path} has no pt2serve metadata: it was not written by `pt2serve export`")
    try:
        raw = json.loads(archive.read(name))
    except (zipfile.BadZipFile, json.JSONDecodeError, OSError) as err:
        raise Pt2ServeError(f"{path}: metadata is unreadable ({err}); re-export it") from None
    if not isinstance(raw, dict):
        raise Pt2ServeError(f"{path}: metadata is not a JSON object; re-export it")
    missing = [key for key in _REQUIRED_FIELDS if key not in raw]
    if missing:
        raise Pt2ServeError(f"{path}: metadata lacks {', '.join(missing)}; re-export it")
    if raw["format_version"] != FORMAT_VERSION:
        raise Pt2ServeError(
            f"{path} has artifact format {raw['format_version']}, this pt2serve reads format {FORMAT_VERSION}; "
            "re-export it with this version"
        )
    scheme = raw.get("content_hash_scheme", 1)  # artifacts from before scheme 2 lack the field
    if scheme not in range(1, CONTENT_HASH_SCHEME + 1) or isinstance(scheme, bool):
        raise Pt2ServeError(
            f"{path} has content hash scheme {scheme!r}, this pt2serve knows schemes 1 to {CONTENT_HASH_SCHEME}; "
            "load it with the pt2serve that wrote it, or re-export it with this version"
        )
    malformed = _malformed_field(raw)
    if malformed:
        raise Pt2ServeError(f"{path}: metadata field {malformed}; re-export it")
    return raw


def _malformed_field(raw: dict[str, Any]) -> str | None:
    """The first field the runtime reads that lacks the type it needs, said with what it should be.

    A damaged or hand-edited document must fail here, naming the field, not later as a KeyError or a
    TypeError inside the loader or the executor.
    """
    for key in ("vocab_size", "max_context", "max_cells", "max_step_tokens", "min_prefill_chunk"):
        if not _is_positive_int(raw[key]):
            return f"{key} is {raw[key]!r}, not a positive integer"
    sizes = raw["forward_sizes"]
    if not isinstance(sizes, list) or not sizes or not all(_is_positive_int(n) for n in sizes):
        return f"forward_sizes is {sizes!r}, not a list of positive integers"
    cache = raw["cache"]
    if (not isinstance(cache, dict) or cache.get("dtype") not in _KV_DTYPES
            or not all(_is_positive_int(cache.get(key)) for key in ("num_layers", "num_kv_heads", "head_dim"))):
        return f"cache is {cache!r}, not {{num_layers, num_kv_heads, head_dim, dtype ({', '.join(_KV_DTYPES)})}}"
    if raw["backend"] not in ("cpu", "cuda"):
        return f"backend is {raw['backend']!r}, not cpu or cuda"
    methods = raw["methods"]
    if not isinstance(methods, dict) or not all(
            isinstance(spec, dict) and isinstance(spec.get("internal_name"), str) for spec in methods.values()):
        return "methods is not an object giving each method's internal_name"
    for width in sizes:
        spec = methods.get(forward_name(width), {})
        if "internal_name" in spec and not _is_positive_int(spec.get("num_entries")):
            return f"methods.{forward_name(width)}.num_entries is {spec.get('num_entries')!r}, not a positive integer"
    draft = raw.get("draft")
    if draft is not None and not _is_draft_record(draft, methods):
        return ("draft is not {block_size, mask_token_id, target_layer_ids, sizes, cache {num_layers, num_kv_heads, "
                "head_dim}} with a draft_S method (and its num_entries) for each size")
    weights = raw["weights"]
    if not isinstance(weights, list) or not all(_is_weight_entry(entry) for entry in weights):
        return f"weights is not a list of {{name, dtype ({', '.join(_DTYPES)}), shape, record}}"
    if not isinstance(raw["model_config"], dict):
        return "model_config is not an object"
    if not isinstance(raw["content_hash"], str):
        return f"content_hash is {raw['content_hash']!r}, not a string"
    built = raw["built_with"]
    if not isinstance(built, dict) or not isinstance(built.get("torch"), str):
        return "built_with does not give the torch version"
    return None


def _is_draft_record(draft: Any, methods: dict[str, Any]) -> bool:
    if not isinstance(draft, dict) or not isinstance(draft.get("cache"), dict):
        return False
    sizes = draft.get("sizes")
    return (_is_positive_int(draft.get("block_size")) and draft["block_size"] >= 2
            and isinstance(draft.get("mask_token_id"), int) and isinstance(draft.get("target_layer_ids"), list)
            and all(_is_positive_int(draft["cache"].get(key)) for key in ("num_layers", "num_kv_heads", "head_dim"))
            and isinstance(sizes, list) and bool(sizes) and all(_is_positive_int(n) for n in sizes)
            and all(_is_positive_int(methods.get(draft_name(n), {}).get("num_entries")) for n in sizes))


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_weight_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("record"), str)
            and entry.get("dtype") in _DTYPES and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"]))


def _check_records(archive: zipfile.ZipFile, metadata: Metadata, path: Path) -> dict[str, zipfile.ZipInfo]:
    """Every method and weight the metadata names is present, and the method files are intact."""
    expected = {forward_name(n) for n in metadata.forward_sizes} | {FORWARD_OTHERS, SAMPLE, SAMPLE_ARGMAX}
    if metadata.draft is not None:
        expected |= {DRAFT_CONTEXT} | {draft_name(n) for n in metadata.draft["sizes"]}
    absent = sorted(expected - set(metadata.method_names))
    if absent:
        raise Pt2ServeError(f"{path} is incomplete: metadata lists no method {', '.join(absent)}")
    by_suffix = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    for method in metadata.method_names:
        prefix = f"data/aotinductor/{metadata.internal_name(method)}/"
        files = [info for suffix, info in by_suffix.items() if suffix.startswith(prefix)]
        libraries = [info for info in files if info.filename.endswith(".so")]
        if not libraries:
            raise Pt2ServeError(f"{path} is incomplete: method {method} has no compiled library; re-export it")
        if any(info.file_size == 0 for info in libraries):  # seen once: a compile whose output was cut short
            raise Pt2ServeError(f"{path}: method {method}'s compiled library is empty; re-export it")
        for info in files:
            try:
                archive.read(info.filename)  # zipfile checks each record's CRC as it reads
            except (zipfile.BadZipFile, OSError) as err:
                raise Pt2ServeError(f"{path}: method {method} is damaged ({err}); re-export it") from None
    records = {}
    for entry in metadata.raw["weights"]:
        info = by_suffix.get(entry["record"])
        if info is None:
            raise Pt2ServeError(f"{path} is incomplete: weight {entry['name']} is missing; re-export it")
        records[entry["name"]] = info
    return records


@dataclass(frozen=True)
class _WeightRecord:
    """Where one weight's bytes lie in the file, checked against what its metadata entry says they hold."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype_name]


def _load_weights(
    path: Path,
    metadata: Metadata,
    located: list[_WeightRecord],
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


def _locate_weights(path: Path, metadata: Metadata, records: dict[str, zipfile.ZipInfo]) -> list[_WeightRecord]:
    """Each weight's place in the file, refused with a clear message where the record cannot hold it."""
    with open(path, "rb") as file:
        return [_locate_weight(file, entry, records[entry["name"]], path) for entry in metadata.raw["weights"]]


def _locate_weight(file, entry: dict[str, Any], info: zipfile.ZipInfo, path: Path) -> _WeightRecord:
    name, shape = entry["name"], tuple(entry["shape"])
    expected_bytes = _DTYPES[entry["dtype"]].itemsize * _numel(shape)
    if info.compress_type != zipfile.ZIP_STORED:
        raise Pt2ServeError(f"{path}: weight {name} is stored compressed, and weights are read in place "
                            "from the file; re-export it (or rewrite the zip without compression)")
    if info.file_size != expected_bytes:
        raise Pt2ServeError(f"{path}: weight {name} has {info.file_size} bytes, but its dtype and shape "
                            f"need {expected_bytes}; re-export it")
    offset = _data_offset(os.pread(file.fileno(), _LOCAL_HEADER.size, info.header_offset), info, path)
    if offset + expected_bytes > os.fstat(file.fileno()).st_size:
        raise Pt2ServeError(f"{path} is truncated inside weight {name}; re-export it")
    return _WeightRecord(name, entry["dtype"], shape, offset, expected_bytes)


class _WeightReader:
    """Reads one weight at a time per calling thread: piece by piece from the file, each piece hashed (sha256
    of the whole weight) and, on a GPU, copied up from a pinned staging buffer on the thread's own stream."""

    def __init__(self, fd: int, device: torch.device, digest: bool) -> None:
        self._fd = fd
        self._device = device
        self._digest = digest
        self._local = threading.local()  # per thread: its CUDA stream and two (pinned buffer, event) slots

    def read(self, record: _WeightRecord) -> tuple[torch.Tensor, str | None]:
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


def _scheme_1_hash(fd: int, metadata: Metadata, located: list[_WeightRecord]) -> str:
    """The serial content hash of artifacts written before CONTENT_HASH_SCHEME 2, read from the mapped file."""
    hasher = ContentHasher(metadata.raw["model_config"])
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        for record in sorted(located, key=lambda r: r.name):
            data = memoryview(mapped)[record.offset:record.offset + record.num_bytes]
            hasher.update(record.name, record.dtype_name, record.shape, data)
            data.release()
    return hasher.hexdigest()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _data_offset(header: bytes, info: zipfile.ZipInfo, path: Path) -> int:
    """Where a record's data starts, from its local header (the 30 bytes at info.header_offset)."""
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise Pt2ServeError(f"{path}: record {info.filename} is damaged; re-export it")
    fields = _LOCAL_HEADER.unpack(header)
    name_length, extra_length = fields[-2], fields[-1]
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _bind_weights(runner, method: str, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Hand the method the shared device weights (no copies); refuse before AOTInductor can crash."""
    needed = runner.get_constant_fqns()
    missing = [name for name in needed if name not in weights]
    if missing:
        raise Pt2ServeError(f"{path}: method {method} needs weights the package lacks: {', '.join(missing[:5])}")
    if needed:
        # user_managed: the method keeps pointers to our tensors, so every method shares one copy.
        constants = {name: weights[name] for name in needed}
        try:
            # The loader's own binding: (constants, use_inactive, check_full_update, user_managed). Its Python
            # wrapper (AOTICompiledModel) lives in modules that import torch's compiler stack, seconds of
            # start-up a served artifact never uses.
            runner.load_constants(constants, False, True, True)
        except TypeError:  # a torch whose binding differs: go through the wrapper
            from torch._inductor.package.package import AOTICompiledModel

            AOTICompiledModel(runner).load_constants(constants, check_full_update=True, user_managed=True)
