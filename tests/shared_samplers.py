"""Test exports compile each sampling method once per run and vocabulary size.

sample, sample_argmax, accept_drafts and accept_drafts_sampled are traced from the vocabulary size and the
device alone (pt2serve.export.methods), so every test artifact of one vocabulary (toy-greedy's seven, in
several quantizations) would compile the same four graphs again: about 30 s of CPU an export on 2 cores,
half of a one-width export. The first in-process export of a run to need one compiles it and keeps its files
in the run's artifact folder; later exports, in this process or another pytest-xdist worker, package those.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from pt2serve.contract import ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED, SAMPLE, SAMPLE_ARGMAX
from pt2serve.export import compile as compile_module

SAMPLERS = (SAMPLE, SAMPLE_ARGMAX, ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED)
FILES = "files.json"  # the compiled files' names, in the order the compile listed them


def sharing_samplers(monkeypatch, folder: Path) -> None:
    """Route compile_method through `folder`'s sampler store for the rest of `monkeypatch`'s scope."""
    compile_method = compile_module.compile_method

    def compile_or_reuse(job, model=None):
        # Without the model the method compiles in an export worker, which this process does not reach.
        if job.spec.name not in SAMPLERS or model is None:
            return compile_method(job, model)
        store = folder / "samplers" / f"{job.spec.name}-{model.config.vocab_size}-{job.device}"
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

