"""The host's draw of a sampled token (kvtier.server.decoding.sampling.draw): the distribution it is
given, never an id of probability 0, the same ids for the same seed."""

from __future__ import annotations

import torch

from kvtier.server.decoding.sampling import draw, sample_rows


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(7)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=5)
    assert counts[1] == 0 and counts[4] == 0  # probability 0: never drawn
    share = counts.double() / n
    # four standard deviations of a binomial share at n = 20,000 is at most 0.014
    assert torch.allclose(share, probs.double(), atol=0.014), share


def test_unnormalized_weights_draw_as_their_shares() -> None:
    gen = torch.Generator().manual_seed(1)
    weights = torch.tensor([3.0, 1.0])  # top-p leaves a row that no longer sums to 1
    drawn = [draw(weights, gen) for _ in range(8_000)]
    assert abs(drawn.count(0) / len(drawn) - 0.75) < 0.02


def test_the_same_seed_draws_the_same_ids() -> None:
    logits = torch.randn(3, 1000)
    first = [
        sample_rows(
            logits, [1.0] * 3, [0.9] * 3, [torch.Generator().manual_seed(s) for s in range(3)]
        )
        for _ in range(2)
    ]
    assert first[0] == first[1]


def test_a_uniform_at_the_top_draws_the_last_possible_id(monkeypatch) -> None:
    """u x total can round up to the total; the draw is then the last id of nonzero weight."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([1.0], dtype=torch.float64))
    assert draw(torch.tensor([0.25, 0.75, 0.0]), torch.Generator()) == 1
