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
    """

    items: torch.Tensor
    scores: torch.Tensor
    tokens: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[TopK]) -> TopK:
        """The results of consecutive batches of users as one result (concatenated along ``B``)."""
        return TopK(
            items=torch.cat([part.items for part in parts]),
            scores=torch.cat([part.scores for part in parts]),
            tokens=torch.cat([part.tokens for part in parts]),
        )
