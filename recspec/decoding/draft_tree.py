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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recspec.decoding.beams import Beams
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import forward_visible, next_log_probs, prompt_and_tree
from recspec.decoding.tree import child_rows, gather_rows


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
    over the previous level's candidates (:class:`~recspec.decoding.beams.Candidates` layout),
    and ``choice``, int64 ``[B, n]``, each node's index in it.
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

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def real(self) -> torch.Tensor:
        """bool ``[B, n]``: live nodes."""
        return self.nodes >= 0


def child_level(parent: Level, chosen: Beams, depth: torch.Tensor, proposal: torch.Tensor | None = None,
                choice: torch.Tensor | None = None) -> Level:
    """The next level of the ``n`` beams ``chosen``: node ``i`` continues ``parent`` node
    ``chosen.parents[b, i]`` with the last of ``chosen.tokens[b, i]``.

    ``depth``: int64 ``[B]``, each user's depth of the *new* level (its tokens go to column
    ``depth - 1`` of the paths); ``proposal`` and ``choice`` as in :class:`Level`.
    """
    parents, tokens = chosen.parents, chosen.tokens[:, :, -1]  # [B, n]
    n = tokens.shape[1]
    paths = gather_rows(parent.paths, parents)
    column = (depth - 1).clamp(max=paths.shape[2] - 1)[:, None, None].expand(-1, n, 1)
    paths.scatter_(2, column, tokens[:, :, None])
    return Level(tokens=tokens, nodes=chosen.nodes, parents=parents, scores=chosen.scores,
                 visible=child_rows(parent.visible, parents), positions=parent.positions.gather(1, parents) + 1,
                 paths=paths, proposal=proposal, choice=choice)


def stacked(levels: list[Level]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Consecutive levels as one block of nodes: tokens and positions ``[B, M]`` and visibility
    ``[B, M, W]`` (each level's rows padded on the right with False: a node never sees nodes
    that come after it)."""
    if len(levels) == 1:
        return levels[0].tokens, levels[0].visible, levels[0].positions
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
