"""Test exports compile each sampling method once per run and vocabulary size.

sample, sample_argmax, accept_drafts and accept_drafts_sampled are traced from the vocabulary size and the
device alone (pt2serve.export.methods), so every test artifact of one vocabulary (toy-greedy's seven, in
several quantizations) would compile the same four graphs again: about 30 s of CPU an export on 2 cores,
half of a one-width export. The first in-process export of a run to need one compiles it and keeps its files
in the run's artifact folder; later exports, in this process or another pytest-xdist worker, package those.
The store is named after the vocabulary, the device, torch's version and the source of the code that traces
and compiles the samplers, so a folder kept across runs (PT2SERVE_TEST_ARTIFACTS) never serves samplers
compiled from older code. The first export of each vocabulary still compiles them through the product's own
compile_method, and the CLI export of test_export_flags.py compiles its own in worker processes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock

from pt2serve.contract import ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED, SAMPLE, SAMPLE_ARGMAX
from pt2serve.export import compile as compile_module
from pt2serve.export import inductor_fixes, methods
from pt2serve.model import sampling, verify

SAMPLERS = (SAMPLE, SAMPLE_ARGMAX, ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED)
FILES = "files.json"  # the compiled files' names, in the order the compile listed them
SOURCES = (compile_module, methods, inductor_fixes, sampling, verify)  # what a sampler's files come from


def _code_version() -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    for module in SOURCES:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:12]


def sharing_samplers(monkeypatch, folder: Path) -> None:
    """Route compile_method through `folder`'s sampler store for the rest of `monkeypatch`'s scope."""
    compile_method = compile_module.compile_method
    version = _code_version()

    def compile_or_reuse(job, model=None):
        # Without the model the method compiles in an export worker, which this process does not reach.
        if job.spec.name not in SAMPLERS or model is None:
            return compile_method(job, model)
        store = folder / "samplers" / f"{job.spec.name}-{model.config.vocab_size}-{job.device}-{version}"
        store.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{store}.lock"):
            if not store.exists():
                name, files = compile_method(job, model)
                if not all(isinstance(file, str) for file in files):
                    return name, files  # weights beside the code: nothing a sampler has, so not kept
                _keep(files, store)
        names = json.loads((store / FILES).read_text())
        return job.spec.name, [str(store / name) for name in names]

    monkeypatch.setattr(compile_module, "compile_method", compile_or_reuse)


def _keep(files: list[str], store: Path) -> None:
    """Copy the compiled files into `store`, which appears only when complete."""
    partial = Path(tempfile.mkdtemp(dir=store.parent, prefix=f".{store.name}."))
    names = [Path(file).name for file in files if file]
    assert len(set(names)) == len(names), names  # the archive names them by their file names alone
    for file in files:
        if file:
            shutil.copy2(file, partial)
    (partial / FILES).write_text(json.dumps(names))
    partial.rename(store)

