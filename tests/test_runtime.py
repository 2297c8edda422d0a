"""The executor on the toy-greedy artifact (whose greedy continuation is known), the device sampler against
a host reference and hand-computed draws, and the cell allocator."""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from conftest import RECALL_FORWARD_SIZES, TEST_MAX_CONTEXT, TEST_MAX_STEP_TOKENS
from pt2serve.contract import FORWARD_OTHERS, SAMPLE, SAMPLE_ARGMAX, SCRATCH_CELL, forward_name
from pt2serve.model.eager import EagerSequence, greedy_generate
from pt2serve.model.presets import (
    build_preset_model, toy_greedy_continuation, toy_recall_continuation, toy_successor,
)
from pt2serve.runtime.artifact import load_artifact, read_metadata
from pt2serve.runtime.cells import CellAllocator, CellTable
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.sampling import DrawPurpose, RequestRandom, SamplingParams
from pt2serve.runtime.step import FORWARD_LAYOUT, Chunk, pack, region_offsets

VOCAB = 258
GREEDY = SamplingParams()
# Sampling with top_k=1 must still pick the greedy token; it exercises the `sample` method in a step.
TOP1 = SamplingParams(temperature=0.9, top_k=1)


@pytest.fixture(scope="module")
def executor(toy_artifact):
    # Static methods serve steps only under CUDA graphs by default; forced here so the CPU tests run them.
    return Executor(load_artifact(toy_artifact), ExecutorConfig(use_static_methods=True))


@pytest.fixture(scope="module")
def toy_model():
    return build_preset_model("toy-greedy", torch.float32).eval()


# ------------------------------------------------------------------------------------- width test


@dataclass
class Sequence:
    tokens: list[int]  # prompt + designed continuation: the true token at each position
    prompt_length: int
    table: CellTable = field(default_factory=CellTable)

    @property
    def fed(self) -> int:
        return self.table.length

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.fed


def new_sequence(rng: random.Random, min_length: int) -> Sequence:
    total = rng.randint(max(min_length, 2), TEST_MAX_CONTEXT)
    prompt_length = rng.randint(1, total)
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_length)]
    return Sequence(prompt + toy_greedy_continuation(prompt, total - prompt_length), prompt_length)


# (first width, last width, method) for one call of the test artifact (forward sizes 1, 2, 4, ..., 64,
# max_step_tokens 128), worked out by hand: the narrowest static width at least as wide as the step.
HAND_CALLS = [
    (1, 1, "forward_1"), (2, 2, "forward_2"), (3, 4, "forward_4"), (5, 8, "forward_8"), (9, 16, "forward_16"),
    (17, 32, "forward_32"), (33, 64, "forward_64"), (65, 128, FORWARD_OTHERS),
]


def hand_calls(width: int) -> list[tuple[str, int]]:
    """(method, real tokens) of each call of a step `width` tokens wide; wider than 128: one full
    forward_others call, then the rest (the schedule below has only 150 = 128 + 22 there)."""
    if width > TEST_MAX_STEP_TOKENS:
        assert width == 150
        return [(FORWARD_OTHERS, 128), ("forward_32", 22)]
    return [next((method, width) for first, last, method in HAND_CALLS if first <= width <= last)]


def random_lengths(rng: random.Random, width: int) -> list[int]:
    parts = rng.randint(1, min(width, 8))
    cuts = sorted(rng.sample(range(1, width), parts - 1))
    bounds = [0, *cuts, width]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def poison(executor: Executor, cells: np.ndarray) -> None:
    """NaN into freshly allocated cells: a step that read one before it is written returns wrong tokens
    (NaN spreads through 0 * NaN even where the mask hides the cell)."""
    index = torch.from_numpy(np.asarray(cells, dtype=np.int64)).to(executor.device)
    for pool in executor.pools:
        pool.index_fill_(0, index, float("nan"))


def test_toy_greedy_is_the_designed_continuation(toy_model):
    rng = random.Random(3)
    for length in (1, 7, 30):
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        assert greedy_generate(toy_model, prompt, 12) == toy_greedy_continuation(prompt, 12)


def test_every_step_width(executor):
    meta = executor.artifact.metadata
    assert meta.max_step_tokens == TEST_MAX_STEP_TOKENS
    assert meta.forward_sizes == (1, 2, 4, 8, 16, 32, 64)  # what HAND_CALLS was worked out for
    widths = list(range(1, 66)) + [96, 97, TEST_MAX_STEP_TOKENS + 22]
    rng = random.Random(20261130)
    schedule = widths * 3
    rng.shuffle(schedule)
    allocator = executor.allocator
    assert allocator.num_used == 0
    active: list[Sequence] = []

    def retire(seq: Sequence) -> None:
        allocator.free(seq.table.cells.copy())
        active.remove(seq)

    for width in schedule:
        chunks, owners = [], []
        for length in random_lengths(rng, width):
            candidates = [s for s in active if s.remaining >= length and s not in owners]
            if candidates and rng.random() < 0.75:
                seq = rng.choice(candidates)
            else:
                seq = new_sequence(rng, length)
                active.append(seq)
            while not allocator.can_allocate(length):
                retire(rng.choice([s for s in active if s not in owners and s is not seq]))
            start = seq.fed
            fresh = allocator.allocate(length)
            poison(executor, fresh)
            seq.table.append(fresh)
            roll = rng.random()
            sampling = GREEDY if roll < 0.55 else TOP1 if roll < 0.7 else None
            chunks.append(Chunk(seq.table.cells, tuple(seq.tokens[start:start + length]), start, sampling,
                                uniform=rng.random()))
            owners.append(seq)

        result = executor.step(chunks)

        assert [(c.method, c.num_tokens) for c in result.calls] == hand_calls(width), width
        assert len(result.tokens) == len(chunks)
        for chunk, seq, token in zip(chunks, owners, result.tokens):
            if chunk.sampling is None:
                assert token is None
                continue
            designed = toy_successor(seq.tokens[chunk.end - 1])
            assert token == designed, (width, chunk.start, len(chunk.tokens))
            if seq.prompt_length <= chunk.end < len(seq.tokens):
                assert token == seq.tokens[chunk.end]  # the continuation itself
        for seq in owners:
            if seq.remaining == 0 or rng.random() < 0.05:
                retire(seq)

    for seq in list(active):
        retire(seq)
    assert allocator.num_used == 0
    assert allocator.num_free == allocator.capacity


def test_without_cuda_graphs_steps_run_forward_others(toy_artifact):
    """By default static methods serve only captured steps; on the CPU every step runs forward_others, with
    the designed tokens, and no static buffers are made."""
    plain = Executor(load_artifact(toy_artifact), ExecutorConfig(num_cells=512))
    assert plain.forward_sizes == () and not plain.uses_cuda_graphs
    rng = random.Random(4)
    for width in (1, 5, 64):
        prompts = [[rng.randrange(VOCAB)] for _ in range(width)]
        cells = [plain.allocator.allocate(1) for _ in range(width)]
        result = plain.step([Chunk(c, tuple(p), 0, GREEDY) for c, p in zip(cells, prompts)])
        assert [call.method for call in result.calls] == [FORWARD_OTHERS]
        assert list(result.tokens) == [toy_successor(p[0]) for p in prompts]
        for c in cells:
            plain.allocator.free(c)


def test_widest_steps_stay_within_compiled_bounds(toy_artifact):
    """Steps of max_step_tokens tokens (and wider ones, sliced) run forward_others with inputs inside the
    dims it was compiled for. AOTInductor checks that when AOTI_RUNTIME_CHECK_INPUTS is set at a method's
    first run, so a fresh load is made and run with it set (other loads are unaffected)."""
    old = os.environ.get("AOTI_RUNTIME_CHECK_INPUTS")
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    try:
        strict = Executor(load_artifact(toy_artifact), ExecutorConfig(use_static_methods=True))
        rng = random.Random(8)
        for lengths in ([TEST_MAX_STEP_TOKENS], [100, TEST_MAX_STEP_TOKENS - 100], [TEST_MAX_STEP_TOKENS + 22]):
            chunks, seqs = [], []
            for length in lengths:
                seq = new_sequence(rng, length)
                seq.table.append(strict.allocator.allocate(length))
                chunks.append(Chunk(seq.table.cells, tuple(seq.tokens[:length]), 0, GREEDY))
                seqs.append(seq)
            result = strict.step(chunks)
            assert result.tokens == tuple(toy_successor(s.tokens[len(c.tokens) - 1]) for s, c in zip(seqs, chunks))
            for seq in seqs:
                strict.allocator.free(seq.table.cells.copy())
    finally:
        if old is None:
            del os.environ["AOTI_RUNTIME_CHECK_INPUTS"]
        else:
            os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = old


def test_the_width_schedule_reaches_every_method(toy_artifact):
    """The widths test_every_step_width runs reach every forward method of the artifact."""
    meta = read_metadata(toy_artifact)
    seen = {m for w in list(range(1, 66)) + [96, 97, 150] for m, _ in hand_calls(w)}
    assert seen == {m for m in meta.method_names if m.startswith("forward")}


def test_a_static_width_runs_a_step_of_any_context(recall_artifact):
    """At every static width of the toy-recall artifact (whose index holds width x max context entries), a
    step of one token fewer than the width over a short or a whole max-context sequence, beside a one-token
    prompt, runs on that width, never forward_others; it samples toy-recall's tokens (read from the cells 6
    positions back, so any real entry lost shows) and writes no cell but its own tokens' and the scratch
    cell."""
    executor = Executor(load_artifact(recall_artifact), ExecutorConfig(num_cells=1024, use_static_methods=True))
    meta, allocator = executor.artifact.metadata, executor.allocator
    assert meta.forward_sizes == RECALL_FORWARD_SIZES
    assert all(meta.entries_of(width) == width * meta.max_context for width in meta.forward_sizes)
    rng = random.Random(9)
    for width in meta.forward_sizes:
        for long_end in (width, TEST_MAX_CONTEXT - 1):
            # A chunk of width - 2 tokens ending a long context, and a one-token prompt: width - 1 tokens.
            long_tokens = [rng.randrange(VOCAB) for _ in range(long_end)]
            short_tokens = [rng.randrange(VOCAB)]
            long_cells, short_cells = allocator.allocate(long_end), allocator.allocate(1)
            start = long_end - (width - 2)
            executor.step([Chunk(long_cells, tuple(long_tokens[:start]), 0)])  # the context before the step
            before = torch.stack(executor.pools).clone()
            chunks = [Chunk(long_cells, tuple(long_tokens[start:]), start, GREEDY),
                      Chunk(short_cells, tuple(short_tokens), 0, GREEDY)]
            result = executor.step(chunks)
            assert [(c.method, c.num_tokens) for c in result.calls] == [(forward_name(width), width - 1)], width
            assert result.tokens == (toy_recall_continuation(long_tokens, 1)[0],
                                     toy_recall_continuation(short_tokens, 1)[0])
            written = torch.tensor([SCRATCH_CELL, *long_cells[start:], *short_cells])
            unwritten = torch.ones(allocator.num_cells, dtype=torch.bool).index_fill_(0, written, False)
            assert torch.equal(torch.stack(executor.pools)[:, unwritten], before[:, unwritten])
            allocator.free(long_cells)
            allocator.free(short_cells)


@pytest.mark.parametrize("method,width,entries", [("forward_8", 8, 64), ("forward_64", 64, 512), (FORWARD_OTHERS, None, None)])
def test_pack_lays_out_each_chunk(method, width, entries):
    """pack's whole-array layout against a chunk-by-chunk reference, padding included; and the contract
    the compiled attention relies on: seq_cells[seq_indptr[token_seq[t]] + positions[t]] == write_cells[t].
    The index holds the step's own entries and is the packed array's last region, so a graph buffer takes a
    step by copying its front; padded to a static method's length, it is the same step."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        piece, left, next_cell = [], width or 40, 1
        while left:
            length, start = int(rng.integers(1, left + 1)), int(rng.integers(0, 5))
            cells = rng.permutation(np.arange(next_cell, next_cell + start + length + 2))  # any order, spare cells
            next_cell += start + length + 2
            sampling = GREEDY if rng.random() < 0.6 else None
            piece.append((len(piece), Chunk(cells, tuple(rng.integers(0, VOCAB, length).tolist()), start, sampling)))
            left -= length
            if width is not None and rng.random() < 0.3:
                break  # leave padding
        call = pack(piece, method, width)
        real_entries = sum(chunk.end for _, chunk in piece)
        padded = width is not None and sum(len(chunk.tokens) for _, chunk in piece) < width
        assert call.num_entries == (real_entries + 1 if width is None else max(2, real_entries + padded))
        offsets, _ = region_offsets(call.sizes, FORWARD_LAYOUT)
        assert offsets[5] == max(offsets)  # seq_cells is stored last
        if entries is not None:
            full = call.padded(entries)
            assert full.num_entries == entries
            assert all(np.array_equal(a[: len(b)], b) for a, b in zip(full.regions(), call.regions()))
            call = full
        tokens, positions, write_cells, token_seq, indptr, seq_cells, logit_rows = call.regions()
        at, entry, sampled_rows = 0, 0, []
        for row, (_, chunk) in enumerate(piece):
            span = slice(at, at + len(chunk.tokens))
            assert tokens[span].tolist() == list(chunk.tokens)
            assert positions[span].tolist() == list(range(chunk.start, chunk.end))
            assert write_cells[span].tolist() == chunk.cells[chunk.start:chunk.end].tolist()
            assert (token_seq[span] == row).all()
            assert seq_cells[entry:entry + chunk.end].tolist() == chunk.cells[:chunk.end].tolist()
            entry += chunk.end
            assert indptr[row + 1] == entry
            at = span.stop
            if chunk.sampling is not None:
                sampled_rows.append(at - 1)
        assert (write_cells[at:] == SCRATCH_CELL).all() and (seq_cells[entry:] == SCRATCH_CELL).all()
        assert (token_seq[at:] == len(piece)).all()
        assert logit_rows[: len(sampled_rows)].tolist() == sampled_rows
        assert np.array_equal(seq_cells[indptr[token_seq] + positions], write_cells)


# ---------------------------------------------------------------------------------------- sampler


def _pick(probs: np.ndarray, top_p: float, top_k: int, uniform: float) -> tuple[int, int]:
    """Sampling by its definition, on probabilities sorted in descending order: (rank chosen, ranks kept).

    Kept: the top_k most probable tokens (all for top_k <= 0), and of those the smallest leading set whose
    probability reaches top_p (nucleus sampling). Chosen: the kept token whose interval of the kept
    probability mass, laid out in rank order, contains uniform x the kept mass.
    """
    limit = min(top_k, len(probs)) if top_k > 0 else len(probs)
    reaching = int(np.searchsorted(np.cumsum(probs), top_p, side="left")) + 1  # first prefix with mass >= top_p
    kept = max(1, min(limit, reaching))
    bounds = np.cumsum(probs[:kept])
    return min(int(np.searchsorted(bounds, uniform * bounds[-1], side="right")), kept - 1), kept


def reference_sample(logits: np.ndarray, temperature: float, top_p: float, top_k: int, uniform: float,
                     eps: float = 2e-5) -> tuple[int, set[int], np.ndarray]:
    """The sampler on the host: (token, tokens reachable within float32 rounding, kept ids in rank order).

    Probabilities are the softmax of logits / temperature in float64, ranked by a stable descending sort
    (equal logits keep index order). The device works in float32, so a draw or top-p cut within `eps` of
    a boundary may land on a neighbour: the second value holds every token reachable by moving the draw
    and top_p by +-eps (a single token when the row is unambiguous).
    """
    if temperature <= 0:
        token = int(np.argmax(logits))
        return token, {token}, np.array([token])
    scaled = (logits.astype(np.float32) / np.float32(temperature)).astype(np.float64)
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    u, p = float(np.float32(uniform)), float(np.float32(top_p))
    choice, kept = _pick(probs, p, top_k, u)
    reachable = {
        int(order[_pick(probs, p + dp, top_k, min(max(u + du, 0.0), 1.0))[0]])
        for dp in (-eps, 0.0, eps) for du in (-eps, 0.0, eps)
    }
    return int(order[choice]), reachable, order[:kept]


# Four tokens carry all the probability (0.5, 0.3, 0.15, 0.05 on tokens 7, 3, 200, 100); every other
# token's logit is -1000. (temperature, top_p, top_k, uniform) -> token, each worked out by hand.
HAND_PROBS = {7: 0.5, 3: 0.3, 200: 0.15, 100: 0.05}
HAND_CASES = [
    ((1.0, 1.0, 0, 0.10), 7),  # cumulative mass 0.5 | 0.8 | 0.95 | 1.0; the draw is 0.10
    ((1.0, 1.0, 0, 0.60), 3),
    ((1.0, 1.0, 0, 0.85), 200),
    ((1.0, 1.0, 0, 0.97), 100),
    ((1.0, 0.75, 0, 0.60), 7),  # 0.5 + 0.3 reaches 0.75: keeps 7, 3 (mass 0.8); 0.6 x 0.8 = 0.48 < 0.5
    ((1.0, 0.75, 0, 0.70), 3),  # 0.7 x 0.8 = 0.56
    ((1.0, 0.75, 0, 0.99), 3),
    ((1.0, 0.40, 0, 0.99), 7),  # 0.5 alone reaches 0.4
    ((1.0, 1.0, 2, 0.99), 3),  # top 2 kept
    ((1.0, 1.0, 3, 0.99), 200),  # top 3: 0.99 x 0.95 = 0.94 > 0.8
    ((1.0, 1.0, 1, 0.99), 7),
    ((0.5, 1.0, 0, 0.60), 7),  # probabilities squared, renormalised: 0.685 | 0.932 | 0.993 | 1.0
    ((0.5, 1.0, 0, 0.90), 3),
    ((0.5, 1.0, 0, 0.95), 200),
    ((0.0, 1.0, 0, 0.99), 7),  # greedy
]


def test_sampler_picks_the_hand_computed_tokens(executor):
    logits = np.full(VOCAB, -1000.0, dtype=np.float32)
    for token, prob in HAND_PROBS.items():
        logits[token] = np.log(prob)
    params = np.array([case for case, _ in HAND_CASES], dtype=np.float64)
    got = run_sample(executor.artifact, np.tile(logits, (len(HAND_CASES), 1)), params[:, 0].astype(np.float32),
                     params[:, 1].astype(np.float32), params[:, 2].astype(np.int64), params[:, 3].astype(np.float32))
    assert got.tolist() == [token for _, token in HAND_CASES]
    # Equal logits: the lower token id ranks first (a stable sort), so it owns the lower half of the mass.
    ties = np.full(VOCAB, -1000.0, dtype=np.float32)
    ties[[5, 10]] = 0.0
    got = run_sample(executor.artifact, np.tile(ties, (2, 1)), np.ones(2, np.float32), np.ones(2, np.float32),
                     np.zeros(2, np.int64), np.array([0.25, 0.75], np.float32))
    assert got.tolist() == [5, 10]


def run_sample(artifact, logits, temperature, top_p, top_k, uniform) -> np.ndarray:
    inputs = [
        torch.as_tensor(logits, dtype=torch.float32),
        torch.as_tensor(temperature, dtype=torch.float32),
        torch.as_tensor(top_p, dtype=torch.float32),
        torch.as_tensor(top_k, dtype=torch.int64),
        torch.as_tensor(uniform, dtype=torch.float32),
    ]
    return artifact.run(SAMPLE, inputs)[0].numpy()


def random_sampling_rows(rng: np.random.Generator, rows: int):
    logits = (rng.standard_normal((rows, VOCAB)) * rng.uniform(0.5, 4.0, size=(rows, 1))).astype(np.float32)
    # Some rows with many exact ties (small integer logits): stable order decides among equals.
    ties = rng.random(rows) < 0.2
    logits[ties] = rng.integers(-3, 4, size=(int(ties.sum()), VOCAB)).astype(np.float32)
    temperature = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5, 5.0], size=rows).astype(np.float32)
    top_p = rng.choice([1.0, 0.95, 0.8, 0.5, 0.1, 0.001], size=rows).astype(np.float32)
    top_k = rng.choice([0, 0, 1, 2, 5, 40, 257, 258, 1000], size=rows).astype(np.int64)
    uniform = rng.random(rows, dtype=np.float32)
    uniform[:5] = 0.0
    uniform[5:10] = np.nextafter(np.float32(1.0), np.float32(0.0))
    return logits, temperature, top_p, top_k, uniform


def test_sampler_matches_host_reference(executor):
    rng = np.random.default_rng(0)
    rows = 400
    logits, temperature, top_p, top_k, uniform = random_sampling_rows(rng, rows)
    got = run_sample(executor.artifact, logits, temperature, top_p, top_k, uniform)
    mismatched, ambiguous = [], 0
    for r in range(rows):
        token, reachable, kept = reference_sample(logits[r], temperature[r], top_p[r], top_k[r], uniform[r])
        if temperature[r] == 0:
            assert got[r] == np.argmax(logits[r]), r  # greedy rows: argmax
        if top_k[r] > 0 and temperature[r] > 0:
            # Never outside the top k (ranked by the stable descending order).
            order = np.argsort(-(logits[r] / temperature[r]), kind="stable")
            assert got[r] in order[: top_k[r]], r
        assert got[r] in kept, r
        if len(reachable) > 1:
            ambiguous += 1
            assert got[r] in reachable, (r, int(got[r]), reachable)
        elif got[r] != token:
            mismatched.append((r, int(got[r]), token))
    assert mismatched == []
    assert ambiguous <= rows // 20, f"{ambiguous} ambiguous rows: the reference tolerance is too coarse"


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 10), (0.7, 0.6, 0), (2.0, 0.9, 6), (1.3, 0.75, 20)],
)
def test_sampler_frequencies_follow_the_restricted_softmax(executor, temperature, top_p, top_k):
    rng = np.random.default_rng(1)
    draws = 50_000
    row = (rng.standard_normal(VOCAB) * 2.5).astype(np.float32)
    # The distribution the sampler should follow: softmax of row / temperature restricted to the kept set.
    _, _, kept = reference_sample(row, temperature, top_p, top_k, 0.5)
    scaled = row.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    expected = np.zeros(VOCAB)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert 2 <= len(kept) <= 40, len(kept)  # small support: 50k draws estimate it well

    uniform = rng.random(draws, dtype=np.float32)
    got = run_sample(
        executor.artifact, np.tile(row, (draws, 1)), np.full(draws, temperature), np.full(draws, top_p),
        np.full(draws, top_k), uniform,
    )
    counts = np.bincount(got, minlength=VOCAB) / draws
    assert set(np.flatnonzero(counts)) <= set(kept.tolist())  # never outside the kept set
    total_variation = 0.5 * np.abs(counts - expected).sum()
    # Sampling error of 50k draws over <= 40 outcomes is about 0.4 * sqrt(40 / 50k) ~ 0.011 at worst.
    assert total_variation < 0.02, total_variation


def test_sampling_follows_the_strides_of_padded_logits(executor):
    """A forward's logits may come back with padded rows (seen on the GPU for this odd vocab in fp32);
    the compiled samplers assume contiguous rows, so the executor must hand them contiguous logits."""
    padded = torch.randn(5, VOCAB + 2, generator=torch.Generator().manual_seed(0)).to(executor.device)
    logits = padded[:, :VOCAB]
    expected = logits.argmax(-1).tolist()
    for sampling in (GREEDY, TOP1):  # sample_argmax, then sample
        chunks = [Chunk(np.arange(1), (1,), 0, sampling, uniform=0.5)] * len(expected)
        assert executor._sample(logits, chunks).tolist() == expected, sampling


def test_sample_argmax_is_argmax(executor):
    logits = torch.randn(37, VOCAB, generator=torch.Generator().manual_seed(5))
    assert torch.equal(executor.artifact.run(SAMPLE_ARGMAX, [logits])[0], logits.argmax(-1))
    # One row too (the traced example had 3; rows are dynamic).
    assert torch.equal(executor.artifact.run(SAMPLE_ARGMAX, [logits[:1]])[0], logits[:1].argmax(-1))


def test_request_random_is_seeded_and_keyed_by_position_and_purpose():
    a, b, c = RequestRandom(42), RequestRandom(42), RequestRandom(43)
    draws_a = [a.uniform(position) for position in range(1000)]
    assert draws_a == [b.uniform(position) for position in range(1000)]
    assert draws_a != [c.uniform(position) for position in range(1000)]
    # Out of order, the same draws: nothing depends on how many were taken before.
    assert [a.uniform(position) for position in reversed(range(1000))] == draws_a[::-1]
    accepts = [a.uniform(position, DrawPurpose.ACCEPT) for position in range(1000)]
    assert sum(x == y for x, y in zip(draws_a, accepts)) < 5
    assert all(0.0 <= u < 1.0 for u in draws_a + accepts)
    assert all(float(np.float32(u)) == u for u in draws_a)  # exact in fp32: never rounds up to 1.0
    assert abs(np.mean(draws_a) - 0.5) < 0.03 and abs(np.mean(accepts) - 0.5) < 0.03
    unseeded = [RequestRandom(None).uniform(0) for _ in range(3)]
    assert len(set(unseeded)) == 3


# ------------------------------------------------------------------------------------------- pool


def test_allocator_start_clone_end_in_random_order():
    rng = random.Random(11)
    allocator = CellAllocator(300)
    holds: Counter = Counter()  # cell -> holders, the test's own model of the refcounts
    sequences: list[np.ndarray] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not sequences:  # start
            n = rng.randint(1, 40)
            cells = allocator.allocate(n)
            if cells is None:
                assert allocator.num_free < n
                continue
            assert len(cells) == n and len(set(cells.tolist())) == n
            assert SCRATCH_CELL not in cells
            assert not any(holds[c] for c in cells.tolist()), "handed out a cell that is held"
            holds.update(cells.tolist())
            sequences.append(cells)
        elif op < 0.65:  # clone: share a prefix, fresh cells for the rest
            parent = rng.choice(sequences)
            k = rng.randint(0, len(parent))
            extra = rng.randint(0, 20)
            fresh = allocator.allocate(extra)
            if fresh is None:
                continue
            assert not any(holds[c] for c in fresh.tolist())
            allocator.share(parent[:k])
            holds.update(parent[:k].tolist())
            holds.update(fresh.tolist())
            sequences.append(np.concatenate([parent[:k], fresh]))
        else:  # end
            seq = sequences.pop(rng.randrange(len(sequences)))
            allocator.free(seq)
            holds.subtract(seq.tolist())
        held = {c for c, n in holds.items() if n > 0}
        assert allocator.num_used == len(held)
    for seq in sequences:
        allocator.free(seq)
    assert allocator.num_used == 0
    assert allocator.num_free == allocator.capacity
    assert sorted(allocator.allocate(allocator.capacity).tolist()) == list(range(1, 300))


def test_freeing_unheld_cells_raises():
    allocator = CellAllocator(10)
    with pytest.raises(ValueError):
        allocator.free(np.array([3]))  # never handed out
    with pytest.raises(ValueError):
        allocator.free(np.array([SCRATCH_CELL]))
    cells = allocator.allocate(4)
    allocator.free(cells[:2])
    with pytest.raises(ValueError):
        allocator.free(cells[:1])  # freed already
    with pytest.raises(ValueError):
        allocator.free(cells)  # half of them freed already: nothing may change
    assert allocator.num_used == 2
    allocator.free(cells[2:])
    assert allocator.num_used == 0


def test_freeing_a_cell_twice_in_one_call_raises():
    """A cell held once and listed twice in one free() is a double free, and must not corrupt the pool."""
    allocator = CellAllocator(10)
    cells = allocator.allocate(3)
    with pytest.raises(ValueError):
        allocator.free(np.array([cells[0], cells[0]]))
    allocator.free(cells)
    assert allocator.num_used == 0


def test_clone_sees_the_shared_prefix(executor, toy_model):
    allocator = executor.allocator
    assert allocator.num_used == 0
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(20)]
    parent = CellTable(allocator.allocate(len(prompt)))
    result = executor.step([Chunk(parent.cells, tuple(prompt), 0, GREEDY)])
    assert result.tokens == (toy_successor(prompt[-1]),)

    shared = 12
    allocator.share(parent.cells[:shared])
    clone = CellTable(parent.cells[:shared].copy())
    branch = [rng.randrange(VOCAB) for _ in range(5)]
    clone.append(allocator.allocate(len(branch)))
    result = executor.step([Chunk(clone.cells, tuple(branch), shared, GREEDY)])
    assert result.tokens == (toy_successor(branch[-1]),)

    # The parent ends: the shared cells stay held by the clone.
    allocator.free(parent.cells)
    assert allocator.num_used == len(clone.cells)

    # Logits, not only the argmax: the clone's next step must attend to the shared prefix's K/V.
    token = rng.randrange(VOCAB)
    clone.append(allocator.allocate(1))
    call = pack([(0, Chunk(clone.cells, (token,), shared + len(branch), GREEDY))], FORWARD_OTHERS, None)
    logits = executor.artifact.run(FORWARD_OTHERS, [*call.device_inputs("cpu"), *executor.pools])[0][0]
    expected = EagerSequence(toy_model, 32).extend(prompt[:shared] + branch + [token])[-1]
    assert (logits - expected).abs().max().item() <= 1e-4
    # The check is sensitive: another prefix gives logits that differ by far more than the tolerance.
    other = EagerSequence(toy_model, 32).extend([(t + 1) % VOCAB for t in prompt[:shared]] + branch + [token])[-1]
    assert (other - expected).abs().max().item() > 1e-3

    allocator.free(clone.cells)
    assert allocator.num_used == 0
