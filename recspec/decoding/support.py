"""A draft's support among a layer's candidates: DSBD's layer verification over the candidates a
draft can propose, plus one column for all the others.

A text head drafts from a reduced vocabulary ``D`` (:mod:`recspec.models.text_head`), so its
proposal ``q~`` is zero on every candidate ``(b, v)`` with ``v`` outside ``D`` (the end token aside,
which a finished beam continues with). The layer verification (:func:`~recspec.decoding.
acceptance.verify_layer`) treats every such candidate alike: its residual is ``p`` itself at every
step of the chain (``max(0, p - shift * 0)``), it adds nothing to ``alpha``, and it is never a
draft. Merging them into one *other* column of mass ``sum p`` over them therefore leaves every
acceptance decision, width and residual mass as it was; a draw that lands on the other column is
completed by one draw from ``p`` restricted to those candidates (the residual there is
proportional to ``p``, and so is ``p``). The verification then runs over ``W |D| + 1`` columns
instead of ``W V`` (SmolLM2: 16k instead of 98k at two beams), and only a draw that leaves the
support reads all of them again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recspec.decoding.categorical import categorical, or_uniform


@dataclass(frozen=True)
class DraftSupport:
    """The candidates of ``W`` beams a draft over the tokens ``tokens`` (int64 ``[C_q]``, ascending)
    can propose, among the ``W * V`` of the whole vocabulary (beam-major layouts): ``columns``
    int64 ``[W * C_q]``, each drafted-layout candidate's index in the whole layout; ``inside`` bool
    ``[W * V]``, whether a whole-layout candidate is one of them."""

    columns: torch.Tensor
    inside: torch.Tensor

    @staticmethod
    def of(tokens: torch.Tensor, beams: int, vocab: int) -> DraftSupport:
        columns = (torch.arange(beams, device=tokens.device)[:, None] * vocab + tokens[None, :]).view(-1)
        inside = torch.zeros(beams * vocab, dtype=torch.bool, device=tokens.device).index_fill_(0, columns, True)
        return DraftSupport(columns=columns, inside=inside)

    def project(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``p`` float32 ``[B, W * V]`` over the drafted layout and the other column, ``[B, W * C_q
        + 1]`` (the last column the mass of every candidate outside the support), and ``p`` outside
        the support, ``[B, W * V]`` (zero inside it), which :meth:`expand` draws from."""
        outside = p.masked_fill(self.inside, 0.0)
        return torch.cat((p.index_select(1, self.columns), outside.sum(dim=1, keepdim=True)), dim=1), outside

    def expand(self, chosen: torch.Tensor, outside: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Candidates ``chosen`` of the projected layout (int64 ``[B, K]``) in the whole one: a
        drafted-layout index maps to its column, the other column to a draw from ``outside``
        (:meth:`project`'s, float32 ``[B, W * V]``; rows without mass there, which never choose it,
        draw anything)."""
        other = chosen == len(self.columns)
        whole = self.columns[chosen.clamp(max=len(self.columns) - 1)]
        if not bool(other.any()):
            return whole
        return torch.where(other, categorical(or_uniform(outside), chosen.shape[1], generator), whole)
