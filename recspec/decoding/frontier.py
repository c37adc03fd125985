"""The frontier of a speculative search: each active user's current target beams, with the
paths, depths and cache views that the next round starts from, and the operations that move it
(seeding, the round's level 0, advancing after verification, narrowing, dropping finished users,
compacting the KV caches)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from recspec.decoding.beams import Beams
from recspec.decoding.prompts import Prompts
from recspec.decoding.cache import cache_width, compact, select_rows
from recspec.decoding.draft_tree import Level, stacked
from recspec.decoding.tree import child_rows, gather_rows


@dataclass
class Frontier:
    """The target's current beams of the active users (pending last tokens; see draft_tree).

    ``beams``: scores, trie nodes and margin ``[B, K]`` / ``[B]`` (its ``tokens`` are not kept;
    ``paths`` holds them); ``paths``: int64 ``[B, K, L]``; ``depth``: int64 ``[B]``;
    ``visible``: bool ``[B, K, T]``, each beam's view of the cache (prompt and ancestors);
    ``lengths``: int64 ``[B]``, real prompt tokens; ``users``: int64 ``[B]``, row in the batch;
    ``draft_state``: float ``[B, K, D]``, what the draft source carries per beam into the next
    round (a draft head's: the target's last hidden state at the beam's parent, the node whose
    distribution chose the pending token, or its work on the pending token done ahead; see
    :mod:`~recspec.decoding.draft_sources`), None for a draft model.
    """

    beams: Beams
    paths: torch.Tensor
    depth: torch.Tensor
    visible: torch.Tensor
    lengths: torch.Tensor
    users: torch.Tensor
    draft_state: torch.Tensor | None = None


def root_frontier(prompts: Prompts, space) -> Frontier:
    """Every user at depth 0: one beam, the empty prefix, whose "pending" token is the prompt's
    last one (it is fed with the prompt in the first round). ``space``: an item trie or the text
    vocabulary (``depth``, ``device`` and what :meth:`Beams.start` needs)."""
    batch = len(prompts.lengths)
    return Frontier(beams=Beams.start(batch, space),
                    paths=torch.zeros(batch, 1, space.depth, dtype=torch.int64, device=space.device),
                    depth=torch.zeros(batch, dtype=torch.int64, device=space.device),
                    visible=prompts.attention_mask.bool()[:, None, :], lengths=prompts.lengths,
                    users=torch.arange(batch, device=space.device))


def level_zero(front: Frontier, prompts: Prompts | None) -> Level:
    """The round's first level: the pending beams, or (``prompts`` given, first round) the root,
    which is the prompt's last token and sees the prompt."""
    batch, k = front.beams.nodes.shape
    if prompts is not None:
        return Level(tokens=prompts.input_ids[:, -1:], nodes=front.beams.nodes, parents=torch.full_like(
            front.beams.nodes, -1), scores=front.beams.scores, visible=front.visible,
            positions=(front.lengths - 1)[:, None], paths=front.paths)
    tokens = front.paths.gather(2, (front.depth - 1)[:, None, None].expand(-1, k, 1))[:, :, 0]
    own = torch.arange(k, device=tokens.device).expand(batch, k)  # each beam continues itself
    return Level(tokens=tokens, nodes=front.beams.nodes, parents=torch.full_like(tokens, -1),
                 scores=front.beams.scores, visible=child_rows(front.visible, own),
                 positions=(front.lengths + front.depth - 1)[:, None].expand(-1, k), paths=front.paths)


def level_offsets(levels: Sequence[Level]) -> list[int]:
    """Where each level starts among the round's fed nodes, and (last) where they end."""
    return list(accumulate((level.width for level in levels), initial=0))


def level_beams(level: Level, margin: torch.Tensor) -> Beams:
    """A level's nodes as beams (one-token histories: the last token; ``margin`` ``[B]``)."""
    return Beams(scores=level.scores, nodes=level.nodes, tokens=level.tokens[:, :, None], parents=level.parents,
                 margin=margin)


def where_beams(rows: torch.Tensor, new: Beams, old: Beams) -> Beams:
    """``new`` for users where ``rows`` (bool ``[B]``), else ``old`` (same width ``K``; the
    tokens keep the last one)."""
    pick = rows[:, None]
    return Beams(scores=torch.where(pick, new.scores, old.scores), nodes=torch.where(pick, new.nodes, old.nodes),
                 tokens=torch.where(pick[:, :, None], new.tokens[:, :, -1:], old.tokens[:, :, -1:]),
                 parents=torch.where(pick, new.parents, old.parents),
                 margin=torch.where(rows, new.margin, old.margin))


def advance(front: Frontier, levels: list[Level], beams: Beams, parent_at: torch.Tensor,
            steps: torch.Tensor, draft_state: torch.Tensor | None = None) -> Frontier:
    """The frontier after the round: the new ``beams`` (``[B, K]``), whose parents are the fed
    nodes ``parent_at`` (int64 ``[B, K]``), ``steps`` (int64 ``[B]``) deeper; each beam sees the
    uncompacted cache as its parent did (prompt and ancestors). ``draft_state``: ``[B, K, D]``,
    what the draft source carries per new beam (:attr:`Frontier.draft_state`)."""
    _, visible, _ = stacked(levels)  # [B, M, W]: every node's view
    paths = torch.cat([level.paths for level in levels], dim=1)
    k = parent_at.shape[1]
    view = gather_rows(visible, parent_at)
    depth = front.depth + steps
    new_paths = gather_rows(paths, parent_at)
    new_paths.scatter_(2, (depth - 1).clamp(max=paths.shape[2] - 1)[:, None, None].expand(-1, k, 1),
                       beams.tokens[:, :, -1:])
    return Frontier(beams=beams, paths=new_paths, depth=depth, visible=view, lengths=front.lengths,
                    users=front.users, draft_state=draft_state)


def keep_beams(front: Frontier, order: torch.Tensor) -> Frontier:
    """The frontier with, per user, the beams ``order`` (int64 ``[B, K']``) in that order."""
    def pick(t: torch.Tensor) -> torch.Tensor:  # [B, K, ...] -> the chosen beams
        return gather_rows(t, order)

    b = front.beams
    beams = Beams(scores=pick(b.scores), nodes=pick(b.nodes), tokens=pick(b.tokens), parents=pick(b.parents),
                  margin=b.margin)
    return Frontier(beams=beams, paths=pick(front.paths), depth=front.depth, visible=pick(front.visible),
                    lengths=front.lengths, users=front.users,
                    draft_state=None if front.draft_state is None else pick(front.draft_state))


#: Positions fed after the prompt that the caches may hold, dead ones included (hidden from every
#: beam by ``visible``), before a round compacts them: attending to a few hundred hidden positions
#: costs the later calls less than copying every layer's tail each round, and an item search, a few rounds over a few dozen nodes, never reaches it.
SLACK = 256


def settle_frontier(front: Frontier, caches: Sequence, compacted: int) -> tuple[Frontier, int]:
    """The frontier for the next round, and the cache width it starts from if compacted: the caches
    are compacted (:func:`compact_frontier`) when they hold more than :data:`SLACK` positions past
    ``compacted`` (the width after the last compaction, or the prompt's), or when their widths
    differ; else they are left as they are and the beams' view is cut to the fed positions (a
    round's last level may have gone unfed)."""
    widths = [cache_width(cache) for cache in caches]
    width = widths[0]
    if len(set(widths)) == 1 and width - compacted <= SLACK:
        return replace(front, visible=front.visible[:, :, :width]), compacted
    return compact_frontier(front, caches), cache_width(caches[0])


def compact_frontier(front: Frontier, caches: Sequence) -> Frontier:
    """Keep in both caches the prompt and the ancestors of the beams, nothing else (one gather per
    layer, the same for both: their layouts agree); rows of users with fewer such positions than
    the longest are filled with position 0, hidden from every beam."""
    view = front.visible[:, :, :cache_width(caches[0])]
    positions, filled = compact(caches, view.any(dim=1))
    visible = view.gather(2, positions[:, None, :].expand(-1, view.shape[1], -1)) & filled[:, None, :]
    return replace(front, visible=visible)


def select_users(front: Frontier, rows: torch.Tensor, caches: Sequence) -> Frontier:
    """Keep the users ``rows`` (int64 index) of the frontier and of every cache."""
    for cache in caches:
        select_rows(cache, rows)
    b = front.beams
    return Frontier(
        beams=Beams(scores=b.scores[rows], nodes=b.nodes[rows], tokens=b.tokens[rows], parents=b.parents[rows],
                    margin=b.margin[rows]),
        paths=front.paths[rows], depth=front.depth[rows], visible=front.visible[rows], lengths=front.lengths[rows],
        users=front.users[rows],
        draft_state=None if front.draft_state is None else front.draft_state[rows])
