"""--mode quality: how far an artifact's next-token distributions are from a reference artifact's.

Made for a quantized artifact against the bf16 (or fp32) export of the same model. Both read the same
prompts (seeded random token ids), then the REFERENCE's greedy continuation one token at a time (teacher
forcing: a disagreement does not change what either reads next). At every generated position:

- top-1 agreement: both put the highest logit on the same token (the greedy choice agrees)
- KL(reference || candidate) of the two softmax distributions, in nats

The methods run directly (forward_others, no CUDA graphs) on pools of their own: only the logits matter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pt2serve.bench.progress import Progress
from pt2serve.contract import FORWARD_OTHERS
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.artifact import Artifact, load_artifact
from pt2serve.runtime.cells import allocate_kv_pools
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, pack, slice_step


@dataclass(frozen=True)
class QualityOptions:
    prompts: int = 8
    prompt_tokens: int = 32
    max_new_tokens: int = 32  # generated positions compared per prompt
    seed: int = 0

    def check(self) -> None:
        for flag, value in (("--requests", self.prompts), ("--prompt-tokens", self.prompt_tokens),
                            ("--max-new-tokens", self.max_new_tokens)):
            if value < 1:
                raise Pt2ServeError(f"{flag} must be at least 1, got {value}")


@dataclass(frozen=True)
class QualityResult:
    candidate: str
    reference: str
    device: str
    positions: int  # generated positions compared, all prompts together
    top1_agreement: float  # fraction of positions whose argmax agrees
    mean_kl: float  # nats
    max_kl: float
    prompts_fully_agreeing: int  # prompts whose every position agrees

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kl_and_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [R, V] logits: KL(softmax(reference) || softmax(candidate)) and whether the argmaxes agree."""
    log_p = reference.float().log_softmax(-1)
    log_q = candidate.float().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl, reference.argmax(-1) == candidate.argmax(-1)


class _Scorer:
    """One artifact with a pool of its own, run on whole steps; returns the logits of the sampled rows."""

    def __init__(self, artifact: Artifact, num_cells: int) -> None:
        cache = artifact.metadata.cache
        _, self.k_pools, self.v_pools = allocate_kv_pools(
            cache["num_layers"], num_cells, cache["num_kv_heads"], cache["head_dim"], artifact.metadata.kv_dtype,
            artifact.device,
        )
        self.artifact = artifact

    @torch.no_grad()
    def logits(self, chunks: list[Chunk]) -> torch.Tensor:
        rows = []
        for piece in slice_step(chunks, self.artifact.metadata.max_step_tokens):
            call = pack(piece, FORWARD_OTHERS, None)
            inputs = [*call.device_inputs(self.artifact.device), *self.k_pools, *self.v_pools]
            rows.append(self.artifact.run(FORWARD_OTHERS, inputs)[0][: len(call.sampled_chunks)])
        return torch.cat(rows)


def run_quality(
    candidate: Path, reference: Path, options: QualityOptions, device: str | None = None,
    progress: Progress | None = None,
) -> QualityResult:
    options.check()
    say = progress or (lambda text: None)
    say(f"loading {candidate.name} and {reference.name}")
    loaded = [load_artifact(path, device) for path in (candidate, reference)]
    cand, ref = loaded
    if cand.metadata.vocab_size != ref.metadata.vocab_size:
        raise Pt2ServeError(f"the artifacts have different vocabularies ({cand.metadata.vocab_size} and "
                            f"{ref.metadata.vocab_size} tokens): compare exports of the same model")
    length = options.prompt_tokens + options.max_new_tokens
    max_context = min(cand.metadata.max_context, ref.metadata.max_context)
    if length > max_context:
        raise Pt2ServeError(f"--prompt-tokens + --max-new-tokens = {length} exceeds the artifacts' max context "
                            f"({max_context})")
    num_cells = 1 + options.prompts * length  # cell 0 is the scratch cell
    max_cells = min(cand.metadata.max_cells, ref.metadata.max_cells)
    if num_cells > max_cells:
        raise Pt2ServeError(f"{options.prompts} prompts of {length} tokens need {num_cells} cells, more than the "
                            f"artifacts allow ({max_cells}): use fewer --requests or shorter ones")
    scorers = [_Scorer(artifact, num_cells) for artifact in loaded]
    rng = np.random.default_rng(options.seed)
    prompts = [rng.integers(0, ref.metadata.vocab_size, options.prompt_tokens).tolist() for _ in range(options.prompts)]
    cells = [np.arange(1 + i * length, 1 + (i + 1) * length, dtype=np.int64) for i in range(options.prompts)]
    greedy = SamplingParams()
    chunks = [Chunk(cells[i][: options.prompt_tokens], tuple(p), 0, greedy) for i, p in enumerate(prompts)]
    kls, agreements = [], []
    for position in range(options.max_new_tokens):
        say(f"position {position + 1}/{options.max_new_tokens}")
        cand_logits, ref_logits = (scorer.logits(chunks) for scorer in scorers)
        kl, agree = kl_and_agreement(ref_logits, cand_logits)
        kls.append(kl.cpu())
        agreements.append(agree.cpu())
        next_tokens = ref_logits.argmax(-1).tolist()
        start = options.prompt_tokens + position
        chunks = [Chunk(cells[i][: start + 1], (token,), start, greedy) for i, token in enumerate(next_tokens)]
    kl_all, agree_all = torch.stack(kls, dim=1), torch.stack(agreements, dim=1)  # [prompts, positions]
    return QualityResult(
        candidate=str(candidate), reference=str(reference), device=str(cand.device),
        positions=kl_all.numel(), top1_agreement=float(agree_all.float().mean()), mean_kl=float(kl_all.mean()),
        max_kl=float(kl_all.max()), prompts_fully_agreeing=int(agree_all.all(dim=1).sum()),
    )
