"""Beam *sampling* over the item trie: the distribution one step draws from, and the draws.

A step from ``S`` beams with joint log-probabilities ``s(b)`` considers every candidate ``(b, v)``,
``v`` a trie child of ``b``, and draws ``K`` of them from the tempered joint distribution

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

import torch

from recspec.decoding.beam import Beams, Prompts, TreeCache, beam_decode, decode_in_batches, trie_children
from recspec.decoding.topk import TopK
from recspec.decoding.warp import Warp
from recspec.itemids.trie import ItemTrie


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


def candidates(beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, temperature: float,
               top_k: int | None = None, top_p: float | None = None) -> Candidates:
    """The step's candidates and their beam-sampling distribution.

    ``log_probs``: float32 ``[B, S, V]``, each beam's next-token log-probabilities (full vocabulary).
    ``top_k`` / ``top_p`` warp the joint distribution further (:class:`~recspec.decoding.warp.Warp`,
    applied after the temperature, over each user's ``S * C`` candidates).
    """
    batch, width = beams.nodes.shape
    tokens, real = trie_children(trie, beams.nodes.view(-1), min_count=1)  # [B*S, C]
    fanout = tokens.shape[1]
    log_joint = (beams.scores.reshape(-1, 1) + log_probs.reshape(batch * width, -1).gather(1, tokens))
    log_joint = log_joint.masked_fill_(~real, -torch.inf).view(batch, width * fanout)
    some = log_joint.isfinite().any(dim=1, keepdim=True)  # a user with no candidate draws dead beams
    warped = Warp(temperature, top_k, top_p)(torch.where(some, log_joint, 0.0))
    log_beam = torch.where(some, warped, -torch.inf)
    return Candidates(tokens=tokens.view(batch, width * fanout), log_joint=log_joint, log_beam=log_beam,
                      fanout=fanout)


def draw(log_weights: torch.Tensor, k: int, generator: torch.Generator, replacement: bool) -> torch.Tensor:
    """``k`` indices per row from the distribution ``softmax(log_weights)`` (``[B, M]``, rows with at
    least one finite entry): independent draws, or distinct ones (Gumbel-top-k; where a row has
    fewer than ``k`` finite entries the extra draws land on ``-inf`` slots). int64 ``[B, k]``."""
    if replacement:
        some = log_weights.isfinite().any(dim=1, keepdim=True)  # rows without any: arbitrary (dead) slots
        weights = torch.where(some, torch.softmax(log_weights, dim=1), 1.0)
        return torch.multinomial(weights, k, replacement=True, generator=generator)
    uniform = torch.rand(log_weights.shape, generator=generator, device=log_weights.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(uniform.dtype).tiny)))
    return (log_weights + gumbel).topk(k, dim=1).indices


def sample_step(beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, k: int, temperature: float,
                generator: torch.Generator, replacement: bool, top_k: int | None = None,
                top_p: float | None = None) -> Beams:
    """One beam-sampling step: ``k`` beams drawn from ``p_beam`` (see the module doc; ``top_k`` /
    ``top_p`` as in :func:`candidates`)."""
    step = candidates(beams, log_probs, trie, temperature, top_k, top_p)
    return step.extend(beams, draw(step.log_beam, k, generator, replacement), trie)


def sampling_beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int, temperature: float = 1.0,
    seed: int = 0, replacement: bool = False, batch_size: int | None = None,
) -> TopK:
    """``k`` items per prompt by the target's own beam sampling at ``temperature`` (the
    distribution relaxed verification approximates; see the module doc), with tree attention as
    :func:`~recspec.decoding.beam.tree_beam_search`. Results best first (by the model's joint
    log-probability); ``seed`` fixes the draws."""
    Warp(temperature).check()
    generator = torch.Generator(device=model.device).manual_seed(seed)

    def select(beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, k: int) -> Beams:
        return sample_step(beams, log_probs, trie, k, temperature, generator, replacement)

    def decode(model, prompts: Prompts, trie: ItemTrie, k: int) -> TopK:
        return best_first(beam_decode(TreeCache, model, prompts, trie, k, select))

    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)


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
