"""What an export builds, validated before any compile work starts."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.export.defaults import (
    DEFAULT_DRAFT_SIZES,
    DEFAULT_FORWARD_SIZES,
    DEFAULT_GRAPH_ENTRIES,
    DEFAULT_MAX_CELLS,
    DEFAULT_MAX_STEP_TOKENS,
    DEFAULT_MIN_PREFILL_CHUNK,
)
from pt2serve.kernels import cell_attention
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.quant import QuantScheme

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ExportOptions:
    backend: str  # "cuda" or "cpu"
    output: Path
    checkpoint: Path | None = None
    preset: str | None = None
    dtype: str | None = None  # None: bf16 on cuda, fp32 on cpu
    attention: str | None = None  # None: the Triton kernel on cuda, the masked PyTorch path on cpu
    forward_sizes: tuple[int, ...] = DEFAULT_FORWARD_SIZES
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS
    max_cells: int = DEFAULT_MAX_CELLS
    max_context: int | None = None  # None: the model's max_position_embeddings
    graph_entries: int = DEFAULT_GRAPH_ENTRIES
    min_prefill_chunk: int = DEFAULT_MIN_PREFILL_CHUNK
    jobs: int | None = None  # None: a sensible number for the machine
    device_index: int = 0
    kv_dtype: str | None = None  # None: the model's dtype; "fp8": e4m3 cells with per-head scales (model/kv_fp8.py)
    quantize: str | None = None  # "fp8", "int8" or "int4" (weight-only): quantization of the linear layers
    group_size: int | None = None  # None: the scheme's default (int4: 128, int8: one group per row)
    quantize_lm_head: bool = False
    quantize_embedding: bool = False
    tune_matmuls: bool = True  # cuda: time the small-M kernels against cuBLAS per shape and keep the faster
    # Every row's logits the same bits whatever shares its step (kernels/batch_invariant.py); not tuned.
    deterministic: bool = False
    draft: Path | None = None  # a DFlash draft checkpoint directory, exported into the same artifact
    draft_sizes: tuple[int, ...] = DEFAULT_DRAFT_SIZES  # sequences per static draft method
    revision: str | None = None  # of a Hugging Face Hub checkpoint (a branch, tag or commit)
    hf_token: str | None = field(default=None, repr=False)  # None: HF_TOKEN or the saved login

    @property
    def quant_scheme(self) -> QuantScheme | None:
        if self.quantize is None:
            return None
        return QuantScheme.from_flags(self.quantize, self.group_size, self.quantize_lm_head, self.quantize_embedding)

    @property
    def kv_dtype_name(self) -> str:
        """The cache dtype the metadata records: "fp8", or the model's dtype."""
        return self.kv_dtype or self.dtype_name

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def dtype_name(self) -> str:
        return self.dtype or ("bf16" if self.backend == "cuda" else "fp32")

    @property
    def attention_impl(self) -> AttentionImpl:
        if self.attention is not None:
            return AttentionImpl(self.attention)
        return AttentionImpl.KERNEL if self.backend == "cuda" else AttentionImpl.MASKED

    @property
    def device(self) -> str:
        return f"cuda:{self.device_index}" if self.backend == "cuda" else "cpu"

    def num_jobs(self, weight_bytes: int) -> int:
        """Compile workers: as asked, else one per core (at most 8), and no more than the GPU holds models.

        Measured on 2 cores: 2 workers export the tiny-random preset (then called tiny) 1.8x faster than 1 (docs/benchmarks.md).
        """
        if self.jobs is not None:
            return self.jobs
        jobs = max(1, min(8, os.cpu_count() or 1))
        if self.backend == "cuda":
            # Each worker holds its own copy of the weights on the GPU, plus room to autotune.
            free_bytes, _total = torch.cuda.mem_get_info(self.device_index)
            jobs = min(jobs, max(1, int(free_bytes // (2 * weight_bytes))))
        return jobs

    def entries_for(self, width: int, max_context: int) -> int:
        """The context index length of the static method of this width (its fixed seq_cells length).

        With the attention kernel, every entry a step of that width can list: each token its own sequence at
        the max context. Only the kernel reads the index, so its length costs memory (8 bytes an entry, in the
        runtime's graph buffer: 67 MB for width 64 at 131,072) and no time: a step packs and copies the part
        it fills. Masked attention gathers every entry, so there --graph-entries bounds it and steps that list
        more run on forward_others.
        """
        if self.attention_impl is AttentionImpl.KERNEL:
            return width * max_context
        return min(width * max_context, self.graph_entries)

    def draft_entries_for(self, num_seqs: int, max_context: int, block_size: int) -> int:
        """Entry capacity of the draft method for `num_seqs` sequences (context and block cells of each).

        The one-sequence method holds a max-context sequence; wider ones stop at --graph-entries, and the
        runtime drafts sequences that do not fit them together in narrower calls.
        """
        one = max_context + block_size
        return max(one, min(num_seqs * one, self.graph_entries))

    def validate(self) -> None:
        """Every check that needs no model: bad flags fail here, before compile work starts."""
        if self.backend not in ("cuda", "cpu"):
            raise Pt2ServeError(f"--backend must be cuda or cpu, got {self.backend!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise Pt2ServeError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        impls = [impl.value for impl in AttentionImpl]
        if self.attention is not None and self.attention not in impls:
            raise Pt2ServeError(f"--attention must be one of {', '.join(impls)}, got {self.attention!r}")
        if self.attention_impl is AttentionImpl.KERNEL:
            if self.backend != "cuda":
                raise Pt2ServeError("--attention kernel needs --backend cuda (AOTInductor compiles the Triton kernel "
                                    "for a GPU); use --attention masked for the cpu backend")
            if not cell_attention.is_available():
                raise Pt2ServeError("--attention kernel needs the triton package: pip install triton, "
                                    "or export with --attention masked")
        if (self.checkpoint is None) == (self.preset is None):
            raise Pt2ServeError("give exactly one of --checkpoint DIR|ORG/NAME or --preset NAME")
        sizes = self.forward_sizes
        if not sizes or any(n < 1 for n in sizes):
            raise Pt2ServeError(f"--forward-sizes must be positive integers, got {','.join(map(str, sizes))}")
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise Pt2ServeError(f"--forward-sizes must be strictly increasing, got {','.join(map(str, sizes))}")
        if sizes[-1] >= self.max_step_tokens:
            raise Pt2ServeError(
                f"--max-step-tokens ({self.max_step_tokens}) must exceed the widest forward size ({sizes[-1]}): "
                "forward_others covers the widths between them"
            )
        drafts = self.draft_sizes
        if not drafts or any(n < 1 for n in drafts) or any(b <= a for a, b in zip(drafts, drafts[1:])):
            raise Pt2ServeError(f"--draft-sizes must be strictly increasing positive integers, got "
                                f"{','.join(map(str, drafts))}")
        if self.draft is not None and not Path(self.draft).is_dir():
            raise Pt2ServeError(f"--draft {str(self.draft)!r} is not a directory: give a DFlash draft checkpoint "
                                "directory (config.json and safetensors weights)")
        if self.kv_dtype not in (None, "fp8", self.dtype_name):
            raise Pt2ServeError(f"--kv-dtype must be fp8 or the model's dtype ({self.dtype_name}), got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.draft is not None:
            raise Pt2ServeError("--kv-dtype fp8 with --draft is not supported: the draft's cells stay in the model's "
                                "dtype; export the draft with the model's KV dtype")
        if self.jobs is not None and self.jobs < 1:
            raise Pt2ServeError(f"--jobs must be at least 1, got {self.jobs}")
        if self.quantize is None and (self.group_size is not None or self.quantize_lm_head or self.quantize_embedding):
            raise Pt2ServeError("--group-size, --quantize-lm-head and --quantize-embedding need --quantize fp8|int8|int4")
        if self.quantize is not None:
            self.quant_scheme  # noqa: B018  (raises on a bad value or combination)
        if self.deterministic and self.backend == "cuda" and self.attention_impl is not AttentionImpl.KERNEL:
            raise Pt2ServeError("--deterministic on cuda needs --attention kernel: the masked path's reductions are "
                                "tiled by Inductor per width there")
        if self.deterministic and self.quantize is not None:
            raise Pt2ServeError("--deterministic with --quantize is not supported yet: the quantized layers' kernels "
                                "split their sums by the step's width; export one or the other")
        if self.graph_entries < 1:
            raise Pt2ServeError(f"--graph-entries must be at least 1, got {self.graph_entries}")
        if self.min_prefill_chunk < 1:
            raise Pt2ServeError(f"--min-prefill-chunk must be at least 1, got {self.min_prefill_chunk}")
        if self.backend == "cuda":
            if not torch.cuda.is_available():
                raise Pt2ServeError("--backend cuda needs a CUDA GPU, and torch sees none; use --backend cpu")
            if self.device_index >= torch.cuda.device_count():
                raise Pt2ServeError(
                    f"--device-index {self.device_index} does not exist; this machine has "
                    f"{torch.cuda.device_count()} GPU(s)"
                )
        self._check_output_writable()

    def validate_for_model(self, context_length: int) -> int:
        """Checks that need the model's config (`context_length`: ModelConfig.context_length); returns the max
        context to build for."""
        max_context = self.max_context or context_length
        if max_context < 2:
            raise Pt2ServeError(f"--max-context must be at least 2, got {max_context}")
        if max_context > context_length:
            raise Pt2ServeError(
                f"--max-context {max_context} exceeds the model's context ({context_length}: max_position_embeddings, "
                "stretched by its rope scaling)"
            )
        if self.max_cells < max_context + 1:
            raise Pt2ServeError(
                f"--max-cells ({self.max_cells}) is too small for --max-context ({max_context}): one sequence "
                f"needs max-context cells plus one scratch cell; use --max-cells {max_context + 1} or more"
            )
        return max_context

    def _check_output_writable(self) -> None:
        out = self.output
        if out.suffix != ".pt2":
            raise Pt2ServeError(f"output path must end in .pt2, got {str(out)!r}")
        parent = out.parent if str(out.parent) else Path(".")
        if out.is_dir():
            raise Pt2ServeError(f"output path {str(out)!r} is a directory")
        if not parent.is_dir():
            raise Pt2ServeError(f"output directory {str(parent)!r} does not exist")
        # Try it for real: permission bits say nothing for root, and some filesystems refuse anyway.
        try:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{out.name}.", suffix=".probe"):
                pass
        except OSError as err:
            raise Pt2ServeError(f"output path {str(out)!r} is not writable: {err.strerror}") from None
