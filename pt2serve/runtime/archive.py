"""The records of a .pt2 archive: the zip opened, its metadata and tokenizer read, every method's files and
every weight's record checked present and intact, and each weight's bytes located in the file.

A .pt2 is a zip whose records lie under one root folder (the name it was written under), so a record is
found by its path below that folder. Weights are stored uncompressed, so they are read in place (weights.py).
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pt2serve.contract import (
    DRAFT_CONTEXT,
    FORWARD_OTHERS,
    METADATA_RECORD,
    SAMPLE,
    SAMPLE_ARGMAX,
    TOKENIZER_RECORD,
    draft_name,
    forward_name,
)
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.metadata import WEIGHT_DTYPES, Metadata, check_metadata

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes


def open_zip(path: str | Path) -> zipfile.ZipFile:
    """The artifact's zip, refused with a clear message where there is no file or it is not a readable zip."""
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


def read_metadata_record(archive: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    """The metadata document, checked (check_metadata); refused where its record is missing or unreadable."""
    name = _find_record(archive, "extra/" + METADATA_RECORD)
    if name is None:
        raise Pt2ServeError(f"{path} has no pt2serve metadata: it was not written by `pt2serve export`")
    try:
        raw = json.loads(archive.read(name))
    except (zipfile.BadZipFile, json.JSONDecodeError, OSError) as err:
        raise Pt2ServeError(f"{path}: metadata is unreadable ({err}); re-export it") from None
    return check_metadata(raw, path)


def read_tokenizer_record(archive: zipfile.ZipFile) -> str | None:
    """The checkpoint's tokenizer.json the artifact carries, or None."""
    name = _find_record(archive, "extra/" + TOKENIZER_RECORD)
    return archive.read(name).decode() if name else None


def check_records(archive: zipfile.ZipFile, metadata: Metadata, path: Path) -> dict[str, zipfile.ZipInfo]:
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
class WeightRecord:
    """Where one weight's bytes lie in the file, checked against what its metadata entry says they hold."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int

    @property
    def dtype(self) -> torch.dtype:
        return WEIGHT_DTYPES[self.dtype_name]


def locate_weights(path: Path, metadata: Metadata, records: dict[str, zipfile.ZipInfo]) -> list[WeightRecord]:
    """Each weight's place in the file, refused with a clear message where the record cannot hold it."""
    with open(path, "rb") as file:
        return [_locate_weight(file, entry, records[entry["name"]], path) for entry in metadata.raw["weights"]]


def _locate_weight(file, entry: dict[str, Any], info: zipfile.ZipInfo, path: Path) -> WeightRecord:
    name, shape = entry["name"], tuple(entry["shape"])
    expected_bytes = WEIGHT_DTYPES[entry["dtype"]].itemsize * _numel(shape)
    if info.compress_type != zipfile.ZIP_STORED:
        raise Pt2ServeError(f"{path}: weight {name} is stored compressed, and weights are read in place "
                            "from the file; re-export it (or rewrite the zip without compression)")
    if info.file_size != expected_bytes:
        raise Pt2ServeError(f"{path}: weight {name} has {info.file_size} bytes, but its dtype and shape "
                            f"need {expected_bytes}; re-export it")
    offset = _data_offset(os.pread(file.fileno(), _LOCAL_HEADER.size, info.header_offset), info, path)
    if offset + expected_bytes > os.fstat(file.fileno()).st_size:
        raise Pt2ServeError(f"{path} is truncated inside weight {name}; re-export it")
    return WeightRecord(name, entry["dtype"], shape, offset, expected_bytes)


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
