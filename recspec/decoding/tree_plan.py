"""Draft trees sized by cost (EAGLE-2's dynamic tree, applied to strict top-K verification).

A round of strict speculative beam search that drafts ``g`` levels of widths ``N_1 .. N_g``
advances ``1 + sum_j prod_{i <= j} a_i(N_i)`` levels on average, where ``a_j(N)`` is the
probability that round level ``j`` is accepted (the draft's top-N holds the target's top-K) given
that the levels before it were; the ``1`` is the target's own step (the correction, or the bonus
after the last drafted level). It costs one target call over the nodes it feeds
(``F + r * (fed + sum N_j)``, :class:`~recspec.decoding.cost.CallCost`) plus the drafting.
:func:`plan_round` picks ``g`` and the widths that maximise levels per second; drafting nothing
(``g = 0``: one plain beam-search step per call, ``tree-beam``'s rate) is always a candidate, so a
plan never predicts less than plain decoding.

:class:`Acceptance` holds the calibrated ``a_j(N)``, measured on validation users
(``recspec calibrate``), per round level ``j`` and width ``N``; widths between measured ones take
the measured value below (acceptance grows with ``N``), widths above the largest the largest.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from recspec.decoding.cost import CallCost


@dataclass(frozen=True)
class Acceptance:
    """``rates[j - 1][N]``: probability that round level ``j`` is accepted at width ``N`` given
    that levels ``1 .. j - 1`` were."""

    rates: tuple[dict[int, float], ...]

    def __call__(self, j: int, n: int) -> float:
        if not self.rates:
            return 0.0
        table = self.rates[min(j, len(self.rates)) - 1]
        below = [width for width in table if width <= n]
        return table[max(below)] if below else 0.0

    def to_json(self) -> list[dict[str, float]]:
        return [{str(n): rate for n, rate in sorted(table.items())} for table in self.rates]

    @classmethod
    def from_json(cls, rows: Sequence[dict[str, float]]) -> Acceptance:
        return cls(tuple({int(n): float(rate) for n, rate in row.items()} for row in rows))


@dataclass(frozen=True)
class RoundPlan:
    """``widths``: N per drafted round level (empty: draft nothing); ``steps``: expected levels
    advanced; ``seconds``: expected seconds of the round."""

    widths: tuple[int, ...]
    steps: float
    seconds: float

    @property
    def rate(self) -> float:
        """Expected levels per second."""
        return self.steps / self.seconds


def plan_round(accept: Callable[[int, int], float], levels_left: int, target: CallCost, fed: int,
               draft_s: Callable[[int], float], choices: Sequence[int], rows: int = 1) -> RoundPlan:
    """The round plan of highest expected levels per second.

    ``accept(j, n)``: acceptance of round level ``j`` at width ``n`` (:class:`Acceptance`);
    ``levels_left``: identifier levels still to decode (at most ``levels_left - 1`` are drafted:
    the last is computed from the one before); ``fed``: nodes the target call feeds per row besides
    the drafted ones (the ``K`` pending beams; the prompt too in a first round that carries it);
    ``draft_s(n)``: seconds to draft one level of ``n`` nodes per row; ``choices``: the widths
    tried per level; ``rows``: users decoded together (the call feeds every row's nodes).
    """
    best = RoundPlan((), 1.0, target.call_s(rows * fed))
    for drafted in range(1, levels_left):
        for widths in itertools.product(sorted(set(choices)), repeat=drafted):
            reach, steps = 1.0, 1.0
            for j, n in enumerate(widths, start=1):
                reach *= accept(j, n)
                steps += reach
            seconds = target.call_s(rows * (fed + sum(widths))) + sum(draft_s(n) for n in widths)
            plan = RoundPlan(widths, steps, seconds)
            if plan.rate > best.rate:
                best = plan
    return best


@dataclass(frozen=True)
class CostPlanner:
    """Round plans from calibrated acceptance and measured costs (``TopNDrafter``'s ``planner``).

    ``first`` / ``later``: acceptance of the round levels of the first round (drafted from the
    root, in the prompt's target call) and of the later ones; ``target``: the target's call cost;
    ``first_draft`` / ``later_draft``: the cost of drafting one level in those rounds
    (``call_s(n)`` for ``n`` nodes per row; a draft model, or a head after the first round);
    ``k``: the beams (the later rounds' pending nodes); ``prompt_len``: the prompt tokens the first
    round's call also feeds; ``choices``: widths tried; ``rows``: users decoded together.
    """

    first: Acceptance
    later: Acceptance
    target: CallCost
    first_draft: CallCost
    later_draft: CallCost
    k: int
    prompt_len: int
    choices: tuple[int, ...]
    rows: int = 1
    plans: dict[tuple[bool, int], RoundPlan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def plan(self, first: bool, remaining: int) -> RoundPlan:
        """The round's plan, worked out once per kind of round and levels left (the search over
        widths is Python work that a round would otherwise repeat)."""
        key = (first, remaining)
        if key not in self.plans:
            draft = self.first_draft if first else self.later_draft
            self.plans[key] = plan_round(self.first if first else self.later, remaining, self.target,
                                         self.prompt_len if first else self.k, lambda n: draft.call_s(self.rows * n),
                                         self.choices, self.rows)
        return self.plans[key]

    def __call__(self, first: bool, remaining: int) -> tuple[int, ...]:
        return self.plan(first, remaining).widths
