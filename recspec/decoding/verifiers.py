"""Verifiers: each turns one round's scored token tree into the new beams, how far each user
got and what was accepted (the :class:`~recspec.decoding.rounds.Verifier` interface), with the
rules of :mod:`recspec.decoding.acceptance`.

* :class:`StepVerifier`: AtSpeed, step by step from level 0 (atspeed.txt Alg. 1 / Alg. 2): the
  target's own beam-search step (strict: :func:`~recspec.decoding.beams.select_top_k`, so ties
  break exactly as in ``beam``; exact sampling: the sampling step ``beam-sample`` takes) or
  relaxed sampling step (:class:`~recspec.decoding.acceptance.RelaxedSampler`) over the children
  of its current beams, whose log-probs are in the scored tree; the step is accepted when all
  ``K`` new beams are drafted nodes (relaxed: when Alg. 2 keeps all ``K`` drafts). A user's
  round ends at its first rejected step (whose beams are the target's own, computed from the
  scored tree: the correction), after the step that follows the last drafted level (the bonus),
  or when its identifiers are complete.
* :class:`ForestVerifier`: DSBD, layer by layer over the accepted beams (dsbd.txt Alg. 1, see
  :mod:`recspec.decoding.dsbd`), with the dynamic width and, between rounds, the live beams only
  (or the best one in the one-KV-cache mode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from recspec.decoding.acceptance import (RelaxedSampler, acceptance_counts, layer_widths, residual_chain,
                                         strict_accepted, verify_layer)
from recspec.decoding.beams import Beams, Candidates, Ends, candidates, possible, select_top_k
from recspec.decoding.categorical import categorical, or_uniform
from recspec.decoding.draft_tree import Level
from recspec.decoding.frontier import Frontier, keep_beams, level_beams, level_offsets, where_beams
from recspec.decoding.rounds import RoundOutcome
from recspec.decoding.support import DraftSupport
from recspec.decoding.tree import gather_rows
from recspec.decoding.warp import Warp
from recspec.itemids.trie import ItemTrie


@dataclass(frozen=True)
class StepVerifier:
    """AtSpeed's verification of ``k`` beams over ``trie``: with ``sampler`` None, the target's own
    step ``select`` (the beam-search step for strict verification; :func:`~recspec.decoding.beams.
    sampling_select` for exact sampling over a top-N tree, which then draws exactly what
    ``beam-sample`` draws), accepted when its beams are drafted nodes; else relaxed
    (:class:`~recspec.decoding.acceptance.RelaxedSampler`)."""

    trie: ItemTrie
    k: int
    sampler: RelaxedSampler | None = None
    select: Callable[[Beams, torch.Tensor, ItemTrie, int], Beams] = select_top_k

    def _step(self, current: Beams, where: torch.Tensor, step_log_p: torch.Tensor, drafted: Level | None,
              offsets: list[int], j: int) -> tuple[Beams, torch.Tensor, torch.Tensor]:
        if self.sampler is None:
            new = self.select(current, step_log_p, self.trie, self.k)
            ok, next_where = strict_accepted(new, where, drafted, offsets[j - 1], offsets[j])
            return new, ok, next_where
        return self.sampler.verify(current, where, step_log_p, drafted, offsets[j], self.trie, self.k)

    def verify(self, front: Frontier, levels: list[Level], log_p: torch.Tensor) -> RoundOutcome:
        """Steps ``j = 1, 2, ...`` of the target over the scored tree until each user's round ends;
        ``log_p`` float32 ``[B, M, V]`` at the fed nodes (the last level may be unfed)."""
        batch, width = front.beams.nodes.shape
        device = front.depth.device
        offsets, fed = level_offsets(levels), log_p.shape[1]
        current, where = front.beams, torch.arange(width, device=device).expand(batch, width)  # fed index per beam
        if len(levels) == 1:  # nothing drafted: the round is one beam step from level 0, fed first
            new, _, _ = self._step(current, where, log_p[:, :width], None, offsets, 1)
            return RoundOutcome(new, new.parents, torch.ones(batch, dtype=torch.int64, device=device),
                                {"accepted_steps": torch.zeros(batch, dtype=torch.int64, device=device)})
        active = torch.ones(batch, dtype=torch.bool, device=device)
        steps = torch.zeros(batch, dtype=torch.int64, device=device)
        accepted = torch.zeros(batch, dtype=torch.int64, device=device)
        for j in range(1, len(levels) + 1):
            if offsets[j] > fed:  # level j - 1 was not fed: no distributions to step from
                break
            step_log_p = gather_rows(log_p, where)
            new, ok, next_where = self._step(current, where, step_log_p, levels[j] if j < len(levels) else None,
                                             offsets, j)
            new_parent_at = where.gather(1, new.parents)
            steps = torch.where(active, j, steps)
            done = active & (front.depth + j >= self.trie.depth)
            accepted += (active & ok).long()
            go_on = active & ok & ~done & (j < len(levels) and offsets[j + 1] <= fed)
            stop = active & ~go_on
            if j == 1:  # every user is active at the first step
                result, parent_at = new, new_parent_at
            else:
                result = where_beams(stop, new, result)
                parent_at = torch.where(stop[:, None], new_parent_at, parent_at)
            if not bool(go_on.any()):
                break
            current = new if j == 1 else where_beams(go_on, new, current)
            where = torch.where(go_on[:, None], next_where, where)
            active = go_on
        return RoundOutcome(result, parent_at, steps, {"accepted_steps": accepted})

    def finished(self, front: Frontier) -> torch.Tensor:
        return front.depth >= self.trie.depth

    def carry(self, front: Frontier) -> Frontier:
        return front


@dataclass
class _Layer:
    """One verified layer of the forest: the output beams ``[B, W]`` (dead past each row's
    width), the widths ``[B]``, whether the layer's drafts were accepted ``[B]``, the draft slot
    of each accepted beam ``[B, W]`` and, for a drafted layer, ``P(at least W_min accepted)``."""

    beams: Beams
    width: torch.Tensor
    ok: torch.Tensor
    slot: torch.Tensor
    beta: torch.Tensor | None


@dataclass(frozen=True)
class ForestVerifier:
    """DSBD's verification over ``space`` (an item trie, or the text vocabulary with ``ends``):
    layers of ``W_L`` beams, fixed (``threshold`` None: ``min_width``) or dynamic, ``k`` in a
    trie's last layer; ``out_width`` columns of beams; ``one_cache``: section 3.4's mode;
    ``draft_tokens``: over free text, the tokens the draft drafted over (its proposals are laid
    out over them: :meth:`~recspec.decoding.space.FreeText.restricted`), verified over their
    :class:`~recspec.decoding.support.DraftSupport`; None: the whole vocabulary."""

    space: ItemTrie  # or the text vocabulary (recspec.decoding.space.FreeText) with ``ends``
    ends: Ends | None
    warp: Warp
    k: int
    min_width: int
    draft_width: int
    threshold: float | None
    one_cache: bool
    out_width: int
    generator: torch.Generator
    draft_tokens: torch.Tensor | None = None

    def _layer(self, step: Candidates, previous: Beams, alive: torch.Tensor, drafted: Level | None,
               width: torch.Tensor, last: torch.Tensor) -> _Layer:
        """Verify one layer from the candidates ``step`` of the accepted beams ``alive``."""
        p = step.log_beam.exp()
        batch, device = p.shape[0], p.device
        if drafted is None:  # the bonus layer: straight from p_beam
            width = torch.where(last, self.k, width if self.threshold is not None else self.min_width)
            chosen = categorical(or_uniform(p), self.out_width, self.generator)
            slot = torch.full_like(chosen, -1)
            ok, beta = torch.zeros(batch, dtype=torch.bool, device=device), None
        else:
            support = None if self.draft_tokens is None else \
                DraftSupport.of(self.draft_tokens, previous.nodes.shape[1], step.fanout)
            fanout = step.fanout if support is None else len(self.draft_tokens)  # of the drafted layout
            parent_alive = alive[:, torch.arange(drafted.proposal.shape[1], device=device) // fanout]
            restricted = drafted.proposal.masked_fill(~parent_alive, -torch.inf)
            some = possible(restricted)
            q = torch.where(some, torch.softmax(torch.where(some, restricted, 0.0), dim=1), 0.0)
            if support is None:
                verified, outside = p, None
            else:
                (verified, outside), q = support.project(p), torch.nn.functional.pad(q, (0, 1))  # q is 0 outside
            survive = alive.gather(1, drafted.parents) & drafted.real
            count = survive.sum(dim=1)
            chain = residual_chain(verified, q, self.draft_width + 1)
            outcomes = acceptance_counts(chain[0], count)
            width = torch.where(last, self.k, layer_widths(outcomes, count, self.threshold, self.min_width))
            verdict = verify_layer(verified, q, drafted.choice, survive, width, self.out_width, self.generator, chain)
            chosen, slot = verdict.chosen, verdict.slot
            if support is not None:
                chosen = support.expand(chosen, outside, self.generator)
            ok = verdict.accepted >= width
            beta = outcomes.flip(1).cumsum(dim=1).flip(1)[:, self.min_width]
        new = step.extend(previous, chosen, self.space)
        dead = torch.arange(self.out_width, device=device)[None, :] >= width[:, None]
        new = replace(new, scores=new.scores.masked_fill(dead, -torch.inf), nodes=new.nodes.masked_fill(dead, -1))
        return _Layer(new, width, ok, slot, beta)

    def verify(self, front: Frontier, levels: list[Level], log_p: torch.Tensor) -> RoundOutcome:
        """Layers ``1, 2, ...`` of the round; ``log_p`` float32 ``[B, N, V]`` at the fed nodes."""
        batch, device = front.depth.shape[0], front.depth.device
        offsets = level_offsets(levels)
        alive, score = front.beams.scores.isfinite(), front.beams.scores  # the accepted beams, their scores
        width = alive.sum(dim=1)
        active = torch.ones(batch, dtype=torch.bool, device=device)
        counters = {name: torch.zeros(batch, device=device)
                    for name in ("accepted_steps", "verified_layers", "beta_sum", "width_sum")}
        for j in range(1, len(levels) + 1):
            parent = levels[j - 1]
            step_log_p = log_p[:, offsets[j - 1]:offsets[j]]
            if self.ends is not None:
                step_log_p = self.ends.absorb(parent.nodes, step_log_p)
            previous = replace(level_beams(parent, front.beams.margin), scores=score.masked_fill(~alive, -torch.inf))
            draws = 1 if j == len(levels) else levels[j].choice.shape[1]  # padded as the drafted level was
            step = candidates(previous, step_log_p, self.space, self.warp, draws)
            last = front.depth + j >= self.space.depth
            drafted = levels[j] if j < len(levels) else None
            layer = self._layer(step, previous, alive, drafted, width, last)
            width = layer.width
            if layer.beta is not None:
                counters["verified_layers"] += active.float()
                counters["beta_sum"] += torch.where(active, layer.beta, 0.0)
            counters["accepted_steps"] += (active & layer.ok).float()
            counters["width_sum"] += torch.where(active, width.float(), 0.0)
            if self.ends is not None:  # text ends where every beam has ended, as beam sampling does
                last = last | self.ends.complete(layer.beams.nodes)
            go_on = active & layer.ok & ~last
            stop = active & ~go_on
            parent_at = offsets[j - 1] + layer.beams.parents
            if j == 1:
                out, out_parent_at = layer.beams, parent_at
                steps = torch.full((batch,), 1, dtype=torch.int64, device=device)
            else:
                out = replace(where_beams(stop, layer.beams, out), margin=out.margin)
                out_parent_at = torch.where(stop[:, None], parent_at, out_parent_at)
                steps = torch.where(stop, j, steps)
            if not bool(go_on.any()):
                break
            into = layer.slot.masked_fill(layer.slot < 0, drafted.width)  # unused slots land in a spare column
            score = torch.full((batch, drafted.width + 1), -torch.inf, device=device).scatter_(
                1, into, layer.beams.scores)[:, :-1]
            alive = score.isfinite()
            active = go_on
        counters["steps"] = steps.float()
        return RoundOutcome(out, out_parent_at, steps, counters)

    def finished(self, front: Frontier) -> torch.Tensor:
        done = front.depth >= self.space.depth
        return done | self.ends.complete(front.beams.nodes) if self.ends is not None else done

    def carry(self, front: Frontier) -> Frontier:
        """The live beams first, no column dead in every row (only the best beam per row in the
        one-KV-cache mode); dead beams see nothing, so their cache rows go."""
        live = front.beams.scores.isfinite()
        if self.one_cache:
            order = front.beams.scores.argmax(dim=1, keepdim=True)
        else:
            order = (~live).to(torch.int8).argsort(dim=1, stable=True)[:, :max(int(live.sum(dim=1).max()), 1)]
        kept = keep_beams(front, order)
        return replace(kept, visible=kept.visible & kept.beams.scores.isfinite()[:, :, None])
