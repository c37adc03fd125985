"""Drafters: each proposes one level of a round's token tree from the level before it and the
draft model's log-probabilities at its nodes (the :class:`~recspec.decoding.rounds.LevelDrafter`
interface; :meth:`~recspec.decoding.rounds.ItemSearch.draft` feeds the draft and stacks the levels).

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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recspec.decoding.beams import Beams, Ends, candidates, draw, select_top_k
from recspec.decoding.draft_tree import Level, child_level
from recspec.decoding.frontier import Frontier, level_beams
from recspec.decoding.warp import Warp
from recspec.itemids.trie import ItemTrie


@dataclass(frozen=True)
class TopNDrafter:
    """The top ``n`` children of the previous level in ``trie`` by prefix score; with a
    ``planner`` (:class:`~recspec.decoding.tree_plan.CostPlanner`) each round's levels and widths
    are the ones of highest expected levels per second instead."""

    trie: ItemTrie
    n: int
    planner: Callable[[bool, int], tuple[int, ...]] | None = None

    def widths(self, first: bool, remaining: int, drafted: int) -> tuple[int, ...]:
        return self.planner(first, remaining) if self.planner is not None else (self.n,) * drafted

    def propose(self, parent: Level, log_q: torch.Tensor, front: Frontier, depth: torch.Tensor,
                width: int) -> Level:
        """The top ``width`` children, fewer where no row has that many (e.g. the root's children
        at a width above their number): columns dead in every row are not drafted, so not fed."""
        chosen = select_top_k(level_beams(parent, front.beams.margin), log_q, self.trie, width)
        live = max(int(chosen.scores.isfinite().sum(dim=1).max()), 1)  # dead fillers come last
        if live < width:
            scores, nodes, tokens, parents = (part[:, :live].contiguous() for part in
                                              (chosen.scores, chosen.nodes, chosen.tokens, chosen.parents))
            chosen = Beams(scores=scores, nodes=nodes, tokens=tokens, parents=parents, margin=chosen.margin)
        return child_level(parent, chosen, depth)


@dataclass(frozen=True)
class SampledDrafter:
    """``count`` draws per level from the draft's warped ``q_beam`` over ``space`` (an item trie or
    :class:`~recspec.decoding.space.FreeText`; independent with ``replacement``, else distinct);
    ``ends`` (text): finished prefixes continue with the end token at probability 1."""

    space: ItemTrie
    warp: Warp
    count: int
    generator: torch.Generator
    replacement: bool
    ends: Ends | None = None

    def widths(self, first: bool, remaining: int, drafted: int) -> tuple[int, ...]:
        return (self.count,) * drafted

    def propose(self, parent: Level, log_q: torch.Tensor, front: Frontier, depth: torch.Tensor,
                width: int) -> Level:
        """``width`` is :meth:`widths`' ``count`` (a sampled level's draws)."""
        if self.ends is not None:
            log_q = self.ends.absorb(parent.nodes, log_q)
        start = level_beams(parent, front.beams.margin)
        step = candidates(start, log_q, self.space, self.warp, self.count)
        choice = draw(step.log_beam, self.count, self.generator, self.replacement)
        return child_level(parent, step.extend(start, choice, self.space), depth, step.log_beam, choice)
