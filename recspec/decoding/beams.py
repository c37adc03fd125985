"""Beams and one step of beam search or beam sampling, over an item trie or free text.

:class:`Beams` holds the live hypotheses of a batch of users; :func:`select_top_k` is one step of
beam search (the ``k`` best continuations), :func:`sample_step` one step of beam sampling (``k``
draws); :class:`TopK` is what every item decoder returns. The candidate space is an
:class:`~recspec.itemids.trie.ItemTrie` or :class:`~recspec.decoding.space.FreeText` (the
interface ``root``, ``depth``, ``device``, ``children``, ``step``, ``items``).

**Beam sampling.** A step from ``S`` beams with joint log-probabilities ``s(b)`` considers every
candidate ``(b, v)``, ``v`` a trie child of ``b``, and draws ``K`` of them from the tempered joint distribution

    p_beam(b, v) = exp((s(b) + log p(v | b)) / T) / Z        (dsbd.txt Eq. 1 with the warping T
                                                              applied to the joint, atspeed.txt p_j)

where ``Z`` sums over the candidates only (constrained: only real items come out). ``K`` draws
are either independent (``replacement=True``: the distribution DSBD's Theorem 3.1 and AtSpeed's
with-replacement approximation reason about; beams may repeat) or without replacement (``False``:
``K`` distinct sequences, the beam sampling a recommender wants, drawn by Gumbel-top-K, which is
sequential sampling without replacement). For ``K = 1`` the two agree, and a whole search is
ancestral sampling at temperature ``T`` restricted to the trie.

The joint score a new beam carries is the untempered ``s(b) + log p(v | b)``, so beam scores are
always the model's log-probabilities and ``T`` only shapes the draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from recspec.decoding.categorical import categorical
from recspec.decoding.warp import Warp
from recspec.itemids.trie import ItemTrie


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


@dataclass(frozen=True)
class Beams:
    """The live hypotheses of ``B`` users after ``d`` decoding steps, ``S`` per user, best first
    (``S = 1`` before the first step: the empty prefix; ``K`` afterwards).

    ``scores``: float32 ``[B, S]``, summed log-probs, ``-inf`` for a dead beam (a filler when the
    user had fewer than ``K`` candidates); ``nodes``: int64 ``[B, S]``, the trie node of each
    prefix, ``-1`` when dead; ``tokens``: int64 ``[B, S, d]``, the prefixes; ``parents``: int64
    ``[B, S]``, the index in ``[0, S_prev)`` of the previous step's beam each one extends;
    ``margin``: float32 ``[B]``, the smallest gap so far between the K-th kept and the best
    dropped candidate (see :class:`TopK`).
    """

    scores: torch.Tensor
    nodes: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    margin: torch.Tensor

    @staticmethod
    def start(batch_size: int, trie: ItemTrie) -> Beams:
        """One empty prefix (the trie's root, score 0) per user."""
        zeros = torch.zeros(batch_size, 1, dtype=torch.int64, device=trie.device)
        return Beams(
            scores=torch.zeros(batch_size, 1, dtype=torch.float32, device=trie.device),
            nodes=zeros + trie.root,
            tokens=zeros.new_zeros(batch_size, 1, 0),
            parents=zeros,
            margin=torch.full((batch_size,), torch.inf, device=trie.device),
        )

    def result(self, trie: ItemTrie) -> TopK:
        """The beams as the final :class:`TopK` (call after ``L`` steps, when they are leaves)."""
        return TopK(items=trie.items(self.nodes), scores=self.scores, tokens=self.tokens, margin=self.margin)


def select_top_k(beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, k: int) -> Beams:
    """One beam-search step: the ``k`` best one-token continuations of ``beams`` within the trie.

    ``log_probs``: float32 ``[B, S, V]``, the next-token log-probabilities (log-softmax over the
    full vocabulary) after each beam's prefix. The candidates are the trie children of every beam,
    ``[B, S * C]`` with ``C`` the largest fan-out among the beams, scored ``beam score + log-prob``
    (``-inf`` for padding slots and children of dead beams); one stable descending sort per user
    keeps the ``k`` best, best first (exact ties: better parent, then smaller token). Fully
    vectorised: no Python loop over users, beams or tokens.
    """
    batch, width = beams.nodes.shape
    tokens, real, children = at_least(-(-k // width), *trie.child_edges(beams.nodes.view(-1)))  # [B*S, C]
    fanout = tokens.shape[1]
    step_log_probs = log_probs.reshape(batch * width, -1).gather(1, tokens)
    candidates = (beams.scores.reshape(-1, 1) + step_log_probs).masked_fill_(~real, -torch.inf)
    ranked, index = candidates.view(batch, width * fanout).sort(dim=1, descending=True, stable=True)
    scores, index = ranked[:, :k], index[:, :k]
    margin = beams.margin
    if ranked.shape[1] > k:  # a real (finite) dropped candidate narrows the margin
        gap = torch.where(ranked[:, k].isfinite(), ranked[:, k - 1] - ranked[:, k], torch.inf)
        margin = torch.minimum(margin, gap)
    parents = index // fanout
    chosen = tokens.view(batch, width * fanout).gather(1, index)
    nodes = children.view(batch, width * fanout).gather(1, index)
    history = beams.tokens.gather(1, parents[:, :, None].expand(-1, -1, beams.tokens.shape[2]))
    return Beams(
        scores=scores,
        nodes=nodes.masked_fill_(scores.isneginf(), -1),
        tokens=torch.cat((history, chosen[:, :, None]), dim=2),
        parents=parents,
        margin=margin,
    )


def at_least(min_count: int, *columns: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``columns`` (``[N, C]`` each: a space's children of ``N`` nodes, their real flags, ...)
    padded with zeros / False to at least ``min_count`` columns, so that a user's ``S * C``
    candidates are never fewer than the ``k`` a step keeps or draws."""
    missing = min_count - columns[0].shape[1]
    return tuple(torch.nn.functional.pad(part, (0, missing)) for part in columns) if missing > 0 else columns


class Ends(Protocol):
    """What free text adds to a candidate space (:class:`~recspec.decoding.space.FreeText`):
    finished prefixes continue with the end token at probability 1."""

    def absorb(self, nodes: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """``log_probs`` ``[B, n, V]`` with each finished node's row replaced by the end token at
        probability 1."""
        ...

    def complete(self, nodes: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: every beam of the row (``nodes`` ``[B, K]``) is finished or dead."""
        ...

    def kept(self, k: int, fanout: int) -> torch.Tensor:
        """int64 ``[k]``: the candidate indices (``[S * C]`` layout) of ``k`` finished beams
        continuing with the end token."""
        ...


@dataclass(frozen=True)
class Candidates:
    """The candidates of one step for ``B`` users, laid out ``[B, S * C]`` (beam-major, ``C`` the
    largest fan-out): ``tokens`` int64, ``log_joint`` float32 (``s(b) + log p(v | b)``, ``-inf``
    for padding), ``log_beam`` float32 (``log p_beam``, normalised per user), ``fanout`` ``C``."""

    tokens: torch.Tensor
    log_joint: torch.Tensor
    log_beam: torch.Tensor
    fanout: int

    def extend(self, beams: Beams, chosen: torch.Tensor, trie: ItemTrie) -> Beams:
        """The beams that continue ``beams`` with the candidates ``chosen`` (int64 ``[B, K]``);
        a chosen padding slot gives a dead beam (score ``-inf``, node ``-1``)."""
        parents = chosen // self.fanout
        tokens = self.tokens.gather(1, chosen)
        scores = self.log_joint.gather(1, chosen)
        nodes = trie.step(beams.nodes.gather(1, parents).view(-1), tokens.view(-1)).view(tokens.shape)
        history = beams.tokens.gather(1, parents[:, :, None].expand(-1, -1, beams.tokens.shape[2]))
        return Beams(scores=scores, nodes=nodes.masked_fill_(scores.isneginf(), -1),
                     tokens=torch.cat((history, tokens[:, :, None]), dim=2), parents=parents,
                     margin=torch.full_like(beams.margin, torch.inf))


def possible(log_weights: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1]``: the rows of ``log_weights`` (float ``[B, M]``, ``M >= 1``, never ``+inf``) with a
    finite entry (one max instead of ``isfinite().any()``: 14 against 200 microseconds over
    SmolLM2's two-beam candidates on this project's CPU)."""
    return log_weights.amax(dim=1, keepdim=True) > -torch.inf


def candidates(beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, warp: Warp, draws: int = 1) -> Candidates:
    """The step's candidates and their beam-sampling distribution.

    ``log_probs``: float32 ``[B, S, V]``, each beam's next-token log-probabilities (full vocabulary).
    ``warp`` (temperature, then top-k / top-p) shapes the joint distribution over each user's
    ``S * C`` candidates, padded with impossible ones to at least ``draws`` (the distinct draws
    to be made from them, :func:`draw`).
    """
    batch, width = beams.nodes.shape
    tokens, real = at_least(-(-draws // width), *trie.children(beams.nodes.view(-1)))  # [B*S, C]
    fanout = tokens.shape[1]
    log_joint = (beams.scores.reshape(-1, 1) + log_probs.reshape(batch * width, -1).gather(1, tokens))
    log_joint = torch.where(real, log_joint, -torch.inf).view(batch, width * fanout)
    some = possible(log_joint)  # a user with no candidate draws dead beams
    warped = warp(torch.where(some, log_joint, 0.0))
    log_beam = torch.where(some, warped, -torch.inf)
    return Candidates(tokens=tokens.view(batch, width * fanout), log_joint=log_joint, log_beam=log_beam,
                      fanout=fanout)


def draw(log_weights: torch.Tensor, k: int, generator: torch.Generator, replacement: bool) -> torch.Tensor:
    """``k`` indices per row from the distribution ``softmax(log_weights)`` (``[B, M]``, rows with at
    least one finite entry): independent draws, or distinct ones (Gumbel-top-k; where a row has
    fewer than ``k`` finite entries the extra draws land on ``-inf`` slots). int64 ``[B, k]``."""
    if replacement:
        some = possible(log_weights)  # rows without any: arbitrary (dead) slots
        weights = torch.where(some, torch.softmax(log_weights, dim=1), 1.0)
        return categorical(weights, k, generator)
    uniform = torch.rand(log_weights.shape, generator=generator, device=log_weights.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(uniform.dtype).tiny)))
    return (log_weights + gumbel).topk(k, dim=1).indices


def sample_step(beams: Beams, log_probs: torch.Tensor, space, k: int, warp: Warp, generator: torch.Generator,
                replacement: bool, ends: Ends | None = None) -> Beams:
    """One beam-sampling step: ``k`` beams drawn from ``p_beam`` (see the module doc) over ``space``.
    With ``ends`` (free text), a finished prefix continues with the end token at probability 1, and a
    user whose beams have all finished keeps them (as it would alone)."""
    if ends is not None:
        log_probs = ends.absorb(beams.nodes, log_probs)
    step = candidates(beams, log_probs, space, warp, k)
    chosen = draw(step.log_beam, k, generator, replacement)
    if ends is not None and beams.tokens.shape[2] > 0:
        chosen = torch.where(ends.complete(beams.nodes)[:, None], ends.kept(k, step.fanout), chosen)
    return step.extend(beams, chosen, space)


def sampling_select(warp: Warp, generator: torch.Generator, replacement: bool):
    """:func:`sample_step` at ``warp`` from ``generator`` as a step ``select(beams, log_probs, trie,
    k) -> Beams``, the form :func:`~recspec.decoding.beam_search.beam_decode` and
    :class:`~recspec.decoding.verifiers.StepVerifier` take (their default is :func:`select_top_k`)."""
    def select(beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, k: int) -> Beams:
        return sample_step(beams, log_probs, trie, k, warp, generator, replacement)
    return select


def best_first(result: TopK) -> TopK:
    """``result`` with each user's items sorted by score, best first (sampled beams come in draw
    order)."""
    order = result.scores.argsort(dim=1, descending=True, stable=True)
    return TopK(items=result.items.gather(1, order), scores=result.scores.gather(1, order),
                tokens=result.tokens.gather(1, order[:, :, None].expand_as(result.tokens)), margin=result.margin)


def distinct_items(result: TopK) -> TopK:
    """``result`` (best first) with every repeat of an item that ranks higher dropped: its slot
    becomes item ``-1`` with score ``-inf`` and moves to the end (independent draws may repeat an
    item; a recommendation list never does)."""
    items = result.items
    earlier = torch.ones(items.shape[1], items.shape[1], dtype=torch.bool, device=items.device).tril(-1)
    repeat = ((items[:, :, None] == items[:, None, :]) & earlier).any(dim=2) & (items >= 0)
    order = repeat.to(torch.int8).argsort(dim=1, stable=True)
    items = items.masked_fill(repeat, -1).gather(1, order)
    scores = result.scores.masked_fill(repeat, -torch.inf).gather(1, order)
    return TopK(items=items, scores=scores, tokens=result.tokens.gather(1, order[:, :, None].expand_as(result.tokens)),
                margin=result.margin)
