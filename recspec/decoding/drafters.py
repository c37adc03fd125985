"""Drafters: each proposes one level of a round's token tree from the level before it and the
draft model's log-probabilities at its nodes (the :class:`~recspec.decoding.rounds.LevelDrafter`
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

The chain decoders draft a chain of tokens per row instead of a tree level (:class:`ChainDrafter`):
``gamma`` draws from the draft's warped ``q`` (speculative sampling), or from the draft's top-K
reweighted by the target (TopK-ImpSpecDec, :func:`importance_proposal`); the draft is a causal LM
or a text head over the target's features (:mod:`recspec.decoding.chain_drafts`).

**TopK-ImpSpecDec drafting** (topk_impspecdec.txt Alg. 1, sections 3.1-3.3). At drafted position
``i`` the draft's ``K`` most probable tokens ``T_K`` (of its warped distribution ``q_i``) are
reweighted by the importance weights ``w(y) = p_i(y) / q_i(y)`` and one token is drawn from
``r_i(y) = w(y) / sum_{T_K} w`` (Eq. 2-3); verification is Leviathan's, with the ratio
``p / q`` and the residual ``norm(max(0, p - q))`` (Alg. 1 lines 19-29, from
:func:`~recspec.decoding.acceptance.verify_chain`).

**What it costs.** ``w`` needs the target's probabilities ``p_i = M_p(prefix + x_1 .. x_{i-1})``
of the candidates *before* ``x_i`` is drawn (Alg. 1 lines 10-11), and ``p_i`` depends on the
tokens drafted before it, so it cannot come from the one parallel verification call: recspec runs
the target incrementally, one cached single-token call per drafted token (``x_{i-1}`` fed to get
``p_i``), and the last call (``x_gamma``) gives ``p_{gamma+1}``. A round therefore costs
``gamma + 1`` sequential target calls and ``gamma`` draft calls for at most ``gamma + 1``
tokens: never fewer target calls than plain sampling, so no speed-up is possible beyond what
batching the target's work would give; the benchmark measures it.

**What it samples.** The draw comes from ``r_i`` but the acceptance test uses ``q_i``, so a drafted
position emits

    P(x) = r(x) min(1, p(x) / q(x)) + (1 - sum_y r(y) min(1, p(y) / q(y))) * norm(max(0, p - q))(x),

which is *not* ``p`` in general (it is when ``r = q``): tokens with a large ``p / q`` inside the
draft's top-K are favoured twice, which is what lifts the acceptance rate. Bonus tokens (after
``gamma`` acceptances) are exact draws from ``p``. recspec tests that the output follows ``P``
and that it departs from the target's distribution. (Verifying against ``r``, i.e. Leviathan's
test with ``r`` as the proposal, would restore exactness, but the paper does not do it.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recspec.decoding.beams import Beams, Ends, candidates, draw, select_top_k
from recspec.decoding.categorical import categorical
from recspec.decoding.chain import Chain
from recspec.decoding.chain_drafts import ChainDraft
from recspec.decoding.draft_tree import Level, child_level
from recspec.decoding.frontier import Frontier, level_beams
from recspec.decoding.warp import Warp
from recspec.itemids.trie import ItemTrie


def _child(parent: Level, chosen: Beams, depth: torch.Tensor, proposal: torch.Tensor | None = None,
           choice: torch.Tensor | None = None) -> Level:
    return child_level(parent, chosen.parents, chosen.tokens[:, :, -1], chosen.nodes, chosen.scores, depth, proposal,
                       choice)


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
        return _child(parent, chosen, depth)


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
        return _child(parent, step.extend(start, choice, self.space), depth, step.log_beam, choice)


@dataclass(frozen=True)
class ChainDrafter:
    """``gamma`` drafted tokens per row and round, and the warped distributions to verify them with.

    ``importance`` None: speculative sampling (each token drawn from the draft's ``q``; the target
    scores the whole chain in one call); ``importance = K``: TopK-ImpSpecDec (each token drawn from
    the draft's top-K reweighted by ``p / q``, so the target is called once per drafted token).

    ``stop`` (speculative sampling only): a dynamic draft length. A row's chain ends before the
    next token once its draft probability (the product of ``q`` over its drafted tokens, the
    draft's guess that all of them are accepted) falls below ``stop``, and at ``gamma`` tokens at
    most; the round drafts until every row's chain has ended (a row's tokens past its own end are
    not verified for it). A row's length reads only its own draft draws, never the target's, so
    each round is Leviathan's verification of a chain of that length and the output distribution
    is unchanged (EAGLE-2's draft confidence as the acceptance estimate).
    """

    warp: Warp
    gamma: int
    generator: torch.Generator
    importance: int | None = None
    stop: float | None = None

    def __post_init__(self) -> None:
        assert self.stop is None or self.importance is None, "a dynamic draft length is for speculative sampling"

    @property
    def target_calls(self) -> int:
        """Target calls per round."""
        return 1 if self.importance is None else self.gamma + 1

    def draft(self, target, target_chain: Chain, draft: ChainDraft, tail: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The chain after each row's pending ``tail`` (int64 ``[B, 2]``, its last two tokens; the
        target's chain holds the text but the last): the drafts int64 ``[B, g]`` (``g = gamma``,
        or fewer with :attr:`stop`), each row's own chain length int64 ``[B]`` (1..g), the
        draft's ``q`` and the target's ``p``, float32 ``[B, g, V]`` / ``[B, g + 1, V]``, and the
        target's features at the ``g + 1`` tokens it was fed ``[B, g + 1, H]`` if the draft wants
        them (else None)."""
        features, layers = draft.wants_features, draft.feature_layers
        scored: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # the target's calls of the round
        drafts, q, p = [], [], []
        previous = tail[:, -1:]
        chance = torch.ones(tail.shape[0], device=tail.device)  # the draft's probability of each row's chain
        lengths = torch.zeros(tail.shape[0], dtype=torch.int64, device=tail.device)
        for i in range(self.gamma):
            if i and self.stop is not None:
                chance = chance * q[-1].gather(1, previous)[:, 0]
                if bool((chance < self.stop).all()):
                    break
                lengths += (chance >= self.stop).long()  # the chance only falls: a row's chain stays ended
            else:
                lengths += 1
            q.append(self.warp(draft.log_q_after(previous) if i else draft.log_q_first(tail)).exp())
            if self.importance is not None:
                scored.append(target_chain.feed(target, previous, features, layers))
                p.append(self.warp(scored[-1][0][:, -1]).exp())
                proposal = importance_proposal(q[-1], p[-1], self.importance)
            else:
                proposal = q[-1]
            drafts.append(categorical(proposal, 1, self.generator))
            previous = drafts[-1]
        drafted = torch.cat(drafts, dim=1)
        if self.importance is not None:
            scored.append(target_chain.feed(target, previous, features, layers))
            p.append(self.warp(scored[-1][0][:, -1]).exp())
            p_all = torch.stack(p, dim=1)
        else:
            scored.append(target_chain.feed(target, torch.cat((tail[:, -1:], drafted), dim=1), features, layers))
            p_all = self.warp(scored[-1][0]).exp()
        seen = torch.cat([hidden for _, hidden in scored if hidden is not None], dim=1) if features else None
        return drafted, lengths, torch.stack(q, dim=1), p_all, seen


def importance_proposal(q: torch.Tensor, p: torch.Tensor, k: int) -> torch.Tensor:
    """``r``: float32 ``[..., V]`` from the warped draft and target distributions ``q``, ``p``
    (``[..., V]``): ``p / q`` on the draft's top-``k`` tokens (those with ``q > 0``), normalised.
    Where the target gives every candidate probability 0 (possible under top-k / top-p warping),
    ``r`` is the draft's top-``k`` distribution itself, renormalised."""
    top = q.topk(min(k, q.shape[-1]), dim=-1).indices
    candidate = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, top, True) & (q > 0)
    weights = torch.where(candidate, p / q.clamp(min=torch.finfo(q.dtype).tiny), 0.0)
    total = weights.sum(dim=-1, keepdim=True)
    fallback = torch.where(candidate, q, 0.0)
    chosen = torch.where(total > 0, weights, fallback)
    return chosen / chosen.sum(dim=-1, keepdim=True)
