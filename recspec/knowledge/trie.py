"""A token trie with frequency counts: the retrieval pool of LASER / REST-style drafting.

Every text added to the trie contributes one *branch* per token position: the window of the next
``window`` tokens starting there (shorter at the end of the text). A node's count is the number
of branches through it, i.e. how often its token sequence occurs in the pool's texts (counted up
to ``window`` tokens long). Matching a context suffix ``s`` walks ``len(s)`` edges from the root;
the subtree below is every continuation of ``s`` seen in the pool (up to ``window - len(s)``
tokens deep), with the frequency of each.

*Permanent* branches come from earlier knowledge (a pool's texts, added once); *temporary*
branches come from the current request (its prompt and the text generated so far) and are
dropped when the request completes. They live in two tries that retrieval reads as one
(:mod:`recspec.knowledge.retrieval`): the permanent trie is shared by every request of a pool and
never modified during generation; each request owns a small temporary trie, extended after every
decoding step by :meth:`TokenTrie.extend` and discarded at the end.

Nodes are integers; ``children[node]`` maps a token id to a child node (``None`` for a leaf, to
save memory), ``counts[node]`` is the branch count. Plain Python dicts keep one edge lookup at
about 50 ns, which is what the per-step retrieval walk (a few dozen lookups) needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ROOT = 0


class TokenTrie:
    """Windows of ``window`` tokens of every added text, with counts."""

    def __init__(self, window: int) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2, got {window}")
        self.window = window
        self.children: list[dict[int, int] | None] = [None]
        self.counts: list[int] = [0]
        self.texts = 0
        self.tokens = 0

    def __len__(self) -> int:
        """Number of nodes, the root included."""
        return len(self.counts)

    def add(self, tokens: Sequence[int]) -> None:
        """Add one text: a branch for every start position."""
        self.extend(tokens, 0)
        self.texts += 1

    def add_all(self, texts: Iterable[Sequence[int]]) -> None:
        for tokens in texts:
            self.add(tokens)

    def extend(self, tokens: Sequence[int], known: int) -> None:
        """``tokens[:known]`` was added before (by :meth:`add` or earlier calls); add what the
        tokens from ``known`` on contribute: longer branches for the starts whose window now
        reaches further, and new branches for the new starts."""
        tokens = list(tokens)
        end = len(tokens)
        for start in range(max(0, known - self.window + 1), end):
            self._insert(tokens, start, min(start + self.window, end), max(known, start))
        self.tokens += end - known

    def _insert(self, tokens: list[int], start: int, stop: int, fresh: int) -> None:
        """Walk ``tokens[start:stop]`` from the root; count +1 on the nodes from ``fresh`` on
        (those before it are already counted for this branch)."""
        children, counts = self.children, self.counts
        node = ROOT
        for position in range(start, stop):
            kids = children[node]
            if kids is None:
                kids = children[node] = {}
            child = kids.get(tokens[position])
            if child is None:
                child = kids[tokens[position]] = len(counts)
                children.append(None)
                counts.append(0)
            if position >= fresh:
                counts[child] += 1
            node = child

    def walk(self, tokens: Sequence[int]) -> int | None:
        """The node reached by ``tokens`` from the root, or None if the sequence never occurs."""
        children = self.children
        node = ROOT
        for token in tokens:
            kids = children[node]
            if kids is None:
                return None
            node = kids.get(token)
            if node is None:
                return None
        return node
