"""Acceptance of drafted tokens (model/verify.py): greedy acceptance, and speculative sampling whose emitted
tokens are distributed as the target's, eager and as the artifact's compiled methods."""

from __future__ import annotations

import pytest
import torch

from pt2serve.contract import ACCEPT_DRAFTS, ACCEPT_DRAFTS_SAMPLED
from pt2serve.model.verify import GreedyAcceptor, SampledAcceptor, accept_with_proposal, target_probs
from pt2serve.runtime.artifact import load_artifact

VOCAB = 12
NUM_TRIALS = 40_000
# Total variation between a histogram of 40,000 draws over 12 tokens and its own distribution is about 0.01
# (the expected deviation); a wrong rule (e.g. emitting the draft unconditionally) is off by 0.3 or more.
TOLERANCE = 0.03


def total_variation(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.shape[-1]).float()
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def one_draft_each(logits: torch.Tensor, drafts: torch.Tensor, params: tuple[float, float, int], seed: int):
    """Every trial: one sequence whose one draft is `drafts[i]`, judged by the same logits row."""
    num = drafts.shape[0]
    generator = torch.Generator().manual_seed(seed)
    temperature, top_p, top_k = params
    row_index = torch.zeros(num, 2, dtype=torch.int64)
    return (logits[None, :].expand(2, VOCAB).contiguous(), row_index, torch.stack([drafts, drafts], 1),
            torch.ones(num, dtype=torch.int64), torch.full((num,), temperature), torch.full((num,), top_p),
            torch.full((num,), top_k, dtype=torch.int64), torch.rand(num, 2, generator=generator),
            torch.rand(num, 2, generator=generator))


@pytest.mark.parametrize("params", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.8, 4)])
def test_first_emitted_token_is_distributed_as_the_target(params):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    p = target_probs(logits[None, :], *(torch.tensor([v]) for v in params))[0]
    # Adversarial drafts: uniform over the vocabulary, so tokens the target never samples are drafted too.
    drafts = torch.randint(VOCAB, (NUM_TRIALS,), generator=torch.Generator().manual_seed(2))
    num_accepted, ids = SampledAcceptor()(*one_draft_each(logits, drafts, params, seed=3))
    assert total_variation(ids[:, 0], p) < TOLERANCE
    assert total_variation(drafts, p) > 10 * TOLERANCE  # the test can tell a wrong rule
    # Acceptance is p(x) for a deterministic draft.
    assert abs(num_accepted.float().mean().item() - p[drafts].mean().item()) < TOLERANCE
    assert torch.equal(ids[num_accepted == 1, 0], drafts[num_accepted == 1])


def test_the_general_rule_with_a_drafter_distribution_gives_the_target():
    generator = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(VOCAB, generator=generator) * 2, -1)
    q = torch.softmax(torch.randn(VOCAB, generator=generator) * 2, -1)
    drafts = torch.multinomial(q, NUM_TRIALS, replacement=True, generator=generator)
    shape = (NUM_TRIALS, 2, VOCAB)
    num_accepted, ids = accept_with_proposal(
        p.expand(shape), q.expand(shape), torch.stack([drafts, drafts], 1), torch.ones(NUM_TRIALS, dtype=torch.int64),
        torch.rand(NUM_TRIALS, 2, generator=generator), torch.rand(NUM_TRIALS, 2, generator=generator))
    assert total_variation(ids[:, 0], p) < TOLERANCE
    expected_rate = torch.minimum(p, q).sum().item()  # the acceptance rate of min(1, p/q)
    assert abs(num_accepted.float().mean().item() - expected_rate) < TOLERANCE


def test_greedy_acceptance_counts_leading_matches_and_emits_the_targets_tokens():
    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(5))
    target = logits.argmax(-1)
    wrong = (target + 1) % VOCAB
    # Sequence 0: rows 0-3, drafts match, match, miss; sequence 1: rows 4-5, its one draft matches;
    # sequence 2: rows 6-8, both drafts match (all accepted: the last row gives the bonus token).
    row_index = torch.tensor([[0, 1, 2, 3], [4, 5, 5, 5], [6, 7, 8, 8]])
    drafts = torch.tensor([[target[0], target[1], wrong[2], 0], [target[4], 0, 0, 0], [target[6], target[7], 0, 0]])
    num_drafts = torch.tensor([3, 1, 2])
    num_accepted, ids = GreedyAcceptor()(logits, row_index, drafts, num_drafts)
    assert num_accepted.tolist() == [2, 1, 2]
    assert ids[0, :3].tolist() == target[:3].tolist() and ids[1, :2].tolist() == target[4:6].tolist()
    assert ids[2, :3].tolist() == target[6:9].tolist()
    # A padding column that happens to equal the target is never accepted.
    padded = drafts.clone()
    padded[1, 1] = target[5]
    assert GreedyAcceptor()(logits, row_index, padded, num_drafts)[0].tolist() == [2, 1, 2]
    # The sampled method verifies greedy sequences (temperature 0) the same way.
    zeros = torch.zeros(3)
    sampled = SampledAcceptor()(logits, row_index, drafts, num_drafts, zeros, torch.ones(3),
                                torch.zeros(3, dtype=torch.int64), torch.rand(3, 4), torch.rand(3, 4))
    assert sampled[0].tolist() == [2, 1, 2]
    for seq, count in enumerate([2, 1, 2]):
        assert sampled[1][seq, :count + 1].tolist() == ids[seq, :count + 1].tolist()


def test_compiled_acceptors_equal_the_eager_modules(tiny_artifact):
    artifact = load_artifact(tiny_artifact)
    vocab = artifact.metadata.vocab_size
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(10, vocab, generator=generator) * 3
    target = logits.argmax(-1)
    for num_seqs, width in ((3, 4), (1, 2), (2, 6)):
        row_index = torch.randint(10, (num_seqs, width), generator=generator)
        drafts = target[row_index].roll(-1, dims=1)  # drafts that mostly match the next row's target
        drafts[:, 0] = torch.where(torch.rand(num_seqs, generator=generator) < 0.5, drafts[:, 0], 0)
        num_drafts = torch.randint(width, (num_seqs,), generator=generator)
        greedy_args = [logits, row_index, drafts, num_drafts]
        for got, want in zip(artifact.run(ACCEPT_DRAFTS, greedy_args), GreedyAcceptor()(*greedy_args)):
            assert torch.equal(got, want)
        sampled_args = greedy_args + [
            torch.rand(num_seqs, generator=generator) + 0.5, torch.full((num_seqs,), 0.95),
            torch.randint(0, 20, (num_seqs,), generator=generator),
            torch.rand(num_seqs, width, generator=generator), torch.rand(num_seqs, width, generator=generator)]
        got_accepted, got_ids = artifact.run(ACCEPT_DRAFTS_SAMPLED, sampled_args)
        want_accepted, want_ids = SampledAcceptor()(*sampled_args)
        assert torch.equal(got_accepted, want_accepted)
        for seq, count in enumerate(want_accepted.tolist()):
            assert got_ids[seq, :count + 1].tolist() == want_ids[seq, :count + 1].tolist()
