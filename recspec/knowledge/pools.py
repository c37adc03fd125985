"""Retrieval pools: one permanent token trie per pool key, filled with earlier knowledge.

A :class:`PoolSet` builds the trie of a pool the first time a request routed to it needs it
(so a job over a few users builds only their pools) from the earlier knowledge of the pool's
members (:meth:`~recspec.knowledge.router.PoolRouting.members`), and records how long building
took (laser.txt Table 6, "Trie construction"). :meth:`PoolSet.add` adds a new text to the pools
it belongs to, for jobs whose own output is their pool (the old-part knowledge, built with ReSD
over the knowledge generated so far).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from recspec.knowledge.router import PoolRouting
from recspec.knowledge.trie import TokenTrie


class PoolSet:
    """Lazily built permanent tries of every pool of ``routing``."""

    def __init__(self, routing: PoolRouting, texts: Mapping[int, Sequence[int]], window: int) -> None:
        """``texts``: entity (dense index) -> earlier knowledge token ids; ``window``: branch
        length (:attr:`~recspec.knowledge.retrieval.RetrievalConfig.window`)."""
        self.routing, self.window = routing, window
        self.texts = dict(texts)
        self.tries: dict[str, TokenTrie] = {}
        self.build_s = 0.0

    def trie_for(self, entity: int) -> TokenTrie:
        """The permanent trie of the pool ``entity`` drafts from."""
        key = str(self.routing.routes[entity])
        if key not in self.tries:
            started = time.perf_counter()
            trie = TokenTrie(self.window)
            trie.add_all(self.texts[int(m)] for m in self.routing.members(key) if int(m) in self.texts)
            self.tries[key] = trie
            self.build_s += time.perf_counter() - started
        return self.tries[key]

    def add(self, entity: int, tokens: Sequence[int]) -> None:
        """Make ``tokens`` part of ``entity``'s earlier knowledge (and of the pools built so far)."""
        self.texts[entity] = tokens
        for key, trie in self.tries.items():
            if self.routing.labels[key.split(":")[0]][entity] == key:
                trie.add(tokens)

    def sizes(self) -> dict[str, dict[str, int]]:
        """Per built pool: texts, tokens and trie nodes."""
        return {key: {"texts": trie.texts, "tokens": trie.tokens, "nodes": len(trie)}
                for key, trie in sorted(self.tries.items())}
