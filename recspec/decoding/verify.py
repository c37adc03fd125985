"""Verifiers of speculative beam search: pure functions from a drafted level and the target's
step to what is accepted.

Strict top-K verification (atspeed.txt Alg. 1) needs only :func:`match_drafted`: the target's
own beam-search step is computed from the scored tree, and the step is accepted when each of its
``K`` new beams is a drafted node. Relaxed sampling verification (Alg. 2) is
:class:`RelaxedSampler`, which also draws the drafts it verifies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recspec.decoding.beam import Beams
from recspec.decoding.draft_tree import Level
from recspec.decoding.sampling import candidates, draw
from recspec.itemids.trie import ItemTrie


def match_drafted(parent_fed: torch.Tensor, tokens: torch.Tensor, level: Level,
                  parent_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sequences are drafted nodes of ``level``, and which.

    ``parent_fed``: int64 ``[B, K]``, the fed index (position in the scored tree) of each
    sequence's parent; ``tokens``: int64 ``[B, K]``, its last token; ``level``: the drafted level
    at the sequences' depth, whose ``parents`` index the previous level, fed from
    ``parent_offset`` on. Returns ``found`` bool ``[B, K]`` and ``index`` int64 ``[B, K]``, the
    matching node's index within the level (0 where not found).
    """
    same_parent = (parent_offset + level.parents)[:, None, :] == parent_fed[:, :, None]
    same_token = level.tokens[:, None, :] == tokens[:, :, None]
    match = same_parent & same_token & level.real[:, None, :]  # [B, K, n]
    return match.any(dim=2), match.int().argmax(dim=2)


def strict_accepted(new: Beams, where: torch.Tensor, drafted: Level | None, parent_offset: int,
                    level_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict top-K verification of one step (atspeed.txt Alg. 1). ``new``: the target's ``K``
    new beams, continuing the beams fed at ``where`` (int64 ``[B, S]``). Returns accepted, bool
    ``[B]``: each new beam (dead fillers aside) is a node of the drafted level; and the fed index
    of each new beam's node (``[B, K]``, meaningful where accepted). Nothing drafted (the bonus
    step): never accepted."""
    if drafted is None:
        return torch.zeros(where.shape[0], dtype=torch.bool, device=where.device), where
    found, index = match_drafted(where.gather(1, new.parents), new.tokens[:, :, -1], drafted, parent_offset)
    return (found | new.scores.isneginf()).all(dim=1), level_offset + index


@dataclass(frozen=True)
class RelaxedSampler:
    """Relaxed sampling verification (atspeed.txt Alg. 2, section 3.2) and the drafting it needs.

    The draft draws ``K`` sequences per level from its own beam-sampling distribution ``q_beam``
    (:mod:`recspec.decoding.sampling`, scored from the target's exact beam scores at level 0 and
    the draft's log-probabilities after it). At step ``j``, with the target's beams equal to the
    drafted level ``j - 1`` (both distributions are then over the same candidates), each drafted
    sequence ``y`` is accepted with probability ``min(1, p_beam(y) / q_beam(y))``; the step is
    accepted when all ``K`` are. Otherwise every rejected slot is redrawn from the residual
    ``norm(max(0, p_beam - q_beam))`` and the round ends there.

    * ``replacement=True``: slots are independent; each output slot is then exactly one draw from
      ``p_beam`` (Leviathan et al., Theorem 1, per slot), so the search samples exactly the target's
      with-replacement beam sampling (:func:`~recspec.decoding.beam.sampling_beam_search` with
      ``replacement=True``).
    * ``replacement=False`` (default: ``K`` distinct items): drafts are drawn without replacement,
      verified as if independent, and the residual excludes the sequences already kept (Alg. 2
      line 17), redrawn slots distinct; if the residual's support runs out, the remaining slots
      are drawn from ``p_beam`` without the kept sequences. This is the paper's approximation of
      the target's without-replacement beam sampling: it departs from it by the dependence that
      sampling without replacement introduces, small when ``K`` is small against the spread of
      ``p_beam`` and growing as ``p_beam`` concentrates on few candidates (measured in the tests).
    """

    temperature: float
    generator: torch.Generator
    replacement: bool = False

    def draft(self, start: Beams, log_q: torch.Tensor, trie: ItemTrie,
              k: int) -> tuple[Beams, torch.Tensor, torch.Tensor]:
        """Draw ``k`` drafted sequences from ``q_beam``: the new beams, the proposal
        (log q_beam ``[B, S * C]``) and each draw's index in it ``[B, k]``."""
        step = candidates(start, log_q, trie, self.temperature)
        choice = draw(step.log_beam, k, self.generator, self.replacement)
        return step.extend(start, choice, trie), step.log_beam, choice

    def verify(self, current: Beams, where: torch.Tensor, step_log_p: torch.Tensor, drafted: Level | None,
               level_offset: int, trie: ItemTrie, k: int) -> tuple[Beams, torch.Tensor, torch.Tensor]:
        """One step of the target from its beams ``current`` (fed at ``where``, log-probs
        ``step_log_p`` ``[B, S, V]``) against the drafted level (None: nothing drafted, a plain
        sampling step). Returns the new beams, whether the step was accepted ``[B]``, and the fed
        index of each new beam when it was (the drafted nodes, from ``level_offset``)."""
        step = candidates(current, step_log_p, trie, self.temperature)
        batch = where.shape[0]
        if drafted is None:
            chosen = draw(step.log_beam, k, self.generator, self.replacement)
            return step.extend(current, chosen, trie), torch.zeros(batch, dtype=torch.bool, device=where.device), where
        log_p = step.log_beam.gather(1, drafted.choice)
        log_q = drafted.proposal.gather(1, drafted.choice)
        uniform = torch.rand(log_p.shape, generator=self.generator, device=log_p.device)
        dead = log_q.isneginf()  # fewer candidates than k: the target's draw has the same dead slots
        accept = dead | (torch.log(uniform) + log_q <= log_p)
        residual = (step.log_beam.exp() - drafted.proposal.exp()).clamp_(min=0)
        if self.replacement:
            redrawn = draw(_safe_log(residual, step.log_beam), k, self.generator, replacement=True)
        else:
            redrawn = self._redraw_distinct(residual, step.log_beam, drafted.choice, accept, k)
        chosen = torch.where(accept, drafted.choice, redrawn)
        fed = level_offset + torch.arange(k, device=where.device).expand(batch, k)
        return step.extend(current, chosen, trie), accept.all(dim=1), fed

    def _redraw_distinct(self, residual: torch.Tensor, log_beam: torch.Tensor, choice: torch.Tensor,
                         accept: torch.Tensor, k: int) -> torch.Tensor:
        """For each rejected slot, in slot order, a distinct redraw: without replacement from the
        residual with the kept sequences zeroed, then (support exhausted) from ``p_beam`` without
        them. int64 ``[B, k]`` (entries at accepted slots are unused)."""
        kept = torch.zeros_like(residual, dtype=torch.bool).scatter_(1, choice, accept)
        residual = residual.masked_fill(kept, 0.0)
        uniform = torch.rand(residual.shape, generator=self.generator, device=residual.device)
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(uniform.dtype).tiny)))
        from_residual = torch.log(residual) + gumbel
        from_target = log_beam.masked_fill(kept, -torch.inf) + gumbel - _RESIDUAL_FIRST
        keys = torch.where(residual > 0, from_residual, from_target)
        picks = keys.topk(k, dim=1).indices  # residual draws first, in order, then the fallback
        rank = ((~accept).long().cumsum(dim=1) - 1).clamp_(min=0)  # i-th rejected slot takes pick i
        return picks.gather(1, rank)


#: Offset that ranks every residual draw before every fallback draw (log weights and Gumbel
#: noise stay far inside it).
_RESIDUAL_FIRST = 1e6


def _safe_log(residual: torch.Tensor, log_beam: torch.Tensor) -> torch.Tensor:
    """log of the residual; rows where it is all zero (p_beam == q_beam: nothing is ever
    rejected there) fall back to ``log_beam`` so that a draw is defined."""
    empty = ~(residual > 0).any(dim=1, keepdim=True)
    return torch.where(empty, log_beam, torch.log(residual))
