"""The exporter: every method of the tiny artifact against the eager model, the package layout and size,
metadata, and the CLI's refusals of bad input (which happen before any compile work)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from commands import run_in_one_interpreter
from conftest import TEST_MAX_CELLS, TEST_MAX_CONTEXT, TEST_MAX_STEP_TOKENS
from pt2serve.contract import (
    ACCEPT_DRAFTS,
    ACCEPT_DRAFTS_SAMPLED,
    FORMAT_VERSION,
    FORWARD_INPUTS,
    FORWARD_OTHERS,
    SAMPLE,
    SAMPLE_ARGMAX,
    SCRATCH_CELL,
    WEIGHTS_PREFIX,
    forward_name,
)
from pt2serve.export.exporter import model_weights
from pt2serve.export.methods import MethodSpec, trace_forward
from pt2serve.export.options import DEFAULT_FORWARD_SIZES, DEFAULT_MAX_CELLS, DEFAULT_MIN_PREFILL_CHUNK, ExportOptions
from pt2serve.export.package import tensor_bytes, weights_hash
from pt2serve.model.eager import EagerSequence
from pt2serve.model.presets import build_preset_model, byte_tokenizer_files, get_preset
from pt2serve.runtime.artifact import load_artifact, read_metadata
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, choose_method, pack

PT2SERVE = str(Path(sys.executable).with_name("pt2serve"))
TOLERANCE = 1e-4
POOL_CELLS = 1024  # the test pools: room for three sequences of max context, cells shuffled
GREEDY = SamplingParams()

# What the package may hold beyond the weights, per method. Measured on this CPU build (torch 2.13, tiny-random
# preset, weights left out of every .so): each method's folder holds about 1.55-1.97 MB, of which the
# compiled wrapper .so is ~1.5-1.8 MB (mostly the AOTInductor runtime linked into every method, not model
# data) and the rest generated C++ sources (~0.2 MB) and small json. 3 MB per method leaves headroom for a
# larger model's larger generated code while still catching a copy of the weights inside each method for
# any model whose weights exceed a few MB.
ALLOWANCE_PER_METHOD = 3_000_000


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return load_artifact(tiny_artifact)


@pytest.fixture(scope="module")
def model():
    return build_preset_model("tiny-random", torch.float32).eval()


# ---------------------------------------------------------------------------------------------- helpers


def random_pools(cfg, num_cells: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pools full of random K/V, as if earlier steps had filled them (the scratch cell too)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_cells, cfg.num_kv_heads, cfg.head_dim)
    k_pools = [torch.randn(shape, generator=gen) for _ in range(cfg.num_layers)]
    v_pools = [torch.randn(shape, generator=gen) for _ in range(cfg.num_layers)]
    return k_pools, v_pools


def clone_pools(pools):
    return [p.clone() for p in pools]


def split_inputs(call) -> list[torch.Tensor]:
    """The packed host array's input regions (MethodCall.regions), each as its own tensor."""
    inputs = [torch.from_numpy(region.copy()) for region in call.regions()]
    assert len(inputs) == len(FORWARD_INPUTS)
    return [t.clone() for t in inputs]


def random_chunks(rng: np.random.Generator, lengths: list[int], num_cells: int, vocab: int,
                  sample_every: int = 2) -> list[Chunk]:
    """One chunk per length, each of its own sequence at a random start, on shuffled distinct cells."""
    free = rng.permutation(np.arange(1, num_cells))
    chunks = []
    for i, length in enumerate(lengths):
        start = int(rng.integers(0, TEST_MAX_CONTEXT - length + 1))
        end = start + length
        cells, free = free[:end].astype(np.int64), free[end:]
        tokens = tuple(int(t) for t in rng.integers(0, vocab, size=length))
        sampling = GREEDY if i % sample_every == 0 else None
        chunks.append(Chunk(cells, tokens, start, sampling))
    return chunks


def split_width(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False)) if parts > 1 else []
    bounds = [0, *cuts, total]
    return [int(b - a) for a, b in zip(bounds, bounds[1:])]


def run_both(artifact, model, call, k_pools, v_pools):
    """The compiled method and the eager model on the same inputs, each on its own copy of the pools."""
    inputs = split_inputs(call)
    ck, cv = clone_pools(k_pools), clone_pools(v_pools)
    ek, ev = clone_pools(k_pools), clone_pools(v_pools)
    compiled = artifact.run(call.method, [*inputs, *ck, *cv])[0]
    with torch.no_grad():
        eager = model(*inputs, ek, ev)
    return compiled, eager, (ck, cv), (ek, ev), inputs


def assert_writes_only_addressed(before, compiled_after, eager_after, write_cells: torch.Tensor):
    addressed = torch.zeros(before[0].shape[0], dtype=torch.bool)
    addressed[write_cells] = True
    for b, c, e in zip(before, compiled_after, eager_after):
        # Untouched cells are byte-identical (compare the bit patterns, not float values).
        assert torch.equal(c[~addressed].view(torch.int32), b[~addressed].view(torch.int32))
        assert torch.equal(e[~addressed].view(torch.int32), b[~addressed].view(torch.int32))
        # Addressed cells (the scratch cell too, when padding wrote it) hold what the eager model writes.
        torch.testing.assert_close(c[addressed], e[addressed], atol=TOLERANCE, rtol=0)
        real = write_cells[write_cells != SCRATCH_CELL]
        torch.testing.assert_close(c[real], e[real], atol=TOLERANCE, rtol=0)
        # And they did change (the step really wrote them).
        assert not torch.equal(c[real], b[real])


def check_parity(artifact, model, call, seed: int):
    cfg = model.config
    k_pools, v_pools = random_pools(cfg, POOL_CELLS, seed)
    compiled, eager, (ck, cv), (ek, ev), inputs = run_both(artifact, model, call, k_pools, v_pools)
    assert compiled.shape == eager.shape == (call.sizes[6], cfg.vocab_size)
    assert compiled.dtype == torch.float32
    diff = (compiled - eager).abs().max().item()
    assert diff <= TOLERANCE, f"{call.method}: max abs logit diff {diff}"
    write_cells = inputs[FORWARD_INPUTS.index("write_cells")]
    assert_writes_only_addressed(k_pools, ck, ek, write_cells)
    assert_writes_only_addressed(v_pools, cv, ev, write_cells)


# ----------------------------------------------------------------------------------- method parity


STATIC_SIZES = DEFAULT_FORWARD_SIZES  # conftest exports with the default forward sizes


@pytest.mark.parametrize(
    "width, fill", [(n, "full") for n in STATIC_SIZES] + [(n, "padded") for n in STATIC_SIZES if n > 1]
)
def test_static_forward_matches_eager(artifact, model, width, fill):
    """A full step, and one with padding (fewer real tokens than the width: padding writes the scratch cell)."""
    assert forward_name(width) in artifact.runners
    rng = np.random.default_rng(width * 10 + (fill == "padded"))
    num_real = width if fill == "full" else width // 2 + 1
    lengths = split_width(rng, num_real, 3)
    chunks = random_chunks(rng, lengths, POOL_CELLS, model.config.vocab_size)
    piece = list(enumerate(chunks))
    entries = artifact.metadata.entries_of(width)
    assert entries == width * TEST_MAX_CONTEXT  # every entry a step of this width can list
    call = pack(piece, forward_name(width), width).padded(entries)
    assert call.sizes[0] == width and call.sizes[5] == entries
    check_parity(artifact, model, call, seed=width)


@pytest.mark.parametrize("num_real", [1, 2, 65, 100, 127, TEST_MAX_STEP_TOKENS])
def test_forward_others_matches_eager(artifact, model, num_real):
    rng = np.random.default_rng(1000 + num_real)
    lengths = split_width(rng, num_real, 3)
    chunks = random_chunks(rng, lengths, POOL_CELLS, model.config.vocab_size, sample_every=1)
    call = pack(list(enumerate(chunks)), FORWARD_OTHERS, None)
    check_parity(artifact, model, call, seed=num_real)


@contextlib.contextmanager
def aoti_input_checks():
    """Make compiled methods check every input's shape against the bounds they were compiled for.

    AOTInductor reads AOTI_RUNTIME_CHECK_INPUTS once per loaded method, at its first run; a fresh load
    inside this block therefore checks, while artifacts loaded and run elsewhere are unaffected.
    """
    old = os.environ.get("AOTI_RUNTIME_CHECK_INPUTS")
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["AOTI_RUNTIME_CHECK_INPUTS"]
        else:
            os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = old


@pytest.mark.parametrize("num_real, num_seqs", [(1, 1), (2, 2), (TEST_MAX_STEP_TOKENS - 1, 2),
                                                (TEST_MAX_STEP_TOKENS, 1), (TEST_MAX_STEP_TOKENS, 3)])
def test_forward_others_inputs_stay_within_compiled_bounds(tiny_artifact, model, num_real, num_seqs):
    """The runtime sends forward_others up to max_step_tokens real tokens (executor.slice_step); with its
    padding token and padding sequence the inputs must still lie inside the dims the method was compiled
    for, or the method runs outside what Inductor assumed (AOTInductor's own input checks say so)."""
    with aoti_input_checks():
        strict = load_artifact(tiny_artifact)
        rng = np.random.default_rng(num_real)
        lengths = split_width(rng, num_real, num_seqs)
        chunks = random_chunks(rng, lengths, POOL_CELLS, model.config.vocab_size, sample_every=1)
        call = pack(list(enumerate(chunks)), FORWARD_OTHERS, None)
        k_pools, v_pools = random_pools(model.config, POOL_CELLS, seed=0)
        logits = strict.run(FORWARD_OTHERS, [*split_inputs(call), *k_pools, *v_pools])[0]
    assert logits.shape == (call.sizes[6], model.config.vocab_size)


def test_every_flag_set_that_validates_can_be_traced(model):
    """Bad flags must fail in validate(), before compile work: what validate() accepts must trace.

    forward sizes (1,) with max step tokens 2 is accepted, but forward_others is traced with a tokens
    dim of min 2 and max max_step_tokens, which torch.export refuses for max 2.
    """
    options = ExportOptions(backend="cpu", output=Path("/tmp/unused.pt2"), preset="tiny-random", forward_sizes=(1,),
                            max_step_tokens=2, max_cells=TEST_MAX_CELLS, max_context=TEST_MAX_CONTEXT)
    options.validate()
    options.validate_for_model(model.config.context_length)
    try:
        trace_forward(model, MethodSpec(FORWARD_OTHERS), options.max_step_tokens, options.max_cells)
    except Exception as err:  # noqa: BLE001 - any failure here is the bug
        pytest.fail(f"validate() accepted flags that cannot be traced: {type(err).__name__}: {err}")


def test_the_default_max_cells_caps_no_pool_a_machine_can_hold(model):
    """Traced with the default bound, a forward takes a pool of more cells than the old default (65,537)
    and reads and writes cells past it as the eager model does."""
    assert DEFAULT_MAX_CELLS >= 2**40 and ExportOptions("cpu", Path("x.pt2")).max_cells == DEFAULT_MAX_CELLS
    program, _ = trace_forward(model, MethodSpec(FORWARD_OTHERS), TEST_MAX_STEP_TOKENS, DEFAULT_MAX_CELLS)
    assert str(DEFAULT_MAX_CELLS + 1) in {str(r.upper) for r in program.range_constraints.values()}
    num_cells = 70_000
    rng = np.random.default_rng(7)
    chunks = random_chunks(rng, [20, 7], num_cells, model.config.vocab_size, sample_every=1)
    assert max(int(c.cells.max()) for c in chunks) > 65_537
    call = pack(list(enumerate(chunks)), FORWARD_OTHERS, None)
    k_pools, v_pools = random_pools(model.config, num_cells, seed=7)
    inputs = split_inputs(call)
    ck, cv, ek, ev = (clone_pools(p) for p in (k_pools, v_pools, k_pools, v_pools))
    with torch.no_grad():
        traced = program.module()(*inputs, ck, cv)
        eager = model(*inputs, ek, ev)
    torch.testing.assert_close(traced, eager, atol=TOLERANCE, rtol=0)
    write_cells = inputs[FORWARD_INPUTS.index("write_cells")]
    assert_writes_only_addressed(k_pools, ck, ek, write_cells)


def test_every_method_is_loaded_by_name(artifact):
    expected = {forward_name(n) for n in STATIC_SIZES} | {FORWARD_OTHERS, SAMPLE, SAMPLE_ARGMAX, ACCEPT_DRAFTS,
                                                          ACCEPT_DRAFTS_SAMPLED}
    assert set(artifact.runners) == expected
    # Samplers, on their own: argmax and a greedy row of `sample`.
    logits = torch.randn(3, artifact.metadata.vocab_size)
    assert torch.equal(artifact.run(SAMPLE_ARGMAX, [logits])[0], logits.argmax(-1))
    zeros = torch.zeros(3)
    ids = artifact.run(SAMPLE, [logits, zeros, torch.ones(3), torch.zeros(3, dtype=torch.int64), zeros])[0]
    assert torch.equal(ids, logits.argmax(-1))


# ---------------------------------------------------------------------------- mixed step vs alone


def run_step(artifact, chunks: list[Chunk], k_pools, v_pools, force_method: str | None = None) -> torch.Tensor:
    """Run one step directly on the artifact; returns the logits of the chunks that ask, in chunk order."""
    meta = artifact.metadata
    num_tokens = sum(len(c.tokens) for c in chunks)
    num_entries = sum(c.end for c in chunks)
    method, width = choose_method(num_tokens, num_entries, meta.forward_sizes, meta.entries_of)
    if force_method == FORWARD_OTHERS:
        method, width = FORWARD_OTHERS, None
    call = pack(list(enumerate(chunks)), method, width)
    if width is not None:
        call = call.padded(meta.entries_of(width))
    logits = artifact.run(call.method, [*split_inputs(call), *k_pools, *v_pools])[0]
    return logits[: len(call.sampled_chunks)], call


@pytest.mark.parametrize("force_method", [None, FORWARD_OTHERS])
def test_mixed_step_matches_each_sequence_alone(artifact, model, force_method):
    cfg = model.config
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, size=n)] for n in (5, 9, 3, 6)]
    decode = [int(t) for t in rng.integers(0, cfg.vocab_size, size=3)]
    # Interleaved, shuffled cells: no sequence's cells are contiguous.
    cell_ids = rng.permutation(np.arange(1, 64)).astype(np.int64)
    cells = [cell_ids[0:10], cell_ids[10:20], cell_ids[20:30], cell_ids[30:40]]
    shape = (64, cfg.num_kv_heads, cfg.head_dim)
    k_pools = [torch.zeros(shape) for _ in range(cfg.num_layers)]
    v_pools = [torch.zeros(shape) for _ in range(cfg.num_layers)]

    alone = [EagerSequence(model, 16) for _ in prompts]
    expected_prefill = [seq.extend(p)[-1] for seq, p in zip(alone[:3], prompts[:3])]
    expected_step = [seq.extend([t])[-1] for seq, t in zip(alone[:3], decode)]
    expected_step.append(alone[3].extend(prompts[3])[-1])

    prefill = [Chunk(cells[i][: len(p)], tuple(p), 0, GREEDY) for i, p in enumerate(prompts[:3])]
    got, call = run_step(artifact, prefill, k_pools, v_pools, force_method)
    assert call.method == (force_method or forward_name(32))  # 17 tokens
    for i in range(3):
        assert (got[i] - expected_prefill[i]).abs().max().item() <= TOLERANCE

    step = [
        Chunk(cells[i][: len(p) + 1], (decode[i],), len(p), GREEDY) for i, p in enumerate(prompts[:3])
    ] + [Chunk(cells[3][: len(prompts[3])], tuple(prompts[3]), 0, GREEDY)]
    got, call = run_step(artifact, step, k_pools, v_pools, force_method)
    assert call.method == (force_method or forward_name(16))  # 3 + 6 tokens
    for i in range(4):
        diff = (got[i] - expected_step[i]).abs().max().item()
        assert diff <= TOLERANCE, f"sequence {i}: max abs logit diff {diff}"


# ------------------------------------------------------------------------------ package contents


def test_package_size_and_weights_stored_once(tiny_artifact, model):
    meta = read_metadata(tiny_artifact).raw
    weights = model_weights(model)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    num_methods = len(meta["methods"])
    size = tiny_artifact.stat().st_size
    budget = weight_bytes * 1.1 + ALLOWANCE_PER_METHOD * num_methods
    assert size < budget, f"package {size} B exceeds {budget:.0f} B ({num_methods} methods)"

    names = [w["name"] for w in meta["weights"]]
    assert len(names) == len(set(names)), "a weight is listed twice"
    assert set(names) == set(weights)
    with zipfile.ZipFile(tiny_artifact) as archive:
        infos = archive.infolist()
    weight_records = [i for i in infos if i.filename.split("/", 1)[-1].startswith(WEIGHTS_PREFIX)]
    assert len(weight_records) == len(meta["weights"])
    assert sorted(i.filename.split("/", 1)[-1] for i in weight_records) == sorted(w["record"] for w in meta["weights"])
    for info in weight_records:
        assert info.compress_type == zipfile.ZIP_STORED  # the loader mmaps them
    by_name = {w["record"]: w for w in meta["weights"]}
    for info in weight_records:
        entry = by_name[info.filename.split("/", 1)[-1]]
        assert info.file_size == int(np.prod(entry["shape"])) * torch.finfo(torch.float32).bits // 8

    # Per method: what the package holds under its folder (reported for the allowance above).
    per_method = {}
    for method, spec in meta["methods"].items():
        prefix = f"data/aotinductor/{spec['internal_name']}/"
        files = [i for i in infos if i.filename.split("/", 1)[-1].startswith(prefix)]
        assert any(i.filename.endswith(".so") for i in files), method
        per_method[method] = sum(i.compress_size for i in files)
    assert max(per_method.values()) < ALLOWANCE_PER_METHOD, per_method
    # Nothing else of any size: weights + methods + metadata account for (almost) the whole file.
    accounted = sum(per_method.values()) + sum(i.compress_size for i in weight_records)
    others = sum(i.compress_size for i in infos) - accounted
    assert others < 200_000, f"{others} B in records that are neither weights nor methods"


def test_no_method_holds_a_copy_of_a_weight(tiny_artifact, model):
    """Weights are stored once: bytes taken from the middle of every weight matrix are found in that
    weight's own record and in no other record. The size budget above cannot show this for the tiny
    preset (its 0.48 MB of weights copied into all ten methods would still fit), this can: a method that
    embedded the weights (in its .so, or a data file beside it) would hold these bytes."""
    needles = {}
    for name, tensor in model_weights(model).items():
        if tensor.dim() == 2:  # random matrices: a 64-byte window occurs once
            data = tensor_bytes(tensor)
            needles[name] = bytes(data[len(data) // 2:len(data) // 2 + 64])
    assert len(needles) >= 2 * model.config.num_layers + 1
    with zipfile.ZipFile(tiny_artifact) as archive:
        for info in archive.infolist():
            record = info.filename.split("/", 1)[-1]
            data = archive.read(info.filename)
            for name, needle in needles.items():
                expected = record == WEIGHTS_PREFIX + name
                assert (needle in data) == expected, f"{record} {'lacks' if expected else 'holds'} bytes of {name}"


def test_package_is_readable_like_any_new_file(tiny_artifact):
    """The package gets the permissions of an ordinary new file (0666 minus the umask), so the user or
    service that serves it can read it; a temporary file's private 0600 must not leak into the result."""
    umask = os.umask(0)
    os.umask(umask)
    mode = stat.S_IMODE(tiny_artifact.stat().st_mode)
    assert mode == 0o666 & ~umask, f"package mode {oct(mode)}, expected {oct(0o666 & ~umask)} (umask {oct(umask)})"


# ------------------------------------------------------------------------------------ metadata


def test_metadata_round_trips(tiny_artifact, model):
    raw = read_metadata(tiny_artifact).raw
    config = get_preset("tiny-random").config
    assert raw["format_version"] == FORMAT_VERSION
    assert raw["model_config"] == json.loads(json.dumps(config.to_dict()))
    assert raw["architecture"] == config.architecture
    assert raw["vocab_size"] == config.vocab_size
    assert raw["max_context"] == TEST_MAX_CONTEXT
    assert raw["cache"] == {
        "num_layers": config.num_layers, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "dtype": "fp32",
    }
    assert raw["max_cells"] == TEST_MAX_CELLS
    assert raw["forward_sizes"] == list(DEFAULT_FORWARD_SIZES)
    assert raw["max_step_tokens"] == TEST_MAX_STEP_TOKENS
    assert raw["min_prefill_chunk"] == DEFAULT_MIN_PREFILL_CHUNK
    assert raw["dtype"] == "fp32"
    assert raw["backend"] == "cpu"
    assert raw["deterministic"] is False
    assert raw["built_with"]["torch"] == torch.__version__
    assert raw["content_hash"] == weights_hash(config.to_dict(), model_weights(model))
    assert raw["tokenizer"] == json.loads(json.dumps(byte_tokenizer_files().to_dict()))
    assert raw["source"] == "preset:tiny-random"
    expected_methods = [forward_name(n) for n in sorted(DEFAULT_FORWARD_SIZES, reverse=True)]
    expected_methods += [FORWARD_OTHERS, SAMPLE, SAMPLE_ARGMAX, ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED]
    assert sorted(raw["methods"]) == sorted(expected_methods)
    internal = [m["internal_name"] for m in raw["methods"].values()]
    assert len(set(internal)) == len(internal)
    assert len({len(n) for n in internal}) == 1  # equal lengths: none is a prefix of another
    for n in DEFAULT_FORWARD_SIZES:
        spec = raw["methods"][forward_name(n)]
        assert spec["width"] == n
        assert spec["num_entries"] == n * TEST_MAX_CONTEXT  # every entry a step of this width can list


def run_cli(*args, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([PT2SERVE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env,
                          **kwargs)


def test_inspect_prints_key_fields(tiny_artifact):
    raw = read_metadata(tiny_artifact).raw
    result = run_cli("inspect", tiny_artifact)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("LlamaForCausalLM", "fp32 / cpu", "forward_64", FORWARD_OTHERS, SAMPLE_ARGMAX,
                 "1, 2, 4, 8, 16, 32, 64", str(TEST_MAX_CELLS), raw["content_hash"], torch.__version__,
                 "sha256 per weight"):
        assert text in out, f"{text!r} not in inspect output:\n{out}"

    result = run_cli("inspect", "--json", tiny_artifact)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == raw


# --------------------------------------------------------------------------------- bad CLI input


def _bad_export_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    ok = tmp / "out.pt2"
    base = ["--backend", "cpu", "--use-offgraph-kv-cache"]
    cases = {
        "no-offgraph-flag": (["--backend", "cpu", "--preset", "tiny", "-o", ok], "--use-offgraph-kv-cache"),
        "sizes-not-increasing": ([*base, "--preset", "tiny", "--forward-sizes", "1,4,2", "-o", ok],
                                 "strictly increasing"),
        "size-not-below-max-step": ([*base, "--preset", "tiny", "--forward-sizes", "1,2,64",
                                     "--max-step-tokens", "64", "-o", ok], "must exceed the widest forward size"),
        "max-cells-too-small": ([*base, "--preset", "tiny", "--max-context", "256", "--max-cells", "100",
                                 "-o", ok], "--max-cells (100) is too small"),
        "unwritable-output": ([*base, "--preset", "tiny", "-o", "/proc/x.pt2"], "not writable"),
        "missing-output-dir": ([*base, "--preset", "tiny", "-o", tmp / "nope" / "x.pt2"], "does not exist"),
        "unknown-preset": ([*base, "--preset", "no-such-model", "-o", ok], "unknown preset 'no-such-model'"),
        "both-sources": ([*base, "--preset", "tiny", "--checkpoint", tmp, "-o", ok], "exactly one"),
        "neither-source": ([*base, "-o", ok], "exactly one"),
    }
    if not torch.cuda.is_available():
        cases["cuda-without-gpu"] = (["--use-offgraph-kv-cache", "--backend", "cuda", "--preset", "tiny",
                                      "-o", ok], "needs a CUDA GPU")
    return cases


@pytest.fixture(scope="module")
def bad_export_results(tmp_path_factory):
    """Every bad-input export, one after another in one interpreter."""
    tmp = tmp_path_factory.mktemp("bad-export")
    cases = _bad_export_cases(tmp)
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    answers = run_in_one_interpreter([["export", *map(str, args)] for args, _ in cases.values()], env)
    results = {name: (*answer, message) for (name, (_, message)), answer in zip(cases.items(), answers)}
    return tmp, results


BAD_EXPORT_CASES = [
    "no-offgraph-flag", "sizes-not-increasing", "size-not-below-max-step", "max-cells-too-small",
    "unwritable-output", "missing-output-dir", "unknown-preset", "both-sources", "neither-source",
    pytest.param("cuda-without-gpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
]


@pytest.mark.parametrize("case", BAD_EXPORT_CASES)
def test_bad_export_input_fails_with_message(bad_export_results, case):
    tmp, results = bad_export_results
    returncode, out, err, message = results[case]
    text = out + err
    assert returncode not in (0, None) and returncode > 0, f"exit {returncode}:\n{text}"
    assert "Traceback" not in text, text
    assert "error:" in err
    assert message in " ".join(text.split()), f"{message!r} not in:\n{text}"
    assert not (tmp / "out.pt2").exists()
    # Nothing left behind: no partial package, no probe file.
    assert not [p for p in tmp.iterdir() if p.name.startswith(".out")]


# ------------------------------------------------------------------------------ interrupted export


def test_interrupted_export_leaves_no_file(tmp_path):
    out = tmp_path / "interrupted.pt2"
    stderr_path = tmp_path / "stderr.txt"
    args = [PT2SERVE, "export", "--backend", "cpu", "--use-offgraph-kv-cache", "--preset", "tiny", "--jobs", "1",
            "--max-context", str(TEST_MAX_CONTEXT), "--max-step-tokens", str(TEST_MAX_STEP_TOKENS),
            "--max-cells", str(TEST_MAX_CELLS), "-o", str(out)]
    with open(stderr_path, "w") as stderr:
        # A shell's background jobs start with SIGINT ignored; give the child the default disposition so
        # Python installs its KeyboardInterrupt handler.
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            # Wait until compiling has started (the progress bar appears), then a little into it.
            deadline = time.monotonic() + 120
            while "compiling methods" not in stderr_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, stderr_path.read_text()
                time.sleep(0.2)
            assert "compiling methods" in stderr_path.read_text(), "export never started compiling"
            time.sleep(3)
            assert proc.poll() is None, "export finished before it could be interrupted"
            proc.send_signal(signal.SIGINT)
            returncode = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert returncode != 0
    assert "Traceback" not in stderr_path.read_text()
    assert not out.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.stem}.")]
    assert leftovers == [], leftovers
