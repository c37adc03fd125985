"""Item rounds: the engine's search over beams (:class:`ItemSearch`, run by :func:`run_rounds`)
for every tree-speculative decoder over beams (AtSpeed strict and relaxed, DSBD; the text
decoders' search is :mod:`recspec.decoding.text_rounds`; the loop is
:func:`recspec.decoding.engine.run`).

A round is ``draft -> score (one target call) -> verify -> advance / compact``, over two small
parts:

* a :class:`LevelDrafter` proposes one level of the round's token tree from the level before it and
  the draft model's log-probabilities there (top-N, sampled, beam-sampled; later a draft head);
* a :class:`Verifier` turns the scored tree into the new beams, how far each user got and what
  was accepted (strict top-K, relaxed sampling, DSBD's layer verification), says which users are
  finished and which beams go on to the next round.

:func:`run_rounds` runs one batch of left-padded prompts. The draft is prefilled once;
the target gets the prompt in the same call as the first round's tree, so with a perfect draft
the whole search costs the target one call. Both models are fed the same levels, so their KV
caches keep the same layout and are compacted by the same gather once enough dead positions have
piled up (:func:`~recspec.decoding.frontier.settle_frontier`); users whose beams are complete
leave the batch. Per-user statistics (:class:`SpecStats` or a subclass) and the time of each phase
are counted as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from recspec.decoding.beams import Beams
from recspec.decoding.cache import require_full_attention
from recspec.decoding.draft_sources import draft_source
from recspec.decoding.draft_tree import Level, fed_block
from recspec.decoding.engine import Clock, run
from recspec.decoding.frontier import (Frontier, advance, level_zero, root_frontier, select_users,
                                       settle_frontier)
from recspec.decoding.prompts import Prompts
from recspec.decoding.prefix import open_cache
from recspec.decoding.scorer import forward_features, forward_opened, forward_visible, next_log_probs


@dataclass
class SpecStats:
    """Per user, float32 ``[B]`` each: ``accepted_steps`` (AS: drafted steps accepted),
    ``drafted_steps`` (steps drafted for the user; acceptance rate = accepted / drafted),
    ``target_calls`` (prefill included), ``draft_calls`` (prefill included), ``tree_nodes`` (tree
    nodes fed to the target, summed over rounds), ``rounds``; and seconds of the user's batch,
    divided among its users: ``prefill_s``, ``draft_s``, ``verify_s`` (target call and
    verification), ``overhead_s`` (the rest: compaction, bookkeeping)."""

    accepted_steps: torch.Tensor
    drafted_steps: torch.Tensor
    target_calls: torch.Tensor
    draft_calls: torch.Tensor
    tree_nodes: torch.Tensor
    rounds: torch.Tensor
    prefill_s: torch.Tensor
    draft_s: torch.Tensor
    verify_s: torch.Tensor
    overhead_s: torch.Tensor

    @classmethod
    def zeros(cls, batch: int) -> SpecStats:
        return cls(*(torch.zeros(batch) for _ in fields(cls)))

    @classmethod
    def cat(cls, parts: Sequence[SpecStats]) -> SpecStats:
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def add_round(self, users: torch.Tensor, drafted: torch.Tensor, counters: dict[str, torch.Tensor],
                  draft_calls: int, tree_nodes: int) -> None:
        """Count one round of the users ``users`` (int64 index, CPU, ascending): one target call,
        the steps each drafted (``drafted``, float32), the verifier's per-user ``counters`` (added
        to the fields of the same name), the draft calls and the tree nodes fed to the target."""
        rows = slice(None) if len(users) == len(self.rounds) else users  # all of them: no scatter
        for name, value in counters.items():
            getattr(self, name)[rows] += value.cpu().float()
        self.drafted_steps[rows] += drafted
        self.target_calls[rows] += 1
        self.draft_calls[rows] += draft_calls
        self.tree_nodes[rows] += float(tree_nodes)
        self.rounds[rows] += 1

    def charge(self, clock: Clock, total: float, users: int) -> None:
        """Divide ``clock``'s phase seconds and the rest of the ``total`` seconds (overhead) among
        the batch's ``users``."""
        for phase, seconds in clock.seconds.items():
            getattr(self, f"{phase}_s")[:] += seconds / users
        self.overhead_s += (total - sum(clock.seconds.values())) / users

    def summary(self) -> dict[str, float]:
        """Means over users (AS@K and the rest)."""
        return {f.name: float(getattr(self, f.name).mean()) for f in fields(self)}


def drafted_per_row(depth: torch.Tensor, max_depth: int, drafted: int) -> torch.Tensor:
    """The steps each row of a round really drafts, float32 ``[B]`` on the CPU: the round drafts
    ``drafted`` levels for the whole batch (from its shallowest row), a row ahead of the others
    only those up to its identifiers' last step (``depth``: int64 ``[B]``, steps taken)."""
    return (max_depth - depth).clamp(min=0, max=drafted).cpu().float()


@dataclass
class RoundOutcome:
    """Where each user's round ended: the new beams ``[B, K]``, the fed index of each beam's
    parent ``[B, K]``, the steps taken ``[B]`` (int64), and per-user counters added to the
    statistics field of the same name (float ``[B]``; ``accepted_steps`` at least)."""

    beams: Beams
    parent_at: torch.Tensor
    steps: torch.Tensor
    counters: dict[str, torch.Tensor]


class LevelDrafter(Protocol):
    """Says how many levels a round drafts and how wide (``widths``: given whether it is the first
    round, the levels left and the round's default count ``drafted``), and proposes the round's
    level ``j`` of ``width`` nodes from level ``j - 1`` (``parent``) and the draft's log-probs at
    its nodes (``log_q``, float32 ``[B, n, V]``); ``depth``: int64 ``[B]``, each user's depth of
    the new level."""

    def widths(self, first: bool, remaining: int, drafted: int) -> tuple[int, ...]: ...

    def propose(self, parent: Level, log_q: torch.Tensor, front: Frontier, depth: torch.Tensor,
                width: int) -> Level: ...


class Verifier(Protocol):
    """Verifies the scored tree (``log_p``, float32 ``[B, M, V]``: the target's log-probs at every
    fed node, levels in order), says which users are done, and which beams go on."""

    def verify(self, front: Frontier, levels: list[Level], log_p: torch.Tensor) -> RoundOutcome: ...

    def finished(self, front: Frontier) -> torch.Tensor: ...

    def carry(self, front: Frontier) -> Frontier: ...


@dataclass(frozen=True)
class RoundShape:
    """What a round drafts: the width of each drafted level, and whether the draft is also fed the
    last level (``feed_last``) so that its cache holds what the target's will."""

    widths: tuple[int, ...]
    feed_last: bool

    def draft_calls(self, first: bool, root_drafted: bool, draft_cached: bool) -> int:
        """Draft calls of the round: one per drafted level, but the first level of a first round
        drafted from the prefill (``root_drafted``), plus the last level's when fed to a draft
        that keeps a cache (``draft_cached``)."""
        drafted = len(self.widths)
        return drafted - (first and root_drafted and drafted > 0) + (self.feed_last and draft_cached)


def shape_round(drafter: LevelDrafter, first: bool, root_drafted: bool, remaining: int, gamma: int | None
                ) -> RoundShape:
    """The round's :class:`RoundShape` with ``remaining`` steps left to the shallowest user: by
    default ``gamma`` levels (None: all but the last remaining step, which the target computes
    from the level before whatever the draft guesses), none in a first round whose draft did not
    draft the root (a head's: the target's prefill gives level 1); the drafter sets the widths."""
    default = 0 if first and not root_drafted else min(gamma or remaining, remaining - 1)
    widths = drafter.widths(first, remaining, default) if default else ()
    # a bonus step can leave sequences incomplete: the draft then takes the last level too (not in
    # a first round that drafts nothing: the draft's prefill already holds the root)
    return RoundShape(widths, len(widths) < remaining - 1 and (len(widths) > 0 or not first))


class ItemSearch:
    """The item rounds of one batch under the engine (:func:`~recspec.decoding.engine.run`): each
    row a user's beams (:class:`~recspec.decoding.frontier.Frontier`), drafted level by level by
    ``drafter`` from the log-probs of ``draft``'s source, scored by ``target`` and verified by
    ``verifier`` (see :func:`run_rounds`). Built, it has prefilled the draft (``root_log_q``: its
    log-probs at the root; None when the first round drafts nothing) and opened the target's cache
    for the prompts (``start``; the prompt itself is fed with the first round)."""

    def __init__(self, target, draft, prompts: Prompts, space, gamma: int | None, drafter: LevelDrafter,
                 verifier: Verifier, stats: SpecStats, finish: Callable[[torch.Tensor, Frontier], None],
                 clock: Clock) -> None:
        self.target, self.prompts, self.space, self.gamma, self.drafter = target, prompts, space, gamma, drafter
        self.verifier, self.stats, self.finish, self.clock = verifier, stats, finish, clock
        self.source = draft_source(draft)
        self.root_log_q = self.source.start(prompts)
        self.start = open_cache(target, prompts)
        stats.draft_calls += self.root_log_q is not None
        self.caches = (self.start.cache, *self.source.caches)
        self.front = root_frontier(prompts, space)
        self.compacted = prompts.input_ids.shape[1]  # the cache width past which positions may be dead
        self.first = True
        self.shape = RoundShape((), False)

    def draft(self) -> list[Level]:
        """Levels ``0 .. len(widths)`` of the round's tree, as many and as wide as :func:`shape_round`
        says. The draft source gives the log-probs at each level it drafts from (level 0 not in the
        first round: ``root_log_q``, its prefill's) and, if the shape says so, takes the last level
        too, so that a draft cache holds what the target's will."""
        front, first = self.front, self.first
        self.shape = shape_round(self.drafter, first, self.root_log_q is not None,
                                 self.space.depth - int(front.depth.min()), self.gamma)
        levels = [level_zero(front, self.prompts if first else None)]
        for j, width in enumerate(self.shape.widths, start=1):
            log_q = self.root_log_q if j == 1 and first and self.root_log_q is not None else \
                self.source.log_probs(levels, front)
            levels.append(self.drafter.propose(levels[-1], log_q, front, front.depth + j, width))
        if self.shape.feed_last:
            self.source.feed_last(levels)
        return levels

    def score(self, levels: list[Level]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's log-probs at every node of ``levels``, float32 ``[B, sum n, V]``, and, if the
        source wants them, its features at every position it was fed (:func:`~recspec.decoding.
        draft_tree.fed_block`: in the first round the prompt's too, before the nodes) ``[B, F, H]``
        (else None; wider with the source's ``feature_layers``). The target's cache grows from
        ``start`` (as opened for the prompts); in the first round the prompt is fed in the same
        call, after the columns ``start`` holds and before levels 1.., and row 0 of the log-probs
        is the prompt's last position (level 0, the root)."""
        features, layers = self.source.wants_features, self.source.feature_layers
        *block, keep = fed_block(levels, self.prompts if self.first else None)
        if self.first:
            logits, hidden = forward_opened(self.target, self.start, *block, keep, features, layers)
            for cache in self.caches:
                require_full_attention(cache)
        elif features:
            logits, hidden = forward_features(self.target, self.start.cache, *block, keep_last=keep,
                                              all_features=True, layers=layers)
        else:
            logits, hidden = forward_visible(self.target, self.start.cache, *block, keep_last=keep), None
        return next_log_probs(logits), hidden

    def verify(self, levels: list[Level], scored: tuple[torch.Tensor, torch.Tensor | None]) -> RoundOutcome:
        return self.verifier.verify(self.front, levels, scored[0])

    def advance(self, levels: list[Level], scored: tuple[torch.Tensor, torch.Tensor | None],
                outcome: RoundOutcome) -> torch.Tensor:
        """The beams after the round (a feature head first reads the target's features: drafting
        time), its statistics counted; returns the users now finished."""
        front, first, features = self.front, self.first, scored[1]
        state = None
        if features is not None:
            mark = self.clock.now()
            state = self.source.learn(levels, features, self.prompts if first else None, front, outcome.beams,
                                       outcome.parent_at)
            self.clock.add("draft", mark)
        own_drafted = drafted_per_row(front.depth, self.space.depth, len(self.shape.widths))
        self.front = advance(front, levels, outcome.beams, outcome.parent_at, outcome.steps, state)
        self.stats.add_round(front.users.cpu(), own_drafted, outcome.counters,
                             self.shape.draft_calls(first, self.root_log_q is not None, bool(self.source.caches)),
                             sum(level.width for level in levels[first:]))
        self.first = False
        return self.verifier.finished(self.front)

    def settle(self, finished: torch.Tensor) -> bool:
        """Hand the finished users to ``finish``, drop them, and compact the caches if due (nothing
        before the first round: no user is finished, and the caches hold the prompts as opened)."""
        if self.first:
            return True
        if bool(finished.any()):
            self.finish(self.front.users[finished], select_users(self.front, finished.nonzero()[:, 0], ()))
            if bool(finished.all()):
                return False
            self.front = select_users(self.front, (~finished).nonzero()[:, 0], self.caches)
        self.front, self.compacted = settle_frontier(self.verifier.carry(self.front), self.caches, self.compacted)
        return True


def run_rounds(target, draft, prompts: Prompts, space, gamma: int | None, drafter: LevelDrafter, verifier: Verifier,
               stats: SpecStats, finish: Callable[[torch.Tensor, Frontier], None]) -> None:
    """Speculative rounds for one batch until every user is finished (see the module doc), on the
    engine (:class:`ItemSearch`).

    ``draft``: a draft causal LM or a draft head (:func:`~recspec.decoding.draft_sources.draft_source`;
    a head's first round drafts nothing: the target's prefill gives level 1 and its features);
    ``space``: the item trie or the text vocabulary (``depth`` steps at most); ``gamma``: levels
    drafted per round (None: up to the last depth that has children: the step after it is
    computed from that depth's distributions whatever the draft guesses); ``finish(rows,
    front)`` receives each group of finished users (their batch rows and frontier).
    """
    clock = Clock(prompts.input_ids.device)
    started = clock.now()
    search = ItemSearch(target, draft, prompts, space, gamma, drafter, verifier, stats, finish, clock)
    clock.add("prefill", started)
    run(search, clock, torch.zeros(len(prompts.lengths), dtype=torch.bool))
    stats.charge(clock, clock.now() - started, len(prompts.lengths))
