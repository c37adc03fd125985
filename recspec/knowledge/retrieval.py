"""Retrieval drafting: a draft token tree from the pool tries for the current text.

:func:`retrieve` matches the longest suffix of the current text (prompt + generated tokens, at
most ``max_suffix`` tokens) in the permanent and temporary tries, reading them as one trie whose
counts are the sums of both. Below the matched node it takes the most frequent continuations
best-first: a node enters the draft only after its parent, and always the most frequent frontier
node next, so the draft is the ``max_nodes`` most frequent continuations (at most ``max_depth``
tokens deep) forming a tree. While the draft has fewer than ``max_nodes`` nodes, it backs off to
the next shorter suffix and adds that suffix's continuations (merging equal paths), down to one
token (laser.txt section 3.3, following Lookahead: long suffixes first for relevance, shorter ones
to fill the tree).

The result is a :class:`~recspec.decoding.text_rounds.DraftTree` in best-first order (parents
before children), which the decoder turns into a tree-attention forward pass with
:mod:`recspec.decoding.tree`. Each node carries its *chance*: the share of its suffix's occurrences
in the tries that continue with the node's path (the pool's n-gram estimate of the path's
probability), by which a batch's trees are sized against the target's cost
(:class:`~recspec.decoding.text_rounds.Sessions`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from recspec.decoding.text_rounds import DraftTree
from recspec.knowledge.trie import TokenTrie

MAX_NODES = 64
MAX_DEPTH = 12


@dataclass(frozen=True)
class RetrievalConfig:
    """Draft tree limits: ``max_nodes`` (at most 64) nodes, ``max_depth`` (at most 12) tokens
    deep, suffixes of at most ``max_suffix`` tokens. The defaults are the best measured on a CPU,
    where every draft node costs a share of a target call, so small, well-ranked trees win.
    ``sized``: greedy rounds verify, of each row's ``max_nodes``, as many as the target's cost
    model says pay for the batch (:class:`~recspec.decoding.text_rounds.Sessions`); relaxed
    verification, whose text depends on the tree, always drafts ``max_nodes``."""

    max_nodes: int = 16
    max_depth: int = MAX_DEPTH
    max_suffix: int = 4
    sized: bool = True

    def shape(self) -> dict[str, int]:
        """The limits that shape a tree (a relaxed text depends on them)."""
        return {"max_nodes": self.max_nodes, "max_depth": self.max_depth, "max_suffix": self.max_suffix}

    @property
    def window(self) -> int:
        """Branch length the tries must store: a suffix plus a full-depth continuation."""
        return self.max_suffix + self.max_depth


def retrieve(tries: Sequence[TokenTrie], context: Sequence[int], config: RetrievalConfig,
             max_depth: int | None = None) -> DraftTree:
    """The draft tree for ``context`` (the whole current text, prompt included) from ``tries``
    read as one (counts summed); ``max_depth`` lowers the depth limit (e.g. near the token
    budget)."""
    depth_limit = min(config.max_depth, max_depth if max_depth is not None else config.max_depth)
    tokens: list[int] = []
    parents: list[int] = []
    chances: list[float] = []
    index: dict[tuple[int, int], int] = {}
    if depth_limit < 1:
        return DraftTree(tokens, parents, chances)
    for length in range(min(config.max_suffix, len(context)), 0, -1):
        suffix = context[len(context) - length:]
        starts = [trie.walk(suffix) for trie in tries]
        if any(node is not None for node in starts):
            _best_first(tries, starts, depth_limit, config.max_nodes, tokens, parents, chances, index)
            if len(tokens) >= config.max_nodes:
                break
    return DraftTree(tokens, parents, chances)


def _best_first(tries: Sequence[TokenTrie], starts: list[int | None], depth_limit: int, max_nodes: int,
                tokens: list[int], parents: list[int], chances: list[float], index: dict[tuple[int, int], int]
                ) -> None:
    """Add the most frequent continuations below ``starts`` (one node per trie, None where the
    suffix is absent) to the draft (``tokens``, ``parents``, ``chances``: a new node's count over
    the suffix's; ``index``: (parent, token) -> draft node), until it holds ``max_nodes`` nodes or
    the subtree is exhausted."""
    occurrences = sum(trie.counts[node] for trie, node in zip(tries, starts) if node is not None)
    heap: list[tuple[int, int, int, int, int, list[int | None]]] = []
    order = 0

    def push_children(draft_parent: int, depth: int, nodes: list[int | None]) -> None:
        nonlocal order
        merged: dict[int, list[int | None]] = {}
        for which, (trie, node) in enumerate(zip(tries, nodes)):
            kids = trie.children[node] if node is not None else None
            if kids:
                for token, child in kids.items():
                    slot = merged.get(token)
                    if slot is None:
                        slot = merged[token] = [None] * len(tries)
                    slot[which] = child
        for token, children in merged.items():
            count = sum(trie.counts[c] for trie, c in zip(tries, children) if c is not None)
            heapq.heappush(heap, (-count, order, draft_parent, token, depth, children))
            order += 1

    push_children(-1, 1, starts)
    while heap and len(tokens) < max_nodes:
        negated_count, _, draft_parent, token, depth, children = heapq.heappop(heap)
        node = index.get((draft_parent, token))
        if node is None:
            node = index[(draft_parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(draft_parent)
            chances.append(-negated_count / occurrences)
        if depth < depth_limit:
            push_children(node, depth + 1, children)
