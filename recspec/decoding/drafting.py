"""What gives a tree round's drafter its log-probabilities (the search over item beams,
:class:`~recspec.decoding.rounds.ItemSearch`): :class:`DraftSource`, implemented by a draft model, a
feature head, a text head (:mod:`recspec.decoding.draft_sources`), the item prior
(:mod:`recspec.decoding.item_prior`) and the target's prior (:mod:`recspec.decoding.target_prior`).

A source proposes (``start``, ``log_probs``) and learns from what the target scored and accepted
(``learn``); a source with a cache of its own also takes each round's last level (``feed_last``).
Those two default to nothing, so a source that needs neither does not spell them out.
"""

from __future__ import annotations

from typing import Protocol

import torch

from recspec.decoding.beams import Beams
from recspec.decoding.draft_tree import Level
from recspec.decoding.frontier import Frontier
from recspec.decoding.prompts import Prompts


class DraftSource(Protocol):
    """A tree drafter's log-probabilities (see :mod:`recspec.decoding.draft_sources` for the calls'
    contract): ``wants_features`` says whether the target's scoring call also returns its
    features (then :meth:`learn` receives them); ``feature_layers`` are the target's layers read
    beside its top feature (:func:`~recspec.models.text_head.layer_features`)."""

    wants_features: bool
    feature_layers: tuple[int, ...]

    @property
    def caches(self) -> tuple: ...

    def start(self, prompts: Prompts) -> torch.Tensor | None: ...

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor: ...

    def feed_last(self, levels: list[Level]) -> None:
        """Take the round's last level into a cache of the source's own; by default it has none."""

    def learn(self, levels: list[Level], features: torch.Tensor, prompts: Prompts | None, front: Frontier,
               beams: Beams, parent_at: torch.Tensor) -> torch.Tensor | None:
        """Learn from the target's features at the round's fed positions and the new ``beams``;
        returns what each beam carries into the next round ``[B, K, D]``; by default nothing."""
        return None
