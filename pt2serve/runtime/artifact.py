"""Opening a .pt2: check it against this machine, load its weights once, bind them to every method.

Nothing here imports model or export code: the package and its metadata are the whole contract.
Every check runs before any compiled method runs, because AOTInductor crashes (not raises) on a method
whose constants are missing and silently accepts wrong shapes. The metadata document and its checks are
metadata.py's, the archive's records archive.py's, reading the weights onto the device weights.py's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.archive import (
    check_records,
    locate_weights,
    open_zip,
    read_metadata_record,
    read_tokenizer_record,
)
from pt2serve.runtime.metadata import Metadata
from pt2serve.runtime.weights import load_weights

# FP8 tensor-core instructions arrived with Ada (sm_89) and Hopper (sm_90).
_FP8_MIN_CAPABILITY = (8, 9)


def read_metadata(path: str | Path) -> Metadata:
    """The metadata document alone: no method or weight is loaded."""
    with open_zip(path) as archive:
        return Metadata(read_metadata_record(archive, path))


def read_tokenizer_json(path: str | Path) -> str | None:
    """The checkpoint's tokenizer.json the artifact carries (None without one); nothing else is loaded."""
    with open_zip(path) as archive:
        return read_tokenizer_record(archive)


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
    with open_zip(path) as archive:
        metadata = Metadata(read_metadata_record(archive, path))
        target = torch.device(device or ("cuda" if metadata.backend == "cuda" else "cpu"))
        check_machine(metadata, target)
        records = check_records(archive, metadata, path)
        tokenizer_json = read_tokenizer_record(archive)
    # The weights load on a thread pool while this thread opens the methods (which reads the zip, unpacks
    # each method's files and dlopens them: a second or two for ten methods).
    located = locate_weights(path, metadata, records)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pt2serve-weights") as background:
        loading = background.submit(load_weights, path, metadata, located, target, verify_hash, show_progress)
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
