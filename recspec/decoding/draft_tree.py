"""The token tree of one speculative round: the target's pending beams, then the draft's levels.

A round starts from each user's ``K`` current target beams at depth ``t`` whose last tokens are
*pending*: chosen, but not yet in either model's KV cache. Level 0 of the tree is those ``K``
pending tokens; level ``j`` holds the ``n_j`` sequences at depth ``t + j`` that the drafter
proposes, each the child of one node of level ``j - 1``. Both models are fed the same levels in
the same order (the draft one level per call while it drafts, the target all of them in one
call), so the two KV caches always have the same layout and are compacted by the same gather.

Node visibility is the decoders' one representation (:mod:`recspec.decoding.tree`): a bool matrix
``visible[b, i]`` over the ``T`` cached positions plus the nodes fed so far, True for the user's
real prompt tokens, the node's cached and in-tree ancestors, and the node itself. Level ``j``'s
rows are its parents' rows plus the new diagonal (:func:`~recspec.decoding.tree.child_rows`).

**Draws and nodes.** A level is a set of *draws* (a drafter's proposals, a round's input beams),
each the child of one draw of the level before it. Sampled draws repeat (DSBD draws its beams and
drafts independently, with replacement): a *merged* level feeds each distinct sequence once, as
one node, and keeps which node each draw is (``draws``) and which draw of the previous level it
continues (``drawn_from``). The target's and the draft's distributions at a node are those of
every draw of it, so verification reads them per draw (:meth:`Level.at_draws`) and decides
exactly as over the unmerged level; only the fed rows, the caches and the visibility are per
node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import forward_visible, next_log_probs, prompt_and_tree
from recspec.decoding.tree import child_rows


@dataclass
class Level:
    """``n`` tree nodes per user at one depth.

    ``tokens``, ``nodes`` (trie node, ``-1`` for a dead node), ``parents`` (index of the parent in
    the previous level; ``-1`` on level 0): int64 ``[B, n]``; ``scores``: float32 ``[B, n]``, the
    drafter's score of the node's sequence (``-inf`` for a dead node); ``visible``: bool
    ``[B, n, W]`` over the cached
    positions and all nodes fed before and including this level (``W = T + offset + n``);
    ``positions``: int64 ``[B, n]``; ``paths``: int64 ``[B, n, L]``, the node's whole identifier
    prefix (zeros past its depth). Sampled levels (relaxed verification) also keep the draft's
    step distribution they were drawn from: ``proposal``, float32 ``[B, n_prev * C]``, log q_beam
    over the previous level's *draws'* candidates (:class:`~recspec.decoding.beams.Candidates`
    layout), and ``choice``, int64 ``[B, c]``, each draw's index in it. A merged level (module doc)
    keeps ``draws``, int64 ``[B, c]``, the node of each of its ``c`` draws, and ``drawn_from``,
    int64 ``[B, c]``, the draw of the previous level each continues (``-1`` on level 0); None: one
    draw per node (``c = n``), the node's parent its draw's.
    """

    tokens: torch.Tensor
    nodes: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    visible: torch.Tensor
    positions: torch.Tensor
    paths: torch.Tensor
    proposal: torch.Tensor | None = None
    choice: torch.Tensor | None = None
    draws: torch.Tensor | None = None
    drawn_from: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """``n``, the level's nodes (fed rows)."""
        return self.tokens.shape[1]

    @property
    def count(self) -> int:
        """``c``, the level's draws."""
        return self.width if self.draws is None else self.draws.shape[1]

    @property
    def draw_parents(self) -> torch.Tensor:
        """int64 ``[B, c]``: the draw of the previous level each draw continues."""
        return self.parents if self.drawn_from is None else self.drawn_from

    def at_draws(self, values: torch.Tensor) -> torch.Tensor:
        """Per-node ``values`` ``[B, n, ...]`` per draw, ``[B, c, ...]``."""
        return values if self.draws is None else rows_at(values, self.draws)

    def node_of(self, draws: torch.Tensor) -> torch.Tensor:
        """int64: the node of each of the level's draws ``draws`` (int64 ``[B, k]``)."""
        return draws if self.draws is None else self.draws.gather(1, draws)

    def per_node(self, values: torch.Tensor) -> torch.Tensor:
        """Per-draw ``values`` ``[B, c, ...]`` per node, ``[B, n, ...]``: each node's first draw's
        (a padding node's: draw 0's)."""
        if self.draws is None:
            return values
        draws = torch.arange(self.count, device=values.device).expand_as(self.draws)
        first = torch.zeros_like(self.nodes).scatter_reduce_(1, self.draws, draws, "amin", include_self=False)
        return rows_at(values, first)

    @property
    def real(self) -> torch.Tensor:
        """bool ``[B, n]``: live nodes."""
        return self.nodes >= 0


def rows_at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B, n, ...]`` at the rows ``index`` (int64 ``[B, k]``) of each batch row:
    ``[B, k, ...]``."""
    return values.gather(1, index.view(*index.shape, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:]))


def merge_repeats(keys: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Repeated draws as one node each: ``keys`` int64 ``[B, c, ...]`` (two live draws of a row
    with equal keys are the same sequence), ``live`` bool ``[B, c]`` (the dead draws of a row are
    one node). Returns each draw's node, int64 ``[B, c]`` (nodes numbered in the order of their
    first draws), each node's first draw, int64 ``[B, n]`` (``n``: the most nodes of a row), and
    ``padding``, bool ``[B, n]``: the nodes past a row's own count (their first draw is draw 0)."""
    equal = (keys[:, :, None] == keys[:, None, :]).view(*keys.shape[:2], keys.shape[1], -1).all(dim=3)
    same = (equal & live[:, :, None] & live[:, None, :]) | (~live[:, :, None] & ~live[:, None, :])
    batch, count = live.shape
    order = torch.arange(count, device=live.device)
    first = same.to(torch.uint8).argmax(dim=2)  # the first draw of the same sequence
    new = first == order
    rank = new.cumsum(dim=1) - 1
    nodes = int(new.sum(dim=1).max())
    sources = torch.zeros(batch, nodes + 1, dtype=torch.int64, device=live.device).scatter_(
        1, torch.where(new, rank, nodes), order.expand(batch, count))[:, :nodes]
    return rank.gather(1, first), sources, order[None, :nodes] > rank[:, -1:]


def child_level(parent: Level, parents: torch.Tensor, tokens: torch.Tensor, nodes: torch.Tensor,
                scores: torch.Tensor, depth: torch.Tensor, proposal: torch.Tensor | None = None,
                choice: torch.Tensor | None = None, merge: bool = False) -> Level:
    """The next level: draw ``i`` continues ``parent``'s draw ``parents[b, i]`` with ``tokens[b, i]``.

    ``depth``: int64 ``[B]``, each user's depth of the *new* level (its tokens go to column
    ``depth - 1`` of the paths). ``parents``, ``tokens``, ``nodes``, ``scores`` are ``[B, c]``;
    ``proposal`` and ``choice`` as in :class:`Level`; ``merge``: repeated draws (the same parent
    node and token) become one node (see the module doc), else each draw is a node.
    """
    node_parents = parent.node_of(parents)
    draws = drawn_from = None
    if merge:
        draws, sources, padding = merge_repeats(torch.stack((node_parents, tokens), dim=2), nodes >= 0)
        node_parents, tokens = node_parents.gather(1, sources), tokens.gather(1, sources)
        nodes = nodes.gather(1, sources).masked_fill(padding, -1)
        scores = scores.gather(1, sources).masked_fill(padding, -torch.inf)
        drawn_from = parents
    n = tokens.shape[1]
    paths = rows_at(parent.paths, node_parents).clone()
    column = (depth - 1).clamp(max=paths.shape[2] - 1)[:, None, None].expand(-1, n, 1)
    paths.scatter_(2, column, tokens[:, :, None])
    return Level(tokens=tokens, nodes=nodes, parents=node_parents, scores=scores,
                 visible=child_rows(parent.visible, node_parents),
                 positions=parent.positions.gather(1, node_parents) + 1, paths=paths, proposal=proposal,
                 choice=choice, draws=draws, drawn_from=drawn_from)


def stacked(levels: list[Level]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Consecutive levels as one block of nodes: tokens and positions ``[B, M]`` and visibility
    ``[B, M, W]`` (each level's rows padded on the right with False: a node never sees nodes
    that come after it)."""
    width = levels[-1].visible.shape[2]
    rows = [torch.nn.functional.pad(level.visible, (0, width - level.visible.shape[2])) for level in levels]
    return (torch.cat([level.tokens for level in levels], dim=1), torch.cat(rows, dim=1),
            torch.cat([level.positions for level in levels], dim=1))


def feed(model, cache, levels: list[Level]) -> torch.Tensor:
    """Feed consecutive levels in one call after everything fed before: float32 log-probs
    ``[B, sum n, V]``."""
    return next_log_probs(forward_visible(model, cache, *stacked(levels)))


def fed_block(levels: list[Level], prompts: Prompts | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      int | None]:
    """What a round feeds the target in one call: tokens and positions ``[B, F]``, visibility
    ``[B, F, T + F]`` and the number of last positions whose logits are needed (None: all). Later
    rounds feed ``levels`` (:func:`stacked`); the first (``prompts`` given) feeds the prompt, whose
    last position is level 0, the root, then levels 1.. (``keep_last = 1 + M``)."""
    if prompts is None:
        return (*stacked(levels), None)
    if len(levels) > 1:
        tree = stacked(levels[1:])
    else:  # nothing drafted: the prompt alone
        none = prompts.input_ids[:, :0]
        batch, width = prompts.input_ids.shape
        tree = none, torch.zeros(batch, 0, width, dtype=torch.bool, device=none.device), none
    return prompt_and_tree(prompts.input_ids, prompts.attention_mask, prompts.position_ids, *tree)
