"""The loader's checks: every kind of damaged, incomplete, malformed or foreign artifact is refused with a
message that names the problem, before any compiled method runs (a crash would take the server down)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pt2serve.contract import CONTENT_HASH_SCHEME, ContentHasher, content_hash, forward_name
from pt2serve.runtime.artifact import read_metadata


def rewrite_zip(src: Path, dst: Path, drop=lambda name: False, replace: dict | None = None,
                compress: str | None = None) -> None:
    """Copy a zip record by record (kept ZIP_STORED but `compress`, which is deflated), dropping or replacing
    some; records are named by their path below the archive's root folder."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            suffix = info.filename.split("/", 1)[-1]
            if drop(suffix):
                continue
            data = replace.get(suffix)
            method = zipfile.ZIP_DEFLATED if suffix == compress else zipfile.ZIP_STORED
            zout.writestr(info.filename, data if data is not None else zin.read(info.filename), compress_type=method)


def metadata_record(path: Path) -> tuple[str, dict]:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.split("/", 1)[-1] == "extra/pt2serve.json")
        return name, json.loads(archive.read(name))


def with_metadata(src: Path, dst: Path, edit, drop=lambda name: False) -> None:
    name, meta = metadata_record(src)
    edit(meta)
    rewrite_zip(src, dst, drop=drop, replace={name.split("/", 1)[-1]: json.dumps(meta).encode()})


def record_info(path: Path, suffix: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(path) as archive:
        return next(i for i in archive.infolist() if i.filename.split("/", 1)[-1] == suffix)


def flip_byte(path: Path, info: zipfile.ZipInfo) -> None:
    """Flip one byte in the middle of a record's data (its CRC no longer matches)."""
    with open(path, "r+b") as file:
        file.seek(info.header_offset)
        header = file.read(30)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        at = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        file.seek(at)
        byte = file.read(1)
        file.seek(at)
        file.write(bytes([byte[0] ^ 0x5A]))


def claim_size(path: Path, info: zipfile.ZipInfo, num_bytes: int) -> None:
    """Make the zip's central directory say `info`'s record holds `num_bytes` (more than the file has left)."""
    data = bytearray(path.read_bytes())
    name = info.filename.encode()
    at = data.find(b"PK\x01\x02")
    while data[at + 46:at + 46 + len(name)] != name:
        at = data.find(b"PK\x01\x02", at + 4)
        assert at >= 0, f"no central directory entry for {info.filename}"
    data[at + 20:at + 28] = struct.pack("<II", num_bytes, num_bytes)  # compressed and uncompressed sizes
    path.write_bytes(bytes(data))


def weight_bytes(path: Path, metadata: dict) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        by_suffix = {n.split("/", 1)[-1]: n for n in archive.namelist()}
        return {w["name"]: archive.read(by_suffix[w["record"]]) for w in metadata["weights"]}


def rehash(src: Path, metadata: dict, scheme: int) -> None:
    """Recompute `metadata`'s content hash over the weights it lists (bytes read from `src`) with `scheme`:
    1 writes it as an artifact from before scheme 2 did (no content_hash_scheme field)."""
    data = weight_bytes(src, metadata)
    if scheme == 1:
        hasher = ContentHasher(metadata["model_config"])
        for w in sorted(metadata["weights"], key=lambda w: w["name"]):
            hasher.update(w["name"], w["dtype"], w["shape"], data[w["name"]])
        metadata.pop("content_hash_scheme", None)
        metadata["content_hash"] = hasher.hexdigest()
    else:
        metadata["content_hash_scheme"] = scheme
        metadata["content_hash"] = content_hash(metadata["model_config"], {
            w["name"]: (w["dtype"], w["shape"], hashlib.sha256(data[w["name"]]).hexdigest())
            for w in metadata["weights"]})


def make_bad_artifacts(src: Path, tmp: Path) -> dict[str, tuple[Path, str, str | None]]:
    """name -> (path, text the error must contain, device to load on)."""
    meta = read_metadata(src).raw
    cases: dict[str, tuple[Path, str, str | None]] = {}

    def edited(name: str, edit, message: str, device: str | None = None, **kwargs) -> None:
        path = tmp / f"{name}.pt2"
        with_metadata(src, path, edit, **kwargs)
        cases[name] = (path, message, device)

    # -- the file itself
    truncated = tmp / "truncated.pt2"
    data = src.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    cases["truncated"] = (truncated, "not a readable .pt2 package", None)
    not_zip = tmp / "not-a-zip.pt2"
    not_zip.write_bytes(b"this is not a zip archive\n" * 100)
    cases["not-a-zip"] = (not_zip, "not a readable .pt2 package", None)
    cases["no-such-path"] = (tmp / "does-not-exist.pt2", "does not exist", None)

    # -- methods
    internal = meta["methods"][forward_name(2)]["internal_name"]
    missing_method = tmp / "missing-method.pt2"
    rewrite_zip(src, missing_method, drop=lambda n: n.startswith(f"data/aotinductor/{internal}/"))
    cases["missing-method"] = (missing_method, "forward_2", None)
    damaged_method = tmp / "damaged-method.pt2"
    shutil.copy(src, damaged_method)
    with zipfile.ZipFile(src) as archive:
        library = next(i for i in archive.infolist()
                       if i.filename.split("/", 1)[-1].startswith(f"data/aotinductor/{internal}/")
                       and i.filename.endswith(".so"))
    flip_byte(damaged_method, library)
    cases["damaged-method"] = (damaged_method, "method forward_2 is damaged", None)
    empty_library = tmp / "empty-library.pt2"
    rewrite_zip(src, empty_library, replace={library.filename.split("/", 1)[-1]: b""})
    cases["empty-library"] = (empty_library, "method forward_2's compiled library is empty", None)

    # -- weights
    largest = max(meta["weights"], key=lambda w: int(np.prod(w["shape"])))
    tampered = tmp / "tampered-weights.pt2"
    shutil.copy(src, tampered)
    flip_byte(tampered, record_info(src, largest["record"]))
    cases["tampered-weights"] = (tampered, "content hash", None)
    # One weight hashed on its own (scheme 2) still changes the whole content hash: a flipped byte in the
    # smallest weight is refused too.
    smallest = min(meta["weights"], key=lambda w: int(np.prod(w["shape"])))
    tampered_small = tmp / "tampered-small-weight.pt2"
    shutil.copy(src, tampered_small)
    flip_byte(tampered_small, record_info(src, smallest["record"]))
    cases["tampered-small-weight"] = (tampered_small, "content hash", None)
    # Artifacts written before scheme 2 (no content_hash_scheme, one serial sha256) load, and their hash is
    # still checked.
    edited("old-hash-scheme-ok", lambda m: rehash(src, m, 1), "")
    old_tampered = tmp / "old-hash-scheme-tampered.pt2"
    shutil.copy(cases["old-hash-scheme-ok"][0], old_tampered)
    flip_byte(old_tampered, record_info(old_tampered, largest["record"]))
    cases["old-hash-scheme-tampered"] = (old_tampered, "content hash", None)
    edited("unknown-hash-scheme", lambda m: m.update(content_hash_scheme=CONTENT_HASH_SCHEME + 1),
           f"content hash scheme {CONTENT_HASH_SCHEME + 1}, this pt2serve knows schemes 1 to {CONTENT_HASH_SCHEME}")
    dropped = meta["weights"][0]
    missing_weight = tmp / "missing-weight.pt2"
    rewrite_zip(src, missing_weight, drop=lambda n: n == dropped["record"])
    cases["missing-weight"] = (missing_weight, f"weight {dropped['name']} is missing", None)

    def narrower(m):
        entry = next(w for w in m["weights"] if w["name"] == largest["name"])
        entry["shape"] = [entry["shape"][0], entry["shape"][1] - 1]

    rows, cols = largest["shape"]
    edited("weight-wrong-size", narrower,
           f"weight {largest['name']} has {rows * cols * 4} bytes, but its dtype and shape need {rows * (cols - 1) * 4}")
    compressed = tmp / "weight-compressed.pt2"
    rewrite_zip(src, compressed, compress=largest["record"])
    cases["weight-compressed"] = (compressed, f"weight {largest['name']} is stored compressed", None)

    # Truncated inside a weight: the last weight's record claims (in the index and the metadata alike)
    # more bytes than the file holds after its start.
    last = max(meta["weights"], key=lambda w: record_info(src, w["record"]).header_offset)
    claimed = 4 * (src.stat().st_size // 4 + 1)

    def longer(m):
        next(w for w in m["weights"] if w["name"] == last["name"])["shape"] = [claimed // 4]

    edited("weight-truncated", longer, f"truncated inside weight {last['name']}")
    path = cases["weight-truncated"][0]
    claim_size(path, record_info(path, last["record"]), claimed)

    # A weight no longer in the package at all (record and metadata entry gone, content hash recomputed
    # for what is left): only binding the weights to a method can notice.
    absent = "norm.weight"

    def without_norm(m):
        m["weights"] = [w for w in m["weights"] if w["name"] != absent]
        rehash(src, m, CONTENT_HASH_SCHEME)

    norm_record = next(w["record"] for w in meta["weights"] if w["name"] == absent)
    edited("method-needs-absent-weight", without_norm, f"needs weights the package lacks: {absent}",
           drop=lambda n: n == norm_record)

    # -- metadata
    no_metadata = tmp / "no-metadata.pt2"
    rewrite_zip(src, no_metadata, drop=lambda n: n == "extra/pt2serve.json")
    cases["no-metadata"] = (no_metadata, "has no pt2serve metadata", None)
    not_json = tmp / "metadata-not-json.pt2"
    rewrite_zip(src, not_json, replace={"extra/pt2serve.json": b'{"format_version": 1, '})
    cases["metadata-not-json"] = (not_json, "metadata is unreadable", None)
    not_object = tmp / "metadata-not-an-object.pt2"
    rewrite_zip(src, not_object, replace={"extra/pt2serve.json": b"[1, 2]"})
    cases["metadata-not-an-object"] = (not_object, "metadata is not a JSON object", None)
    edited("metadata-missing-fields", lambda m: [m.pop("max_cells"), m.pop("cache")], "metadata lacks cache, max_cells")
    edited("metadata-sizes-not-a-list", lambda m: m.update(forward_sizes="1,2,4"), "forward_sizes is '1,2,4'")
    edited("metadata-zero-context", lambda m: m.update(max_context=0), "max_context is 0, not a positive integer")
    edited("metadata-bad-cache-dtype", lambda m: m["cache"].update(dtype="int3"), "metadata field cache is")
    edited("metadata-bad-weight-dtype", lambda m: m["weights"][0].update(dtype="float8"), "metadata field weights")
    edited("metadata-weight-without-shape", lambda m: m["weights"][1].pop("shape"), "metadata field weights")
    edited("metadata-bad-entry-count", lambda m: m["methods"][forward_name(4)].update(num_entries="many"),
           "methods.forward_4.num_entries is 'many'")
    edited("metadata-method-without-name", lambda m: m["methods"][forward_name(4)].pop("internal_name"),
           "metadata field methods")
    edited("metadata-unknown-backend", lambda m: m.update(backend="tpu"), "backend is 'tpu', not cpu or cuda")
    edited("metadata-no-torch-version", lambda m: m["built_with"].pop("torch"), "built_with does not give")
    edited("other-format-version", lambda m: m.update(format_version=m["format_version"] + 1), "artifact format")

    # -- this machine
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    edited("other-torch", lambda m: m["built_with"].update(torch=f"{major - 1}.0.1+cpu"),
           f"built with torch {major - 1}.0.1")
    # Compiled methods load only under the release that built them: another minor version is another release.
    edited("other-torch-minor", lambda m: m["built_with"].update(torch=f"{major}.{minor + 1}.0+cpu"),
           f"built with torch {major}.{minor + 1}.0")
    edited("foreign-libstdcxx", lambda m: m["built_with"].update(libstdcxx_mismatch="the C++ compiler 'g++' links /x"),
           "CXX=/usr/bin/g++")
    # Asked for a GPU where there is none, the loader says so before anything about the artifact.
    no_gpu = "no CUDA GPU is visible here"
    edited("built-for-cuda", lambda m: m.update(backend="cuda"), no_gpu)
    cases["cuda-artifact-on-cpu"] = (cases["built-for-cuda"][0], "exported for cuda; serve it on a GPU", "cpu")
    on_cuda = "exported for cpu; re-export with --backend cuda" if torch.cuda.is_available() else no_gpu
    cases["cpu-artifact-on-cuda"] = (src, on_cuda, "cuda")

    # A clean rewrite loads: the damage above, not the rewriting, is what the loader refuses.
    rewritten = tmp / "rewritten.pt2"
    rewrite_zip(src, rewritten)
    cases["rewritten-ok"] = (rewritten, "", None)
    return cases


# Loads each (path, device) line it reads and answers with one JSON line: ["loaded" | "refused" | "error", text].
LOADER = """
import json, sys
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.artifact import load_artifact
for line in sys.stdin:
    path, device = json.loads(line)
    try:
        load_artifact(path, device=device)
        answer = ["loaded", ""]
    except Pt2ServeError as err:
        answer = ["refused", str(err)]
    except Exception as err:
        answer = ["error", f"{type(err).__name__}: {err}"]
    print(json.dumps(answer), flush=True)
"""


def load_each(cases: dict[str, tuple[Path, str | None]], stderr_path: Path) -> dict[str, tuple[str, str]]:
    """Load every case in a child interpreter (one import of torch for all); a case that crashes the child
    is reported as "crashed" and a fresh child takes the rest."""
    results: dict[str, tuple[str, str]] = {}
    pending = list(cases)
    while pending:
        with open(stderr_path, "w") as stderr:
            child = subprocess.Popen([sys.executable, "-c", LOADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=stderr, text=True)
            while pending:
                name = pending[0]
                path, device = cases[name]
                child.stdin.write(json.dumps([str(path), device]) + "\n")
                child.stdin.flush()
                answer = child.stdout.readline()
                pending.pop(0)
                if not answer:
                    child.wait(timeout=60)
                    results[name] = ("crashed", f"exit {child.returncode}: {stderr_path.read_text()[-2000:]}")
                    break
                results[name] = tuple(json.loads(answer))
            child.stdin.close()
            child.wait(timeout=60)
    return results


@pytest.fixture(scope="module")
def bad_artifact_results(tiny_artifact, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-artifacts")
    cases = make_bad_artifacts(tiny_artifact, tmp)
    answers = load_each({name: (path, device) for name, (path, _, device) in cases.items()}, tmp / "stderr.txt")
    return {name: (*answers[name], message) for name, (_, message, _) in cases.items()}


BAD_CASES = [
    "truncated", "not-a-zip", "no-such-path", "missing-method", "damaged-method", "empty-library", "tampered-weights",
    "tampered-small-weight", "old-hash-scheme-tampered", "unknown-hash-scheme",
    "missing-weight", "weight-wrong-size", "weight-compressed", "weight-truncated", "method-needs-absent-weight",
    "no-metadata", "metadata-not-json", "metadata-not-an-object", "metadata-missing-fields",
    "metadata-sizes-not-a-list", "metadata-zero-context", "metadata-bad-cache-dtype", "metadata-bad-weight-dtype",
    "metadata-weight-without-shape", "metadata-bad-entry-count", "metadata-method-without-name",
    "metadata-unknown-backend", "metadata-no-torch-version", "other-format-version", "other-torch", "other-torch-minor",
    "foreign-libstdcxx", "cpu-artifact-on-cuda", "cuda-artifact-on-cpu",
    pytest.param("built-for-cuda", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_artifact_is_refused_with_message(bad_artifact_results, case):
    outcome, text, message = bad_artifact_results[case]
    assert outcome == "refused", f"{outcome}: {text}"
    assert message in text, f"{message!r} not in: {text}"


@pytest.mark.parametrize("case", ["rewritten-ok", "old-hash-scheme-ok"])
def test_rewritten_artifact_still_loads(bad_artifact_results, case):
    outcome, text, _ = bad_artifact_results[case]
    assert outcome == "loaded", text


def test_export_records_the_parallel_hash_scheme(tiny_artifact):
    """A new export carries scheme 2: a sha256 per weight, combined over the config in name order."""
    meta = read_metadata(tiny_artifact).raw
    assert meta["content_hash_scheme"] == CONTENT_HASH_SCHEME == 2
    rehashed = json.loads(json.dumps(meta))
    rehash(tiny_artifact, rehashed, 2)
    assert rehashed["content_hash"] == meta["content_hash"]
