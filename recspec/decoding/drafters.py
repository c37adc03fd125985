"""Drafters: each proposes one level of a round's token tree from the level before it and the
draft model's log-probabilities at its nodes (the :class:`~recspec.decoding.rounds.Drafter`
interface; :func:`~recspec.decoding.rounds.draft_levels` feeds the draft and stacks the levels).

* :class:`TopNDrafter`: the top ``N`` children (strict verification, atspeed.txt Eq. 1), ranked
  by the *target's* exact score of the round's level-0 beam plus the draft's log-probabilities of
  the tokens after it: any ranking keeps strict verification exact, and this one uses what the
  target already knows.
* :class:`SampledDrafter`: ``count`` draws from the draft's beam-sampling distribution ``q_beam``
  over the previous level's candidates (scored the same way), keeping the proposal and the draws
  for the verifier: ``K`` draws per level for AtSpeed's relaxed verification (Alg. 2), ``W_S``
  independent draws under the sampling warp for DSBD's forest (dsbd.txt section 3.1), with the
  text ends absorbed where it drafts free text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from recspec.decoding.beam import Beams, select_top_k
from recspec.decoding.draft_tree import Level, child_level
from recspec.decoding.frontier import Frontier, level_beams
from recspec.decoding.sampling import candidates, draw
from recspec.decoding.warp import Warp
from recspec.itemids.trie import ItemTrie


def _child(parent: Level, chosen: Beams, depth: torch.Tensor, proposal: torch.Tensor | None = None,
           choice: torch.Tensor | None = None) -> Level:
    return child_level(parent, chosen.parents, chosen.tokens[:, :, -1], chosen.nodes, chosen.scores, depth, proposal,
                       choice)


@dataclass(frozen=True)
class TopNDrafter:
    """The top ``n`` children of the previous level in ``trie`` by prefix score."""

    trie: ItemTrie
    n: int

    def propose(self, parent: Level, log_q: torch.Tensor, front: Frontier, depth: torch.Tensor) -> Level:
        chosen = select_top_k(level_beams(parent, front.beams.margin), log_q, self.trie, self.n)
        return _child(parent, chosen, depth)


@dataclass(frozen=True)
class SampledDrafter:
    """``count`` draws per level from the draft's warped ``q_beam`` over ``space`` (independent
    with ``replacement``, else distinct); ``ends`` (text): finished prefixes continue with the end
    token at probability 1 (:class:`~recspec.decoding.dsbd.Ends`)."""

    space: Any  # an ItemTrie, or the text vocabulary (recspec.decoding.text_sampling)
    warp: Warp
    count: int
    generator: torch.Generator
    replacement: bool
    ends: Any = None  # recspec.decoding.dsbd.Ends, for text

    def propose(self, parent: Level, log_q: torch.Tensor, front: Frontier, depth: torch.Tensor) -> Level:
        if self.ends is not None:
            log_q = self.ends.absorb(parent.nodes, log_q)
        start = level_beams(parent, front.beams.margin)
        step = candidates(start, log_q, self.space, self.warp.temperature, self.warp.top_k, self.warp.top_p)
        choice = draw(step.log_beam, self.count, self.generator, self.replacement)
        return _child(parent, step.extend(start, choice, self.space), depth, step.log_beam, choice)
