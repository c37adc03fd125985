"""Categorical draws by inverse transform: one cumulative sum and one binary search per row.

``torch.multinomial`` draws from a categorical distribution by an exponential race on the CPU:
an exponential variate for every entry, a visible share of a speculative sampling round over a
large vocabulary. Inverse transform sampling needs one uniform per draw and a cumulative sum of
the weights, several times cheaper. The sum is taken in float64, so the probability of every
entry is its weight's share up to float64 rounding.
"""

from __future__ import annotations

import torch


def categorical(weights: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """``samples`` independent draws per row from the distribution proportional to ``weights``
    (float ``[B, V]``, non-negative, at least one positive entry per row): int64 ``[B, samples]``,
    never an entry of weight 0."""
    uniform = torch.rand(weights.shape[0], samples, generator=generator, device=weights.device, dtype=torch.float64)
    return inverse_transform(weights, uniform)


def or_uniform(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` (float ``[B, V]``, non-negative) with every row of zero mass made uniform: what
    :func:`categorical` can draw from where such rows' draws are unused (rows out of a round)."""
    return torch.where(weights.sum(dim=1, keepdim=True) > 0, weights, 1.0)


def inverse_transform(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The entries of each row of ``weights`` (float ``[B, V]``, non-negative, at least one
    positive entry per row) at its quantiles ``uniform`` (float64 ``[B, S]`` in ``[0, 1)``): int64
    ``[B, S]``, for each ``u`` the first entry whose cumulative weight exceeds ``u`` times the
    row's total, never an entry of weight 0. A uniform ``u`` drawn at random makes it a draw from
    the row's distribution; the same ``u`` picks the same entry from the same weights."""
    cumulative = weights.to(torch.float64).cumsum(dim=1)
    total = cumulative[:, -1:]
    drawn = torch.searchsorted(cumulative, uniform * total, right=True)  # the first entry whose sum exceeds u
    positive = weights > 0  # u * total rounds up to total at worst: the last entry with weight instead
    last = weights.shape[1] - 1 - positive.flip(1).to(torch.int8).argmax(dim=1, keepdim=True)
    return torch.minimum(drawn, last)
