"""The executor: runs steps of chunks on a loaded artifact and returns sampled token ids.

It owns the device state (KV pools, captured graphs) and only reads the step it is given; which cells
belong to whom is the caller's business (see cells.CellAllocator). Only token ids come back to the host.

`launch(chunks)` queues a step's device work and returns at once (no host synchronisation: inputs go up
from pinned memory, sampled ids come down into pinned memory behind an event); `PendingStep.result()`
waits for the ids. So a caller can plan and launch step n+1 while step n runs. A decode whose token is
step n's sample for its sequence names that sample (Chunk.previous_sample) and the executor copies the
id into step n+1's inputs on the device, in stream order.

A step that samples for a grammar-constrained chunk (Chunk.grammar) returns a DeferredSampling after its
forward: its caller reads the previous step's ids meanwhile, fills the token masks, and then queues the
sampling (see grammar.py).

A verifying chunk (Chunk.drafts) is judged by the artifact's acceptance method after the forward, and comes
back as the tokens its sequence emits (verify.py); the caller commits only those. A decode that follows it
in the next step, planned before that is known and as if every draft were accepted, is completed here on
the device: its first token is the last one emitted, its positions and write cells move back by the drafts
rejected; a sampled one takes its draws from its windows at the positions it moved to (Chunk.draw_window).
Drafts of a device drafter (DFlash) are drafted at launch (behind a verify: from its last token and
a context as much shorter, on the device) and copied into the step's token rows and the acceptance inputs
on the device; the host never reads them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from pt2serve.contract import ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED, SAMPLE, SAMPLE_ARGMAX, SCRATCH_CELL
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.artifact import Artifact
from pt2serve.runtime.cells import (
    CellAllocator,
    allocate_kv_pools,
    available_memory_bytes,
    bytes_per_cell,
    check_pool_fits,
)
from pt2serve.runtime.dflash import DFlashDrafter
from pt2serve.runtime.drafter import DeviceDrafter, DraftRequest
from pt2serve.runtime.grammar import apply_masks, bitmask_words
from pt2serve.runtime.graphs import capture_all
from pt2serve.runtime.logits import LogitsProcessor
from pt2serve.runtime.logprobs import ScoredRows, TokenLogprob, score
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import (
    Chunk,
    MethodCall,
    choose_method,
    forward_regions,
    pack,
    regions,
    slice_step,
    with_entries,
)
from pt2serve.runtime.verify import acceptance_inputs, emitted_tokens


# On the CPU the pool shares host memory with everything else, and a CPU serves few tokens at a time: by
# default it holds no more than this many tokens (or one max-context sequence, if longer).
CPU_POOL_TOKENS = 65536
_SCRATCH_ONLY = np.array([SCRATCH_CELL])  # the cells of a one-token sequence that touches only the scratch cell


@dataclass(frozen=True)
class ExecutorConfig:
    # None: as many cells as kv_memory_fraction of the free memory holds (on the CPU, at most CPU_POOL_TOKENS),
    # within the artifact's max_cells.
    num_cells: int | None = None
    # Of the device memory free once the weights are loaded (on the CPU, of the host memory available); the
    # rest is left for CUDA graphs and step activations, which cannot be measured first: the graphs capture
    # the pool's address, so the pool is allocated before them.
    kv_memory_fraction: float = 0.6
    use_cuda_graphs: bool = True
    # None: the static methods serve steps only where CUDA graphs capture them (their purpose); without a
    # graph a step pays for the padding of its width and index and gains nothing (with masked attention,
    # CPU artifacts, the whole index is gathered: tiny-random, 64 decodes, 51 ms on forward_64 against 3.3 ms on
    # forward_others). True forces them (tests, checks of the methods).
    use_static_methods: bool | None = None
    # Run the artifact's DFlash draft (--speculate dflash): allocate its cell pool and write its context with
    # every forward. The artifact must hold one (export --draft).
    draft: bool = False
    # Refuse an artifact not exported with --deterministic. The flag asks, it changes nothing at run time: a
    # deterministic artifact's methods compute every row the same way with or without it, and nothing the
    # runtime chooses (width, company, chunking, prefix reuse) enters a row's arithmetic.
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.num_cells is not None and self.num_cells < 2:
            raise Pt2ServeError(f"num_cells must be at least 2, got {self.num_cells}")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise Pt2ServeError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")


@dataclass(frozen=True)
class CallRecord:
    method: str
    num_tokens: int  # real tokens (without padding)


@dataclass(frozen=True)
class StepResult:
    tokens: tuple[int | None, ...]  # per chunk: the sampled next token, None where none was asked for
    calls: tuple[CallRecord, ...]
    device_seconds: float | None = None  # the step's time on the GPU (CUDA events); None on the CPU
    # Per chunk, where asked for: the sampled token's log probability, and the scored prompt rows' in order.
    logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    # Per chunk: for a verifying chunk, the tokens its sequence emits (accepted drafts, then one more); else None.
    verified: tuple[tuple[int, ...] | None, ...] = ()


@dataclass(frozen=True)
class _ScoredPrompt:
    rows: ScoredRows
    targets: list[int]  # each row's target token


class PendingStep:
    """A launched step: its device work is queued; result() waits for the sampled ids (one host sync)."""

    def __init__(self, chunks: list[Chunk], calls: tuple[CallRecord, ...], sampled: list[int],
                 ids: torch.Tensor | None, started: torch.cuda.Event | None,
                 scored: list[ScoredRows | _ScoredPrompt] = (),
                 verified: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = ()) -> None:
        self._chunks = chunks
        self._calls = calls
        self._sampled = sampled  # the chunk index of each row of ids
        self._started = started
        self._ended: torch.cuda.Event | None = None
        self._scored = scored  # sampled rows' (ScoredRows) and prompt rows' (_ScoredPrompt) log probabilities
        self._verified = [indices for indices, _, _ in verified]  # per acceptance call: its chunks' indices
        downloads = [ids] if ids is not None else []
        downloads += [t for _, num_accepted, accepted_ids in verified for t in (num_accepted, accepted_ids)]
        downloads += [t for block in scored for t in _rows(block).tensors]
        self._host = downloads
        if started is not None:  # CUDA: copy everything down behind the queued work, in one sync
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in downloads]
            for host, device in zip(self._host, downloads):
                host.copy_(device, non_blocking=True)
            self._ended = torch.cuda.Event(enable_timing=True)
            self._ended.record()

    def result(self) -> StepResult:
        device_seconds = None
        if self._ended is not None:
            self._ended.synchronize()
            device_seconds = self._started.elapsed_time(self._ended) / 1e3
        num_chunks = len(self._chunks)
        tokens: list[int | None] = [None] * num_chunks
        host = list(self._host)
        if self._sampled:
            for index, token in zip(self._sampled, host.pop(0).tolist()):
                tokens[index] = token
        verified: list[tuple[int, ...] | None] = [None] * num_chunks
        for indices in self._verified:
            num_accepted, ids = host.pop(0).tolist(), host.pop(0).tolist()
            for index, emitted in zip(indices, emitted_tokens(num_accepted, ids)):
                verified[index] = emitted
        if not self._scored:
            return StepResult(tuple(tokens), self._calls, device_seconds, verified=tuple(verified))
        logprobs: list[TokenLogprob | None] = [None] * num_chunks
        prompt: list[list[TokenLogprob]] = [[] for _ in range(num_chunks)]
        for block in self._scored:
            rows = _rows(block)
            count = len(rows.tensors)
            values, host = host[:count], host[count:]
            if isinstance(block, _ScoredPrompt):
                for chunk, row in zip(rows.chunks, rows.read(values, block.targets)):
                    prompt[chunk].append(row)
            else:
                for chunk, row in zip(rows.chunks, rows.read(values, [tokens[c] for c in rows.chunks])):
                    logprobs[chunk] = row
        return StepResult(tuple(tokens), self._calls, device_seconds, tuple(logprobs),
                          tuple(tuple(rows) for rows in prompt), tuple(verified))


def _rows(block: ScoredRows | _ScoredPrompt) -> ScoredRows:
    return block.rows if isinstance(block, _ScoredPrompt) else block


@dataclass(frozen=True)
class _Forwarded:
    """A step whose forwards are queued: the sampled rows' logits per call, still on the device."""

    chunks: list[Chunk]
    calls: tuple[CallRecord, ...]
    to_sample: list[tuple[torch.Tensor, tuple[int, ...], list[Chunk]]]  # (logits, chunk indices, chunks) per call
    to_verify: list[tuple[torch.Tensor, tuple[int, ...], list[Chunk]]]  # the same, for verifying chunks
    scored: list[_ScoredPrompt]
    started: torch.cuda.Event | None
    drafted: "_DeviceDrafts | None" = None
    shifted: "_DrawShift | None" = None


@dataclass(frozen=True)
class _DeviceDrafts:
    """A step's drafts from a device drafter: ids [sequences, width] on the device, and each chunk's row."""

    ids: torch.Tensor
    rows: dict[int, int]  # chunk index -> row of ids

    def copy_into(self, target: torch.Tensor, places: list[int], chunks_and_counts: list[tuple[int, int]],
                  to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        """Write each (chunk index, number of drafts)'s drafts, in order, at places of the flat target.

        One host-to-device copy carries both index lists: the places, then the drafts' flat indices into ids.
        """
        width = self.ids.shape[1]
        sources = [self.rows[c] * width + j for c, count in chunks_and_counts for j in range(count)]
        index = to_device(np.array(places + sources, dtype=np.int64))
        target.index_copy_(0, index[:len(places)], self.ids.reshape(-1).index_select(0, index[len(places):]))


@dataclass(frozen=True)
class _DrawShift:
    """A step's chunks behind a verify with draw windows (Chunk.draw_window): on the device, the positions each
    falls short of that verify's drafts all accepted (0, or < 0), so that its draws come from its window there."""

    shortfall: torch.Tensor
    rows: dict[int, int]  # chunk index -> row of shortfall

    def copy_into(self, targets: list[tuple[torch.Tensor, Callable[[Chunk], tuple[float, ...]]]],
                  indices: tuple[int, ...], chunks: list[Chunk],
                  to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        """Rows of a call (`indices`: their chunk indices) whose chunks have draw windows: in each (target [rows,
        width], window of a chunk), the row becomes its window from column draw_window + shortfall on. One copy
        carries the rows and columns, one per target the windows."""
        windowed = [(row, index, chunk) for row, (index, chunk) in enumerate(zip(indices, chunks)) if chunk.draw_window]
        if not windowed:
            return
        num, width = len(windowed), targets[0][0].shape[1]
        columns = np.array([chunk.draw_window for _, _, chunk in windowed], dtype=np.int64)[:, None] + np.arange(width)
        index = to_device(np.concatenate([[row for row, _, _ in windowed], [self.rows[i] for _, i, _ in windowed],
                                          columns.reshape(-1)]))
        rows, columns = index[:num], index[2 * num:].view(num, width)
        columns = columns + self.shortfall.index_select(0, index[num:2 * num])[:, None]
        for target, window_of in targets:
            windows = [window_of(chunk) for _, _, chunk in windowed]
            padded = np.zeros((num, max(map(len, windows)) + width), dtype=np.float32)
            for row, window in enumerate(windows):
                padded[row, :len(window)] = window
            target.index_copy_(0, rows, to_device(padded).gather(1, columns))


class DeferredSampling:
    """A launched step with grammar-constrained rows: its forward is queued, its sampling waits for masks.

    Nothing else may run on the executor before sample(): the logits live in the forward's output buffer.
    """

    def __init__(self, executor: "Executor", step: _Forwarded) -> None:
        self._executor = executor
        self._step = step

    def sample(self, fill: Callable[[int, torch.Tensor, int], None]) -> PendingStep:
        """Queue the sampling; fill(chunk index, bitmask, row) writes each constrained row's allowed tokens
        into a pinned int32 bitmask whose rows start all-allowed. It goes up without waiting."""
        executor = self._executor
        num_rows = sum(len(rows) for _, _, rows in self._step.to_sample)
        pinned = executor.device.type == "cuda"
        bitmask = torch.full((num_rows, bitmask_words(executor.artifact.metadata.vocab_size)), -1,
                             dtype=torch.int32, pin_memory=pinned)
        row = 0
        for _, indices, rows in self._step.to_sample:
            for index, chunk in zip(indices, rows):
                if chunk.grammar:
                    fill(index, bitmask, row)
                row += 1
        device_mask = bitmask.to(executor.device, non_blocking=True) if pinned else bitmask
        return executor._sample_step(self._step, device_mask)


@dataclass(frozen=True)
class MemoryReport:
    weight_bytes: int
    pool_bytes: int
    graph_bytes: int
    num_cells: int  # with the scratch cell: the pool holds num_cells - 1 tokens
    pool_sized_by: str  # what set the pool's size, in words
    pool_seconds: float  # sizing and allocating (zeroing) the pool
    capture_seconds: float
    setup_seconds: float  # all of the executor's setup: the pool, the graphs and the rest


class Executor:
    def __init__(self, artifact: Artifact, config: ExecutorConfig = ExecutorConfig()) -> None:
        self.artifact = artifact
        meta = artifact.metadata
        if config.deterministic and not meta.deterministic:
            raise Pt2ServeError(
                f"{artifact.path} was not exported with --deterministic, so a row's logits may change with what "
                "shares its step; re-export it with `pt2serve export --deterministic ...`, or run without "
                "--deterministic")
        self.device = artifact.device
        self.uses_cuda_graphs = config.use_cuda_graphs and self.device.type == "cuda"
        use_static = self.uses_cuda_graphs if config.use_static_methods is None else config.use_static_methods
        self.forward_sizes = meta.forward_sizes if use_static else ()  # () sends every step to forward_others
        self.max_step_tokens = meta.max_step_tokens
        setup_started = pool_started = time.perf_counter()
        num_cells, sized_by = self._pool_size(config)
        cache = meta.cache
        with _out_of_memory_explained(f"allocating a KV pool of {num_cells} cells"):
            self._pool_storage, k_pools, v_pools = allocate_kv_pools(
                cache["num_layers"], num_cells, cache["num_kv_heads"], cache["head_dim"], meta.kv_dtype, self.device
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pool is zeroed on the device: count that here
        pool_seconds = time.perf_counter() - pool_started
        self.pools = [*k_pools, *v_pools]
        self.allocator = CellAllocator(num_cells)
        self.logits_processor = LogitsProcessor(meta.vocab_size, self.device, self._to_device)
        # Artifacts exported before speculation lack the acceptance methods.
        self.can_verify = ACCEPT_DRAFTS in artifact.runners and ACCEPT_DRAFTS_SAMPLED in artifact.runners
        self._previous_ids: torch.Tensor | None = None
        self._previous_rows: dict[int, int] = {}
        self._previous_emitted: tuple[torch.Tensor, torch.Tensor] | None = None  # see _sample_step
        self._previous_verified_rows: dict[int, int] = {}
        free_before = _free_device_bytes(self.device)
        # Before the forwards are captured: their graphs then write the draft context too.
        self.draft: DFlashDrafter | None = None
        if config.draft:
            with _out_of_memory_explained("allocating the draft's cells"):
                self.draft = DFlashDrafter(artifact, num_cells, self.uses_cuda_graphs)
        idle_steps = {}
        for width in self.forward_sizes if self.uses_cuda_graphs else ():
            method = f"forward_{width}"
            idle = pack([], method, width)
            idle_steps[method] = (idle, with_entries(idle.sizes, meta.entries_of(width)))
        with _out_of_memory_explained("capturing CUDA graphs"):
            self._graphs, capture_seconds = capture_all(
                self._run_forward, idle_steps, self.pools, self.device, self.uses_cuda_graphs
            )
        graph_bytes = max(0, free_before - _free_device_bytes(self.device)) if self.uses_cuda_graphs else 0
        pool_bytes = self._pool_storage.numel() * self._pool_storage.element_size()
        self.memory = MemoryReport(
            weight_bytes=artifact.report.weight_bytes,
            pool_bytes=pool_bytes + (self.draft.pool_bytes if self.draft is not None else 0),
            graph_bytes=graph_bytes,
            num_cells=num_cells,
            pool_sized_by=sized_by,
            pool_seconds=pool_seconds,
            capture_seconds=capture_seconds,
            setup_seconds=time.perf_counter() - setup_started,
        )

    def reserve_step(self, num_tokens: int, num_sampled: int) -> int:
        """Run a step of `num_tokens` tokens, `num_sampled` of them one-token sequences sampled with top-p (the
        sampler's widest path), and return the device memory it left reserved (0 on the CPU). Its tokens write
        and read only the scratch cell, as padding does: no real cell is touched. Run at load with a runner's
        widest step, the caching allocator holds that step's memory from the start."""
        reserved_before = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        sampling = SamplingParams(temperature=1.0, top_p=0.5)
        chunks = [Chunk(_SCRATCH_ONLY, (0,), 0, sampling, uniform=0.5)] * num_sampled
        if num_tokens > num_sampled:
            rest = num_tokens - num_sampled
            chunks.append(Chunk(np.full(rest, SCRATCH_CELL), (0,) * rest, 0))
        with _out_of_memory_explained(f"running the widest step ({num_tokens} tokens, {num_sampled} sampled)",
                                      "lower --token-budget, --num-cells or --kv-memory-fraction"):
            self.step(chunks)
        if self.device.type != "cuda":
            return 0
        return max(0, torch.cuda.memory_reserved(self.device) - reserved_before)

    def _pool_size(self, config: ExecutorConfig) -> tuple[int, str]:
        """The pool's cells (with the scratch cell) and what decided it."""
        meta = self.artifact.metadata
        limit = meta.max_cells + 1  # + the scratch cell
        if config.num_cells is not None:
            if config.num_cells > limit:
                raise Pt2ServeError(f"num_cells {config.num_cells} exceeds the artifact's max_cells + 1 ({limit})")
            check_pool_fits(config.num_cells, meta.cache, meta.kv_dtype, self.device)
            return config.num_cells, "as asked"
        cache = meta.cache
        memory = "device memory free after the weights" if self.device.type == "cuda" else "host memory available"
        available = available_memory_bytes(self.device)
        if available is None:  # a host that cannot tell: the CPU default
            return min(limit, max(CPU_POOL_TOKENS, meta.max_context) + 1), "the CPU default"
        per_cell = bytes_per_cell(cache["num_layers"], cache["num_kv_heads"], cache["head_dim"], meta.kv_dtype)
        if config.draft and meta.draft is not None:
            # The draft's pool mirrors every cell: the same fraction of memory holds both.
            draft = meta.draft["cache"]
            per_cell += bytes_per_cell(draft["num_layers"], draft["num_kv_heads"], draft["head_dim"], meta.kv_dtype)
        fits = int(available * config.kv_memory_fraction) // per_cell
        if fits < meta.max_context + 1:
            raise Pt2ServeError(
                f"only {fits} KV cells fit in {config.kv_memory_fraction:.0%} of the {memory}, fewer than one "
                f"max-context sequence needs ({meta.max_context + 1}); free memory, raise --kv-memory-fraction or "
                "set --num-cells"
            )
        sized_by = f"{config.kv_memory_fraction:.0%} of the {memory}"
        if self.device.type != "cuda" and fits > max(CPU_POOL_TOKENS, meta.max_context) + 1:
            fits, sized_by = max(CPU_POOL_TOKENS, meta.max_context) + 1, "the CPU default"
        if fits > limit:
            return limit, "the artifact's max_cells"
        return fits, sized_by

    def method_calls(self, chunks: list[Chunk]) -> list[tuple[list[tuple[int, Chunk]], MethodCall]]:
        """How a step runs: each in-order piece of it and the packed call of the method that runs it."""
        meta = self.artifact.metadata
        planned = []
        for piece in slice_step(chunks, self.max_step_tokens):
            num_tokens = sum(len(c.tokens) for _, c in piece)
            num_entries = sum(c.end for _, c in piece)
            method, width = choose_method(num_tokens, num_entries, self.forward_sizes, meta.entries_of)
            planned.append((piece, pack(piece, method, width)))
        return planned

    def step(self, chunks: list[Chunk]) -> StepResult:
        """Run one step and wait for it; the chunks' cells must already be allocated (K/V are written here)."""
        return self.launch(chunks).result()

    def launch(self, chunks: list[Chunk], drafter: DeviceDrafter | None = None) -> PendingStep | DeferredSampling:
        """Queue one step's device work; returns before it runs (on the CPU, after it ran). A step that samples
        for a grammar-constrained chunk returns after its forward: its sampling waits for the token masks.
        `drafter` drafts the verifying chunks whose drafts are placeholders (Chunk.drafts_on_device), first."""
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        drafted = self._draft(chunks, drafter)
        shifted = self._draw_shift(chunks)
        to_sample, to_verify, calls, scored = [], [], [], []
        for piece, call in self.method_calls(chunks):
            logits = self._forward(call, drafted)
            by_index = dict(piece)
            num_sampled = len(call.sampled_chunks)
            if num_sampled:
                rows = [by_index[i] for i in call.sampled_chunks]
                to_sample.append((logits[:num_sampled], call.sampled_chunks, rows))
            if call.verified_chunks:
                verifying = [by_index[i] for i in call.verified_chunks]
                num_rows = sum(len(c.drafts) + 1 for c in verifying)
                to_verify.append((logits[num_sampled:num_sampled + num_rows], call.verified_chunks, verifying))
                num_sampled += num_rows
            if call.prompt_rows:
                scored.append(self._score_prompt(logits[num_sampled:], call, by_index))
            calls.append(CallRecord(call.method, call.num_tokens))
        step = _Forwarded(chunks, tuple(calls), to_sample, to_verify, scored, started, drafted, shifted)
        if any(chunk.grammar for _, _, rows in to_sample for chunk in rows):
            return DeferredSampling(self, step)
        return self._sample_step(step, None)

    def _sample_step(self, step: _Forwarded, bitmask: torch.Tensor | None) -> PendingStep:
        """Queue the sampling of a forwarded step (`bitmask`: allowed tokens per sampled row, or None)."""
        outputs, sampled, scored = [], [], list(step.scored)
        for logits, indices, rows in step.to_sample:
            mask, bitmask = (bitmask[: len(rows)], bitmask[len(rows):]) if bitmask is not None else (None, None)
            ids = self._sample(logits, rows, mask, indices, step.shifted)
            outputs.append(ids)
            sampled.extend(indices)
            scored += self._score_sampled(logits, ids, indices, rows)
        ids = (outputs[0] if len(outputs) == 1 else torch.cat(outputs)) if outputs else None
        # What a placeholder in the next step reads: this step's ids, by chunk index.
        self._previous_ids = ids
        self._previous_rows = {chunk: row for row, chunk in enumerate(sampled)}
        verified, emitted = [], []
        for logits, indices, rows in step.to_verify:
            num_accepted, accepted_ids, num_drafts = self._verify(logits, indices, rows, step.drafted, step.shifted)
            verified.append((indices, num_accepted, accepted_ids))
            # Per verifying chunk, for a chunk that follows it in the next step: the last token it emits and
            # how many positions it falls short of all its drafts accepted (<= 0).
            emitted.append((accepted_ids.gather(1, num_accepted[:, None])[:, 0], num_accepted - num_drafts))
        self._previous_emitted = tuple(torch.cat(parts) for parts in zip(*emitted)) if emitted else None
        self._previous_verified_rows = {chunk: row for row, chunk in
                                        enumerate(c for _, indices, _ in step.to_verify for c in indices)}
        return PendingStep(step.chunks, step.calls, sampled, ids, step.started, scored, verified)

    def _draft(self, chunks: list[Chunk], drafter: DeviceDrafter | None) -> _DeviceDrafts | None:
        """Draft, on the device, the chunks whose drafts are placeholders: each from its pending token and the
        cells of the positions before it (queued before the forwards, which read the drafts). A chunk that
        follows the previous step's sample takes its pending token from there, and one behind a verify also
        its context's length (moved back by the drafts rejected), on the device."""
        indices = [index for index, chunk in enumerate(chunks) if chunk.drafts_on_device]
        if not indices:
            return None
        assert drafter is not None, "drafts to be drafted on the device, and no device drafter"
        last = self._to_device(np.array([chunks[i].tokens[0] for i in indices], dtype=np.int64))
        following = [row for row, i in enumerate(indices) if chunks[i].previous_sample is not None]
        shortfall = None
        if following:
            followed_last, followed_shortfall = self._followed([chunks[indices[row]].previous_sample
                                                                for row in following])
            rows = self._to_device(np.array(following, dtype=np.int64))
            last.index_copy_(0, rows, followed_last)
            shortfall = torch.zeros(len(indices), dtype=torch.int64, device=self.device)
            shortfall.index_copy_(0, rows, followed_shortfall)
        requests = [DraftRequest(chunks[i].cells[:chunks[i].start], len(chunks[i].drafts)) for i in indices]
        ids = drafter.draft_on_device(requests, last, shortfall)
        return _DeviceDrafts(ids, {index: row for row, index in enumerate(indices)})

    def _draw_shift(self, chunks: list[Chunk]) -> _DrawShift | None:
        """Where the draws of the chunks with draw windows start in them, on the device (before any sampling: it
        reads the previous step's acceptance)."""
        windowed = [index for index, chunk in enumerate(chunks) if chunk.draw_window]
        if not windowed:
            return None
        _, shortfall = self._followed([chunks[i].previous_sample for i in windowed])
        return _DrawShift(shortfall, {index: row for row, index in enumerate(windowed)})

    def _verify(self, logits: torch.Tensor, indices: tuple[int, ...], chunks: list[Chunk],
                drafted: _DeviceDrafts | None,
                shifted: _DrawShift | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Judge the verifying chunks' drafts on the device: (num_accepted [S], ids [S, K1], num_drafts [S])."""
        if not self.can_verify:
            raise Pt2ServeError("this artifact has no acceptance methods (exported before speculation): "
                                "re-export it to speculate")
        inputs = acceptance_inputs(chunks)
        shape = (inputs.num_seqs, inputs.width)
        row_index, drafts, num_drafts, top_k = regions(self._to_device(inputs.ints), inputs.int_sizes)
        on_device = [(s, index, len(chunk.drafts)) for s, (index, chunk) in enumerate(zip(indices, chunks))
                     if chunk.drafts_on_device]
        if on_device:  # the device drafter's drafts, in place of their placeholders
            places = [s * inputs.width + j for s, _, count in on_device for j in range(count)]
            drafted.copy_into(drafts, places, [(c, n) for _, c, n in on_device], self._to_device)
        row_index, drafts = row_index.view(shape), drafts.view(shape)
        logits = logits.contiguous()  # see _sample: compiled methods assume contiguous rows
        if inputs.is_greedy:
            return (*self.artifact.run(ACCEPT_DRAFTS, [logits, row_index, drafts, num_drafts]), num_drafts)
        temperature, top_p, accept_uniform, sample_uniform = regions(self._to_device(inputs.floats),
                                                                     inputs.float_sizes)
        accept_uniform, sample_uniform = accept_uniform.view(shape), sample_uniform.view(shape)
        if shifted is not None:  # behind a verify: the draws at the positions it left each chunk at
            shifted.copy_into([(accept_uniform, lambda chunk: chunk.accept_uniforms),
                               (sample_uniform, lambda chunk: chunk.sample_uniforms)], indices, chunks, self._to_device)
        return (*self.artifact.run(ACCEPT_DRAFTS_SAMPLED, [
            logits, row_index, drafts, num_drafts, temperature, top_p, top_k,
            accept_uniform, sample_uniform]), num_drafts)

    def _score_sampled(self, logits: torch.Tensor, ids: torch.Tensor, indices: tuple[int, ...],
                       rows: list[Chunk]) -> list[ScoredRows]:
        """Log probabilities of the sampled tokens of the rows that asked for them (none: no device work)."""
        wanted = [row for row, chunk in enumerate(rows) if chunk.logprobs is not None]
        if not wanted:
            return []
        if len(wanted) < len(rows):
            select = self._to_device(np.array(wanted, dtype=np.int64))
            logits, ids = logits.index_select(0, select), ids.index_select(0, select)
        return [score(logits, ids, [indices[r] for r in wanted], [rows[r].logprobs for r in wanted])]

    def _score_prompt(self, logits: torch.Tensor, call: MethodCall, by_index: dict[int, Chunk]) -> _ScoredPrompt:
        """Log probabilities of the prompt tokens that follow each scored prompt row."""
        targets = [by_index[index].prompt_targets for index, _ in call.prompt_rows]
        flat = [t for block in targets for t in block]
        row_chunks = [index for index, count in call.prompt_rows for _ in range(count)]
        tops = [by_index[index].prompt_logprobs for index in row_chunks]
        device_targets = self._to_device(np.array(flat, dtype=np.int64))
        return _ScoredPrompt(score(logits[: len(flat)], device_targets, row_chunks, tops), flat)

    def _forward(self, call: MethodCall, drafted: _DeviceDrafts | None = None) -> torch.Tensor:
        graph = self._graphs.get(call.method)
        if graph is not None:
            graph.load(call.host)  # the front of the buffer: the index holds the rest of its capacity
            self._fill_placeholders(call, graph.inputs)
            self._fill_drafts(call, graph.inputs[0], drafted)
            return graph.run()
        if call.width is not None:  # a static method without a graph: its index at the method's fixed length
            call = call.padded(self.artifact.metadata.entries_of(call.width))
        inputs = forward_regions(self._to_device(call.host), call.sizes)
        self._fill_placeholders(call, inputs)
        self._fill_drafts(call, inputs[0], drafted)
        return self._run_forward(call.method, [*inputs, *self.pools])[0]

    def _fill_drafts(self, call: MethodCall, tokens: torch.Tensor, drafted: _DeviceDrafts | None) -> None:
        """Copy the device drafter's drafts into this call's token rows that hold their placeholders."""
        if not call.device_drafts:
            return
        rows = [first + j for first, count, _ in call.device_drafts for j in range(count)]
        drafted.copy_into(tokens, rows, [(c, n) for _, n, c in call.device_drafts], self._to_device)

    def _run_forward(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run a forward method; with a draft, also write the draft context of the step's tokens from its taps."""
        outputs = self.artifact.run(method, inputs)
        if self.draft is not None:
            positions, write_cells = inputs[1], inputs[2]
            self.draft.write_context(outputs[1], positions, write_cells)
        return outputs

    def _fill_placeholders(self, call: MethodCall, inputs: list[torch.Tensor]) -> None:
        """Complete, on the device, this call's chunks that follow the previous step's samples (its FORWARD_INPUTS
        `inputs`, in place): each first token is the id sampled there; a chunk behind a verifying chunk gets the
        last token that one emits, and its positions and write cells move back by the drafts it rejected."""
        if not call.placeholders:
            return
        previous = [chunk for _, _, chunk in call.placeholders]
        last, shortfall = self._followed(previous)
        tokens, positions, write_cells, token_seq, seq_indptr, seq_cells = inputs[:6]
        first_rows = [row for row, _, _ in call.placeholders]
        if not any(chunk in self._previous_verified_rows for chunk in previous):
            tokens.index_copy_(0, self._to_device(np.array(first_rows, dtype=np.int64)), last)
            return
        rows = [row + i for row, count, _ in call.placeholders for i in range(count)]
        row_chunks = [n for n, (_, count, _) in enumerate(call.placeholders) for _ in range(count)]
        index = self._to_device(np.array(first_rows + rows + row_chunks, dtype=np.int64))
        first_rows, (rows, row_chunks) = index[:len(first_rows)], index[len(first_rows):].view(2, -1)
        tokens.index_copy_(0, first_rows, last)
        positions.index_add_(0, rows, shortfall.index_select(0, row_chunks))
        # Each token's cell is its sequence's entry at its (new) position (contract.FORWARD_INPUTS).
        entries = seq_indptr.index_select(0, token_seq.index_select(0, rows)) + positions.index_select(0, rows)
        write_cells.index_copy_(0, rows, seq_cells.index_select(0, entries))

    def _followed(self, previous: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """For chunks of the previous step (by index), on the device: the last token each emits (its sample, or a
        verify's last token), and how many positions it falls short of all its drafts accepted (0, or < 0)."""
        last = torch.empty(len(previous), dtype=torch.int64, device=self.device)
        shortfall = torch.zeros(len(previous), dtype=torch.int64, device=self.device)
        sampled = [(n, self._previous_rows[c]) for n, c in enumerate(previous) if c in self._previous_rows]
        behind = [(n, self._previous_verified_rows[c]) for n, c in enumerate(previous)
                  if c in self._previous_verified_rows]
        assert len(sampled) + len(behind) == len(previous), "a placeholder the previous step does not fill"
        if sampled:
            index = self._to_device(np.array(sampled, dtype=np.int64).T.copy())
            last.index_copy_(0, index[0], self._previous_ids.index_select(0, index[1]))
        if behind:
            index = self._to_device(np.array(behind, dtype=np.int64).T.copy())
            emitted, short = self._previous_emitted
            last.index_copy_(0, index[0], emitted.index_select(0, index[1]))
            shortfall.index_copy_(0, index[0], short.index_select(0, index[1]))
        return last, shortfall

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without waiting: through pinned memory, on the current stream."""
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _sample(self, logits: torch.Tensor, chunks: list[Chunk], mask: torch.Tensor | None = None,
                indices: tuple[int, ...] = (), shifted: _DrawShift | None = None) -> torch.Tensor:
        """Sampled ids [rows], on the device; `mask` (a bitmask per row, on the device) bans tokens. `indices`:
        the rows' chunk indices, by which `shifted` finds the draws of chunks behind a verify."""
        processed, slots = self.logits_processor.apply(logits, chunks)
        if mask is not None:
            if processed is logits:  # the raw logits stay as they are: log probabilities are read from them
                processed = logits.clone()
            apply_masks(processed, mask)
        # A compiled method reads its inputs with the strides it was traced with (contiguous), but a
        # forward's logits may come back with padded rows (seen on the GPU: 258 -> 260 floats in fp32).
        logits = processed.contiguous()
        params = [c.sampling for c in chunks]
        if all(p.is_greedy for p in params):
            ids = self.artifact.run(SAMPLE_ARGMAX, [logits])[0]
        else:
            # One upload for the three float rows; each row starts 16-byte aligned, as compiled kernels assume
            # (a misaligned input is copied by the method first: seen on the GPU).
            num_rows = len(params)
            floats = np.zeros((3, -(-num_rows // 4) * 4), dtype=np.float32)
            floats[:, :num_rows] = [[p.temperature for p in params], [p.top_p for p in params],
                                    [c.uniform for c in chunks]]
            floats = self._to_device(floats)[:, :num_rows]
            if shifted is not None:  # behind a verify: the draw at the position it left each chunk at
                shifted.copy_into([(floats[2].view(-1, 1), lambda chunk: chunk.sample_uniforms)], indices, chunks,
                                  self._to_device)
            top_k = self._to_device(np.array([p.top_k for p in params], dtype=np.int64))
            ids = self.artifact.run(SAMPLE, [logits, floats[0], floats[1], top_k, floats[2]])[0]
        self.logits_processor.count(ids, chunks, slots)
        return ids


def _free_device_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, _total = torch.cuda.mem_get_info(device)
    return free


@contextmanager
def _out_of_memory_explained(doing: str, remedy: str = "lower --num-cells, or free the GPU") -> Iterator[None]:
    try:
        yield
    except torch.OutOfMemoryError:
        raise Pt2ServeError(f"out of device memory {doing}: {remedy}") from None
