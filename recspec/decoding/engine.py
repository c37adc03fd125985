"""The round loop of every speculative decoder, items and text: :func:`run`.

A round is ``draft -> score (one target call) -> verify -> advance -> settle``, repeated over a
batch until every row is finished. What a row is and what the round's parts do belong to the
:class:`Search` it drives:

* over items (:class:`~recspec.decoding.rounds.ItemSearch`: AtSpeed's strict and relaxed search,
  DSBD), a row is a user's ``K`` beams, a round drafts levels of a token tree under the item trie
  (or over free text, DSBD's), the verifier turns the scored tree into the next beams, and the
  caches are compacted to the beams' ancestors;
* over text (:class:`~recspec.decoding.text_rounds.TextSearch`: LASER, ReSD, a text head's trees,
  hybrid, spec-sample over trees and chains, TopK-ImpSpecDec, plain decoding), a row is one
  request's text, a round drafts a tree (a chain is a tree with one child per node) after it,
  the verifier keeps each row's accepted path and the target's own token after it, and the cache
  keeps that path.

Both settle the same way: finished rows leave the batch (their results handed out), the others'
caches are compacted, and the loop ends when none is left. :class:`Clock` times the phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Clock:
    """Wall time per phase (``prefill``, ``draft``, ``verify``: summed over the run; ``last``: the
    latest reading of each); waits for the device before each reading."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("prefill", "draft", "verify"), 0.0))
    last: dict[str, float] = field(default_factory=dict)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add(self, phase: str, since: float) -> float:
        """Add the seconds since ``since`` to ``phase``; returns now."""
        now = self.now()
        self.last[phase] = now - since
        self.seconds[phase] += now - since
        return now


class Search(Protocol):
    """One batch's decoding state under :func:`run`, its rows prefilled: :meth:`draft` the round's
    tree, :meth:`score` it in one target call (the target's log-probs or logits at every node, and
    whatever else the search reads back), :meth:`verify` it, :meth:`advance` every row past what
    was accepted (bool ``[B]``: the rows now finished), and :meth:`settle` (the finished rows leave,
    handed out; the rest is compacted for the next round; False once no row is left)."""

    def draft(self) -> Any: ...

    def score(self, draft: Any) -> Any: ...

    def verify(self, draft: Any, scored: Any) -> Any: ...

    def advance(self, draft: Any, scored: Any, outcome: Any) -> torch.Tensor: ...

    def settle(self, finished: torch.Tensor) -> bool: ...


def run(search: Search, clock: Clock, finished: torch.Tensor) -> None:
    """Rounds of ``search`` until every row is finished (``finished``: bool ``[B]``, the rows
    finished by the prefill already); ``clock`` gets the ``draft`` and ``verify`` (target call and
    verification) seconds of every round."""
    while search.settle(finished):
        mark = clock.now()
        draft = search.draft()
        mark = clock.add("draft", mark)
        outcome = search.verify(draft, scored := search.score(draft))
        clock.add("verify", mark)
        finished = search.advance(draft, scored, outcome)
