"""Inverse-transform categorical draws: the frequencies match the weights (chi-square, fixed
seeds), entries of weight 0 are never drawn, and rows are drawn independently."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from recspec.decoding.categorical import categorical


def test_draws_follow_unnormalised_weights_row_by_row() -> None:
    """Two rows of different totals, zeros inside and at both ends, 40,000 draws each."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.25, 0.0],
                            [2e-3, 0.0, 1e-3, 4e-3, 0.0, 0.0, 0.0, 1e-3]])
    drawn = categorical(weights, 40_000, generator)
    assert drawn.shape == (2, 40_000) and drawn.dtype == torch.int64
    for row in range(2):
        counts = torch.bincount(drawn[row], minlength=weights.shape[1]).double()
        positive = weights[row] > 0
        assert counts[~positive].sum() == 0  # weight 0: never drawn
        expected = weights[row][positive].double() / weights[row].sum() * counts.sum()
        assert chisquare(counts[positive].numpy(), expected.numpy()).pvalue > 1e-3


def test_a_large_vocabulary_and_a_peaked_distribution() -> None:
    """A softmax over 49,152 entries with a few heavy ones (a language model's next-token
    distribution): the heavy entries' frequencies and the tail's total match."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.full((1, 49_152), -8.0)
    logits[0, [7, 1000, 49_151]] = torch.tensor([2.0, 1.0, 0.0])
    p = torch.softmax(logits, dim=1)
    drawn = categorical(p, 50_000, generator)[0]
    heavy = torch.tensor([7, 1000, 49_151])
    observed = [int((drawn == i).sum()) for i in heavy] + [int((~torch.isin(drawn, heavy)).sum())]
    mass = p[0, heavy].double()
    expected = torch.cat((mass, 1 - mass.sum()[None])) * 50_000
    assert chisquare(observed, expected.numpy()).pvalue > 1e-3


def test_a_single_positive_entry_is_always_drawn() -> None:
    generator = torch.Generator().manual_seed(2)
    weights = torch.zeros(3, 10)
    weights[0, 0], weights[1, 9], weights[2, 4] = 1e-30, 5.0, 1.0
    assert categorical(weights, 1000, generator).unique(dim=1).tolist() == [[0], [9], [4]]
