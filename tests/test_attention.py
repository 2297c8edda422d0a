"""The step description of attention: who sees which entry, and that nothing non-finite can spread."""

from __future__ import annotations

import torch

from pt2serve.kernels.cell_attention import visibility_mask
from pt2serve.model.eager import EagerSequence
from pt2serve.model.presets import build_preset_model


def test_visibility_follows_sequences_positions_and_empty_rows():
    seq_indptr = torch.tensor([0, 3, 3, 7, 8])  # sequence 1 is empty; entries 8.. are padding
    positions = torch.tensor([0, 2, 0, 3, 0])
    token_seq = torch.tensor([0, 0, 2, 2, 3])
    mask = visibility_mask(positions, token_seq, seq_indptr, 10)
    expected = torch.zeros(5, 10, dtype=torch.bool)
    expected[0, 0] = True
    expected[1, 0:3] = True
    expected[2, 3] = True
    expected[3, 3:7] = True
    expected[4, 7] = True
    assert torch.equal(mask, expected)


def test_a_row_that_sees_nothing_writes_no_nan_and_leaves_others_alone():
    model = build_preset_model("tiny-random", torch.float32).eval()
    prompt = [256, 5, 6, 7]
    reference = EagerSequence(model, 16).extend(prompt)[-1]
    cfg = model.config
    pools = [torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    with torch.no_grad():
        logits = model(
            torch.tensor(prompt + [9]),
            torch.tensor([0, 1, 2, 3, 0]),
            torch.tensor([1, 2, 3, 4, 0]),
            torch.tensor([0, 0, 0, 0, 1]),  # the last token belongs to sequence 1, which has no entries
            torch.tensor([0, 4, 4]),
            torch.tensor([1, 2, 3, 4, 0, 0]),
            torch.tensor([3, 4]),
            pools[: cfg.num_layers],
            pools[cfg.num_layers:],
        )
    assert all(torch.isfinite(pool).all() for pool in pools)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0], reference, atol=1e-5, rtol=1e-5)
