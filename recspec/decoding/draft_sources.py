"""What gives a round's drafter its log-probabilities: a draft model with a KV cache of its own
(:class:`ModelDraft`), or a feature-level head over the target's hidden states
(:class:`FeatureDraft`, :mod:`recspec.models.head`). The round loop
(:func:`~recspec.decoding.rounds.run_rounds`) talks to either through the same four calls:

* ``start(prompts)``: before the first round; the draft's log-probs at the root ``[B, 1, V]``,
  or None when the first round drafts nothing (a head: level 1 then comes exactly from the
  target's prefill, and the head drafts from the target's feature there on);
* ``log_probs(levels, front)``: the draft's log-probs ``[B, n, V]`` at the nodes of
  ``levels[-1]``, the round's newest level (``levels[0]`` is the round's level 0);
* ``feed_last(levels)``: the round's last level, so that a draft cache holds what the target's will;
* ``caches``: the KV caches to keep in step with the target's (compacted by the same gather).

:class:`HybridDraft` combines the two: the draft model drafts the first round (in the same target
call as the prompt), the head every later one.

``wants_features`` says whether the target's scoring call must also return its features (the
round loop then keeps, per beam, the feature at its parent: :attr:`Frontier.features`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recspec.decoding.draft_tree import Level, feed
from recspec.decoding.frontier import Frontier
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import prefill
from recspec.models.head import HeadDraft


@dataclass
class ModelDraft:
    """A draft causal LM over the target's vocabulary; its cache mirrors the target's."""

    model: object
    cache: object = None
    wants_features = False

    def start(self, prompts: Prompts) -> torch.Tensor:
        log_q, self.cache = prefill(self.model, prompts)
        return log_q

    @property
    def caches(self) -> tuple:
        return (self.cache,)

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        return feed(self.model, self.cache, levels[-1:])

    def feed_last(self, levels: list[Level]) -> None:
        feed(self.model, self.cache, levels[-1:])


@dataclass
class FeatureDraft:
    """A draft head (:class:`~recspec.models.head.HeadDraft`): level 0's nodes take the target's
    feature at their parent (``front.features``), deeper levels the head's own guess at theirs."""

    head: HeadDraft
    guessed: list[torch.Tensor] = field(default_factory=list)  # this round's features, per level
    wants_features = True
    caches = ()

    def start(self, prompts: Prompts) -> None:
        return None

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        level, j = levels[-1], len(levels) - 1
        if j == 0:
            if front.features is None:
                raise RuntimeError("a head drafts from the target's features: the first round must draft nothing")
            parent = front.features
        else:
            previous = self.guessed[j - 1]
            parent = previous.gather(1, level.parents[:, :, None].expand(-1, -1, previous.shape[2]))
        depth = (front.depth - 1 + j)[:, None].expand_as(level.tokens)  # 0-based level of the nodes' tokens
        feature = self.head.features(parent.to(self.head.device), level.tokens, depth)
        self.guessed = [*self.guessed[:j], feature]
        return self.head.log_probs(feature)

    def feed_last(self, levels: list[Level]) -> None:
        return None


@dataclass
class HybridDraft:
    """A draft model for the first round, a head for the rest: the first round keeps the prompt
    and every drafted level in one target call (the head has no target feature to start from
    yet), and from then on the head drafts from the features that call returned. The model's
    cache serves the first round only and is then dropped (never compacted)."""

    model: ModelDraft
    head: FeatureDraft
    wants_features = True
    caches = ()

    def start(self, prompts: Prompts) -> torch.Tensor:
        return self.model.start(prompts)

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        if front.features is None:  # the first round
            return self.model.log_probs(levels, front)
        self.model.cache = None
        return self.head.log_probs(levels, front)

    def feed_last(self, levels: list[Level]) -> None:
        return None


@dataclass(frozen=True)
class HybridPair:
    """A draft model and a head of the same target, drafted with as :class:`HybridDraft`."""

    model: object
    head: HeadDraft


def draft_source(draft) -> ModelDraft | FeatureDraft | HybridDraft:
    """The source for ``draft``: a :class:`~recspec.models.head.HeadDraft`, a :class:`HybridPair`
    or a causal LM."""
    if isinstance(draft, HybridPair):
        return HybridDraft(ModelDraft(draft.model), FeatureDraft(draft.head))
    return FeatureDraft(draft) if isinstance(draft, HeadDraft) else ModelDraft(draft)
