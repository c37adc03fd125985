"""The result of every top-K item decoder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TopK:
    """The ``K`` best items of each of ``B`` users, best first.

    ``items``: int64 ``[B, K]``, the item index (``ItemTrie.items`` of the leaf) of each result.
    ``scores``: float32 ``[B, K]``, the sum of the model's log-probabilities of the item's ``L``
    identifier tokens given the prompt (log-softmax over the full vocabulary, not renormalised
    over the tokens the trie allows); non-increasing along ``K``.
    ``tokens``: int64 ``[B, K, L]``, the identifier tokens of each result.
    ``margin``: float32 ``[B]`` or None (decoders that do not track it, e.g. ``hf``): the
    smallest gap, over all beam-search steps, between the score of the K-th kept candidate and
    the best candidate dropped (``inf`` where nothing was dropped). Perturbing every score by
    less than half of it cannot change which items are returned; a margin near float32 noise
    (about 1e-6) means another implementation of the same beam search may legitimately return a
    different item at the edge of the top-K.
    """

    items: torch.Tensor
    scores: torch.Tensor
    tokens: torch.Tensor
    margin: torch.Tensor | None = None

    @staticmethod
    def cat(parts: Sequence[TopK]) -> TopK:
        """The results of consecutive batches of users as one result (concatenated along ``B``)."""
        margins = [part.margin for part in parts]
        return TopK(
            items=torch.cat([part.items for part in parts]),
            scores=torch.cat([part.scores for part in parts]),
            tokens=torch.cat([part.tokens for part in parts]),
            margin=None if any(m is None for m in margins) else torch.cat(margins),
        )
