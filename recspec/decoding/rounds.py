"""The item round loop: :func:`run_rounds` for every tree-speculative decoder over beams (AtSpeed
strict and relaxed, DSBD; the text decoders' loop is :mod:`recspec.decoding.text_rounds`).

The tree loop is ``draft -> score (one target call) -> verify -> advance / compact``, over two
small parts:

* a :class:`LevelDrafter` proposes one level of the round's token tree from the level before it and
  the draft model's log-probabilities there (top-N, sampled, beam-sampled; later a draft head);
* a :class:`Verifier` turns the scored tree into the new beams, how far each user got and what
  was accepted (strict top-K, relaxed sampling, DSBD's layer verification), says which users are
  finished and which beams go on to the next round.

:func:`run_rounds` is the loop (one batch of left-padded prompts). The draft is prefilled once;
the target gets the prompt in the same call as the first round's tree, so with a perfect draft
the whole search costs the target one call. Both models are fed the same levels, so their KV
caches keep the same layout and are compacted by the same gather once enough dead positions have
piled up (:func:`~recspec.decoding.frontier.settle_frontier`); users whose beams are complete
leave the batch. Per-user statistics (:class:`SpecStats` or a subclass) and the time of each phase
are counted as it goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch

from recspec.decoding.beams import Beams
from recspec.decoding.cache import require_full_attention
from recspec.decoding.draft_sources import draft_source
from recspec.decoding.draft_tree import Level, fed_block
from recspec.decoding.drafting import DraftSource
from recspec.decoding.frontier import (Frontier, advance, level_zero, root_frontier, select_users,
                                       settle_frontier)
from recspec.decoding.prompts import Prompts
from recspec.decoding.prefix import OpenCache, open_cache
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

    def summary(self) -> dict[str, float]:
        """Means over users (AS@K and the rest)."""
        return {f.name: float(getattr(self, f.name).mean()) for f in fields(self)}


@dataclass
class Clock:
    """Wall time per phase; waits for the device before each reading."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("prefill", "draft", "verify"), 0.0))

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add(self, phase: str, since: float) -> float:
        now = self.now()
        self.seconds[phase] += now - since
        return now

    def charge(self, stats: SpecStats, started: float, users: int) -> None:
        """Divide the phases' seconds and the rest since ``started`` (overhead) among the batch's
        ``users`` in ``stats``."""
        total = self.now() - started
        for phase, seconds in self.seconds.items():
            getattr(stats, f"{phase}_s")[:] += seconds / users
        stats.overhead_s += (total - sum(self.seconds.values())) / users


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


def draft_levels(source: DraftSource, level0: Level, root_log_q: torch.Tensor | None, front: Frontier,
                 drafter: LevelDrafter, widths: tuple[int, ...], feed_last: bool) -> list[Level]:
    """Levels ``0 .. len(widths)`` of this round's tree, level ``j`` of ``widths[j - 1]`` nodes.
    The draft source gives the log-probs at each level it drafts from (level 0 not in the first
    round: ``root_log_q`` ``[B, 1, V]`` are its prefill's) and, if ``feed_last``, takes the last
    level too, so that a draft cache holds what the target's will."""
    levels = [level0]
    for j, width in enumerate(widths, start=1):
        log_q = root_log_q if j == 1 and root_log_q is not None else source.log_probs(levels, front)
        levels.append(drafter.propose(levels[-1], log_q, front, front.depth + j, width))
    if feed_last:
        source.feed_last(levels)
    return levels


def score_levels(target, start: OpenCache, levels: list[Level], prompts: Prompts | None, features: bool,
                 layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's log-probs at every node of ``levels``: float32 ``[B, sum n, V]``, and if
    ``features`` its features at every position it was fed (:func:`~recspec.decoding.draft_tree.
    fed_block`: in the first round the prompt's too, before the nodes) ``[B, F, H]`` (else None;
    wider with ``layers``: :func:`~recspec.models.text_head.layer_features`).
    ``start``: the target's cache as opened for the prompts (:func:`~recspec.decoding.prefix.
    open_cache`), grown by every round. In the first round (``prompts`` given) the prompt is fed
    in the same call, after the columns ``start`` holds and before levels 1.., and row 0 of the
    log-probs is the prompt's last position (level 0, the root)."""
    *block, keep = fed_block(levels, prompts)
    if prompts is not None:
        logits, hidden = forward_opened(target, start, *block, keep, features, layers)
        return next_log_probs(logits), hidden
    if features:
        logits, hidden = forward_features(target, start.cache, *block, keep_last=keep, all_features=True,
                                          layers=layers)
        return next_log_probs(logits), hidden
    return next_log_probs(forward_visible(target, start.cache, *block, keep_last=keep)), None


def run_rounds(target, draft, prompts: Prompts, space, gamma: int | None, drafter: LevelDrafter, verifier: Verifier,
               stats: SpecStats, finish: Callable[[torch.Tensor, Frontier], None]) -> None:
    """Speculative rounds for one batch until every user is finished (see the module doc).

    ``draft``: a draft causal LM or a draft head (:func:`~recspec.decoding.draft_sources.draft_source`;
    a head's first round drafts nothing: the target's prefill gives level 1 and its features);
    ``space``: the item trie or the text vocabulary (``depth`` steps at most); ``gamma``: levels
    drafted per round (None: up to the last depth that has children: the step after it is
    computed from that depth's distributions whatever the draft guesses); ``finish(rows,
    front)`` receives each group of finished users (their batch rows and frontier).
    """
    clock = Clock(prompts.input_ids.device)
    started = clock.now()
    source = draft_source(draft)
    root_log_q = source.start(prompts)
    start = open_cache(target, prompts)
    caches = (start.cache, *source.caches)
    clock.add("prefill", started)
    front = root_frontier(prompts, space)
    root_drafted = root_log_q is not None
    stats.draft_calls += root_drafted
    compacted = prompts.input_ids.shape[1]  # the cache width past which positions may be dead
    first = True
    while True:
        plan = shape_round(drafter, first, root_drafted, space.depth - int(front.depth.min()), gamma)
        users = front.users.cpu()
        own_drafted = drafted_per_row(front.depth, space.depth, len(plan.widths))
        mark = clock.now()
        levels = draft_levels(source, level_zero(front, prompts if first else None),
                              root_log_q if first else None, front, drafter, plan.widths, plan.feed_last)
        mark = clock.add("draft", mark)
        log_p, features = score_levels(target, start, levels, prompts if first else None, source.wants_features,
                                       source.feature_layers)
        if first:
            for cache in caches:
                require_full_attention(cache)
        outcome = verifier.verify(front, levels, log_p)
        mark = clock.add("verify", mark)
        state = None
        if features is not None:
            state = source.scored(levels, features, prompts if first else None, front, outcome.beams,
                                  outcome.parent_at)
            clock.add("draft", mark)
        front = advance(front, levels, outcome.beams, outcome.parent_at, outcome.steps, state)
        stats.add_round(users, own_drafted, outcome.counters, plan.draft_calls(first, root_drafted, bool(source.caches)),
                        sum(level.width for level in levels[first:]))
        first = False
        finished = verifier.finished(front)
        if bool(finished.any()):
            finish(front.users[finished], select_users(front, finished.nonzero()[:, 0], ()))
            if bool(finished.all()):
                break
            front = select_users(front, (~finished).nonzero()[:, 0], caches)
        front, compacted = settle_frontier(verifier.carry(front), caches, compacted)
    clock.charge(stats, started, len(prompts.lengths))
