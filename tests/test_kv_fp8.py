"""FP8 KV cells (model/kv_fp8.py): calibration and the export flags. Exported end to end (designed tokens,
compiled cells equal to eager ones, inspect): test_fp8.py on conftest's fp8_artifact; the kernels' FP8
cells: test_cell_attention.py and test_rope_store.py."""

from __future__ import annotations

import pytest
import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.export.options import ExportOptions
from pt2serve.model.kv_fp8 import HEADROOM, KV_FP8_DTYPE, calibrate_kv_scales, install_kv_scales, kv_pool_dtype
from pt2serve.model.presets import build_preset_model


def test_calibrated_scales_leave_the_headroom_per_head():
    model = build_preset_model("tiny-random", torch.float32)
    scales = calibrate_kv_scales(model, seed=1)
    cfg = model.config
    assert len(scales) == cfg.num_layers
    for k_scale, v_scale in scales:
        assert k_scale.shape == v_scale.shape == (cfg.num_kv_heads,) and bool((k_scale > 0).all())
    # The largest calibration value of each head lands at 448 / HEADROOM: written again with these scales,
    # the same prompt's cells reach exactly that.
    install_kv_scales(model, scales)
    assert kv_pool_dtype(model) == KV_FP8_DTYPE
    tokens = torch.randint(0, cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(512)
    k_pools = [torch.zeros(513, cfg.num_kv_heads, cfg.head_dim, dtype=KV_FP8_DTYPE) for _ in range(cfg.num_layers)]
    v_pools = [p.clone() for p in k_pools]
    with torch.no_grad():
        model(tokens, positions, positions + 1, torch.zeros(512, dtype=torch.int64), torch.tensor([0, 512]),
              positions + 1, torch.tensor([511]), k_pools, v_pools)
    for pool in k_pools + v_pools:
        peak = pool[1:].float().abs().amax(dim=(0, 2))
        torch.testing.assert_close(peak, torch.full_like(peak, 448 / HEADROOM), rtol=0.07, atol=0)


def test_kv_dtype_flags_are_checked(tmp_path):
    def options(**flags) -> ExportOptions:
        return ExportOptions(backend="cpu", output=tmp_path / "m.pt2", preset="toy-greedy", **flags)

    with pytest.raises(Pt2ServeError, match="--kv-dtype must be fp8 or the model's dtype"):
        options(kv_dtype="int8").validate()
    with pytest.raises(Pt2ServeError, match="--kv-dtype fp8 with --draft is not supported"):
        options(kv_dtype="fp8", draft=tmp_path).validate()
    options(kv_dtype="fp32").validate()  # the model's own dtype: the default, said explicitly
