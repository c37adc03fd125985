"""Standardised sampling (speculative_decoding.txt section 2.1): temperature, top-k and top-p as one
warping of a distribution, applied identically wherever two distributions are compared.

Every sampling method of recspec draws from ``T o p``: the model's log-probabilities divided by
the temperature, then cut to the ``top_k`` largest entries, then to the smallest set of largest
entries whose mass reaches ``top_p`` (the order transformers' generation applies them in), and
renormalised. Speculative sampling compares ``T o p`` with ``T o q`` (Leviathan et al. apply the
same standardisation to both), beam sampling warps the *joint* distribution over every beam's
candidates (dsbd.txt Eq. 1), so :class:`Warp` works on any last dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from recspec.errors import RecspecError


@dataclass(frozen=True)
class Warp:
    """``temperature`` > 0; ``top_k``: keep the ``k`` largest entries (ties with the k-th kept, as
    transformers does), None for all; ``top_p`` in (0, 1]: keep the smallest prefix of the sorted
    distribution whose mass reaches it, None for all."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self) -> None:
        """Raise :class:`RecspecError` for settings no sampling method can use."""
        if isinstance(self.temperature, bool) or not (
                isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise RecspecError(f"temperature must be a positive number for sampling, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise RecspecError(f"top-k must be a positive integer (or unset), got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RecspecError(f"top-p must lie in (0, 1] (or be unset), got {self.top_p!r}")

    def __call__(self, log_weights: torch.Tensor) -> torch.Tensor:
        """Warped, normalised log-probabilities over the last dimension of ``log_weights``
        (unnormalised log-weights, ``-inf`` allowed; every row needs a finite entry): ``-inf``
        where the warping removes an entry. float32, or float64 for float64 input (exact
        enumerations in the tests need probabilities that sum to 1 in float64)."""
        scaled = log_weights.to(torch.promote_types(log_weights.dtype, torch.float32)) / self.temperature
        if self.top_k is not None and self.top_k < scaled.shape[-1]:
            kth = scaled.topk(self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, -torch.inf)
        log_probs = torch.log_softmax(scaled, dim=-1)
        if self.top_p is not None and self.top_p < 1:
            ordered, order = log_probs.sort(dim=-1, descending=True)
            mass = ordered.exp()
            before = mass.cumsum(dim=-1) - mass  # mass of the entries ranked above each one
            drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, before >= self.top_p)
            log_probs = torch.log_softmax(log_probs.masked_fill(drop, -torch.inf), dim=-1)
        return log_probs
