"""Step planning: which method runs a step, slicing over-wide steps, and packing the step's inputs.

A step is a list of chunks, each a run of consecutive tokens of one sequence. Its inputs are packed into
ONE int64 host array, so the device gets them in one copy and a captured graph reads them from
fixed-address slices of one buffer. The context index comes last (FORWARD_LAYOUT), because only it varies
in length from step to step:

    [ tokens T | positions T | write_cells T | token_seq T | seq_indptr R+1 | logit_rows S | seq_cells E ]

A static method's index has the fixed length its export gave it: with the attention kernel, every entry a
step of that width can list (each token its own sequence at the max context). Its graph buffer holds all of
it, but a step packs and copies only the entries it lists (the graph never reads past seq_indptr[R]), so
the host's work scales with the step's real context, not with that capacity.

The logit rows come in three groups: each sampling chunk's last token, then every row of each verifying
chunk (its pending token and its drafts: see verify.py), then the scored prompt rows.

Each region starts on a 128-byte boundary (REGION_ALIGN elements): compiled GPU kernels assume
aligned inputs, as the separate tensors they were traced with were.

Padding keeps every shape valid: padding tokens form their own sequence (row R_real), sit at position 0,
write the scratch cell and see only it, so they never touch real cells and never produce NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from pt2serve.contract import FORWARD_OTHERS, SCRATCH_CELL, forward_name
from pt2serve.runtime.sampling import SamplingParams


REGION_ALIGN = 16  # int64 elements: 128 bytes
# The order of the forward inputs (contract.FORWARD_INPUTS) in a packed array: seq_cells (5) last.
FORWARD_LAYOUT = (0, 1, 2, 3, 4, 6, 5)
ENTRIES = 5  # seq_cells' index in FORWARD_INPUTS


def region_offsets(sizes: tuple[int, ...], layout: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], int]:
    """Start of each input region in the packed array (in `sizes`' order), and the array's length.

    `layout`: the order the regions are stored in (default: the order of `sizes`)."""
    offsets, at = [0] * len(sizes), 0
    for index in layout or range(len(sizes)):
        offsets[index] = at
        at += -(-sizes[index] // REGION_ALIGN) * REGION_ALIGN
    return tuple(offsets), at


def regions(packed, sizes: tuple[int, ...], layout: tuple[int, ...] | None = None) -> list:
    """The input regions of a packed array or tensor, as views (in `sizes`' order)."""
    offsets, _ = region_offsets(sizes, layout)
    return [packed[start:start + size] for start, size in zip(offsets, sizes)]


def forward_regions(packed, sizes: tuple[int, ...]) -> list:
    """The FORWARD_INPUTS regions of a packed forward step."""
    return regions(packed, sizes, FORWARD_LAYOUT)


def with_entries(sizes: tuple[int, ...], num_entries: int) -> tuple[int, ...]:
    """A forward's region sizes with another seq_cells length (a graph buffer's capacity)."""
    return sizes[:ENTRIES] + (num_entries,) + sizes[ENTRIES + 1:]


@dataclass(frozen=True)
class Chunk:
    """Tokens start..start+len(tokens)-1 of one sequence; `sampling` set when its next token is wanted.

    A decode whose token is the one sampled for this sequence by the step still in flight does not know it on
    the host: `previous_sample` is the index of that sampling chunk in the previous step's chunk list, its
    first token is a placeholder, and the executor copies the sampled id into place on the device. When that
    chunk verifies drafts, the id is the last token it emits, and the chunk was planned as if every one of
    those drafts were accepted: the executor moves its positions back by the rejected ones (and rereads its
    write cells at the new positions), on the device.

    Log probabilities (see logprobs.py): `logprobs` (a number of alternatives) scores the sampled token;
    `prompt_targets` are the tokens that follow the chunk's first len(prompt_targets) tokens, each of which
    is scored with `prompt_logprobs` alternatives.

    Logits controls (see logits.py): `banned` tokens cannot be sampled (min_tokens); a request with penalties
    keeps token counts on the device under `request_id`, set up from `penalty_prompt` at its first sample.
    `grammar`: the sample is constrained by a grammar; its mask comes after the forward (grammar.py).

    Speculation (verify.py): a chunk whose last len(drafts) tokens are `drafts` is verified, not sampled: all
    its rows are scored, and per row `accept_uniforms` (one per draft) and `sample_uniforms` (one per row) are
    the request's draws for the token at that row's position. With `drafts_on_device` the drafts are
    placeholders: a device drafter drafts them as the step launches and they go into its inputs there.

    Behind a verify (previous_sample names one), a sampled chunk's positions may fall back by up to that
    verify's drafts, `draw_window`: its draws then start that many positions early (`sample_uniforms`, and a
    verifying chunk's `accept_uniforms`, are longer by draw_window; a sampled chunk's window is its
    `sample_uniforms`, its `uniform` the last of them), and the executor takes each row's draw at the position
    the verify leaves it at, on the device.
    """

    cells: np.ndarray  # the sequence's cells for positions 0 .. start + len(tokens) - 1
    tokens: tuple[int, ...]
    start: int
    sampling: SamplingParams | None = None
    uniform: float = 0.0
    previous_sample: int | None = None
    logprobs: int | None = None
    prompt_targets: tuple[int, ...] = ()
    prompt_logprobs: int = 0
    request_id: int | None = None
    banned: tuple[int, ...] = ()
    penalty_prompt: tuple[int, ...] = ()
    grammar: bool = False
    drafts: tuple[int, ...] = ()
    accept_uniforms: tuple[float, ...] = ()
    sample_uniforms: tuple[float, ...] = ()
    drafts_on_device: bool = False  # its drafts are placeholders: the executor's device drafter writes them
    draw_window: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_sampled(self) -> bool:
        """Its next token is sampled from its last row (a verifying chunk's come from the acceptance method)."""
        return self.sampling is not None and not self.drafts


@dataclass(frozen=True)
class MethodCall:
    """One call of one method: its packed inputs and where the sampled rows go."""

    method: str
    width: int | None  # static width, None for forward_others
    host: np.ndarray  # int64, the packed inputs
    sizes: tuple[int, ...]  # length of each input region, in FORWARD_INPUTS order
    sampled_chunks: tuple[int, ...]  # index (in the step's chunk list) of each output row, in row order
    num_tokens: int  # real tokens, without padding
    # (first token row, rows, index of the previous step's chunk whose sampled id goes in the first row), for
    # chunks whose first token is a placeholder: a decode, or a verifying chunk whose drafts follow it
    placeholders: tuple[tuple[int, int, int], ...] = ()
    # (chunk index, rows): logit rows after the sampled ones, each chunk's scored prompt rows, in order
    prompt_rows: tuple[tuple[int, int], ...] = ()
    # index of each verifying chunk, in row order: its 1 + len(drafts) rows follow the sampled rows
    verified_chunks: tuple[int, ...] = ()
    # (first draft row, drafts, chunk index) of each verifying chunk whose drafts a device drafter writes
    device_drafts: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_entries(self) -> int:
        return self.sizes[ENTRIES]

    def padded(self, num_entries: int) -> "MethodCall":
        """The same call with its index padded (by the scratch cell) to a static method's fixed length: what
        the method takes when it runs without the graph buffer that holds the rest."""
        sizes = with_entries(self.sizes, num_entries)
        host = np.zeros(region_offsets(sizes, FORWARD_LAYOUT)[1], dtype=np.int64)
        host[: len(self.host)] = self.host  # the index is the last region: SCRATCH_CELL (0) fills the rest
        return replace(self, host=host, sizes=sizes)

    def regions(self) -> list[np.ndarray]:
        """The input regions of the packed host array, as views (in FORWARD_INPUTS order)."""
        return forward_regions(self.host, self.sizes)

    def device_inputs(self, device: torch.device | str) -> list[torch.Tensor]:
        """The input regions on `device`, from one copy of the packed array."""
        return forward_regions(torch.from_numpy(self.host).to(device), self.sizes)


def slice_step(chunks: list[Chunk], max_tokens: int) -> list[list[tuple[int, Chunk]]]:
    """Split a step into consecutive pieces of at most `max_tokens` tokens.

    Each item keeps the index of the chunk it came from. A chunk cut in two asks for a token only from
    its last part; later pieces run after earlier ones, so they see the cells the earlier ones wrote. A
    verifying chunk is never cut (its rows are judged together): it starts a new piece if it does not fit.
    """
    pieces: list[list[tuple[int, Chunk]]] = [[]]
    room = max_tokens
    for index, chunk in enumerate(chunks):
        if chunk.drafts and len(chunk.tokens) > room:
            assert len(chunk.tokens) <= max_tokens, "a verifying chunk wider than a step"
            pieces.append([])
            room = max_tokens
        start = chunk.start
        tokens, targets = chunk.tokens, chunk.prompt_targets
        while tokens:
            if room == 0:
                pieces.append([])
                room = max_tokens
            take = min(room, len(tokens))
            is_last = take == len(tokens)
            end = start + take
            part = replace(chunk, cells=chunk.cells[:end], tokens=tokens[:take], start=start,
                           sampling=chunk.sampling if is_last else None, logprobs=chunk.logprobs if is_last else None,
                           prompt_targets=targets[:take])
            pieces[-1].append((index, part))
            tokens, targets, start, room = tokens[take:], targets[take:], end, room - take
    return [piece for piece in pieces if piece]


def choose_method(
    num_tokens: int, num_entries: int, forward_sizes: tuple[int, ...], entries_of
) -> tuple[str, int | None]:
    """The narrowest static width that holds the step (its tokens, and its entries in the method's fixed index
    length, entries_of(width)), else forward_others."""
    for width in forward_sizes:
        if width >= num_tokens:
            padding_entries = 1 if width > num_tokens else 0
            if num_entries + padding_entries <= entries_of(width):
                return forward_name(width), width
            break  # wider static methods would waste more; the dynamic one fits any entry count
    return FORWARD_OTHERS, None


def pack(piece: list[tuple[int, Chunk]], method: str, width: int | None) -> MethodCall:
    """Lay out one piece's inputs for `method` (static `width`, or forward_others when width is None).

    The index holds the step's own entries (at least 2): a graph buffer takes them as they are, a static
    method run without one takes MethodCall.padded.

    Whole-array numpy operations rather than a loop over chunks: this runs on the host before every
    device call, and a per-chunk loop took 0.45 ms for 64 decodes (5% of an 8B step on an H200), against
    0.1 ms now (scripts/host_overhead.py).
    """
    chunks = [chunk for _, chunk in piece]
    count_list, end_list = [len(c.tokens) for c in chunks], [c.start + len(c.tokens) for c in chunks]
    num_real, num_seqs, real_entries = sum(count_list), len(chunks), sum(end_list)
    counts, ends = np.array(count_list, dtype=np.int64), np.array(end_list, dtype=np.int64)
    if width is None:
        # forward_others: one padding token in its own sequence keeps T >= 2 and R + 1 >= 3.
        num_tokens, num_padding = num_real + 1, 1
        num_rows_seq = num_seqs + 1
        num_entries = real_entries + 1
    else:
        num_tokens, num_padding = width, width - num_real
        num_rows_seq = width
        num_entries = max(2, real_entries + (num_padding > 0))
    sampled = [i for i, c in enumerate(chunks) if c.is_sampled]
    verified = [i for i, c in enumerate(chunks) if c.drafts]
    scored = [i for i, c in enumerate(chunks) if c.prompt_targets]
    num_verified = sum(len(chunks[i].drafts) + 1 for i in verified)
    num_scored = sum(len(chunks[i].prompt_targets) for i in scored)
    num_logit_rows = width if width is not None else max(2, len(sampled) + num_verified + num_scored)
    sizes = (num_tokens,) * 4 + (num_rows_seq + 1, num_entries, num_logit_rows)
    host = np.zeros(region_offsets(sizes, FORWARD_LAYOUT)[1], dtype=np.int64)
    tokens, positions, write_cells, token_seq, indptr, seq_cells, logit_rows = forward_regions(host, sizes)
    # Sequence r's context is entries indptr[r] .. indptr[r + 1], one per position; its chunk's tokens are
    # the last counts[r] positions of it, so each token's cell is the entry at its position.
    indptr[1:num_seqs + 1] = np.cumsum(ends)
    if chunks:  # straight into place: a temporary this large costs page faults on every step
        np.concatenate([c.cells[:end] for c, end in zip(chunks, end_list)], out=seq_cells[:real_entries])
    tokens[:num_real] = [t for c in chunks for t in c.tokens]
    token_seq[:num_real] = np.repeat(np.arange(num_seqs), counts)
    row_ends = np.cumsum(counts) - 1  # each chunk's last token
    positions[:num_real] = np.arange(num_real) - np.repeat(row_ends + 1 - ends, counts)
    write_cells[:num_real] = seq_cells[indptr[token_seq[:num_real]] + positions[:num_real]]
    entry_end = real_entries
    if num_padding:
        # tokens and positions stay 0; the padding sequence is row num_seqs with the scratch cell alone.
        write_cells[num_real:] = SCRATCH_CELL
        token_seq[num_real:] = num_seqs
        seq_cells[entry_end] = SCRATCH_CELL
        entry_end += 1
    indptr[num_seqs + 1:] = entry_end
    seq_cells[entry_end:] = SCRATCH_CELL
    logit_rows[: len(sampled)] = row_ends[sampled]
    # Then every row of each verifying chunk: its pending token's and its drafts'.
    after = len(sampled) + num_verified
    if verified:
        logit_rows[len(sampled):after] = np.concatenate(
            [np.arange(row_ends[i] - len(chunks[i].drafts), row_ends[i] + 1) for i in verified])
    # Then the scored prompt rows: a chunk's first tokens, whose next token is known (never a sampled row).
    row_starts = row_ends + 1 - counts
    scored_rows = [np.arange(len(chunks[i].prompt_targets)) + row_starts[i] for i in scored]
    before_scored, after = after, after + num_scored
    if scored_rows:
        logit_rows[before_scored:after] = np.concatenate(scored_rows)
    logit_rows[after:] = num_tokens - 1  # extra rows: any valid token; their logits are ignored
    # A placeholder chunk is a decode (one token, or its pending token then drafts); its first token stays 0 here.
    placeholders = tuple(
        (int(row_starts[i]), len(c.tokens), c.previous_sample) for i, c in enumerate(chunks)
        if c.previous_sample is not None
    )
    device_drafts = tuple((int(row_starts[i]) + 1, len(chunks[i].drafts), piece[i][0]) for i in verified
                          if chunks[i].drafts_on_device)
    return MethodCall(
        method=method,
        width=width,
        host=host,
        sizes=sizes,
        sampled_chunks=tuple(piece[i][0] for i in sampled),
        num_tokens=num_real,
        placeholders=placeholders,
        prompt_rows=tuple((piece[i][0], len(chunks[i].prompt_targets)) for i in scored),
        verified_chunks=tuple(piece[i][0] for i in verified),
        device_drafts=device_drafts,
    )
