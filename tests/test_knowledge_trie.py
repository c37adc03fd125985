"""Token trie with frequency counts and retrieval drafting (pure Python; no model needed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from recspec.decoding.text_rounds import DraftTree
from recspec.knowledge.retrieval import RetrievalConfig, retrieve
from recspec.knowledge.trie import ROOT, TokenTrie


def paths(trie: TokenTrie) -> dict[tuple[int, ...], int]:
    """Every root path of ``trie`` with its count."""
    found, stack = {}, [(ROOT, ())]
    while stack:
        node, path = stack.pop()
        for token, child in (trie.children[node] or {}).items():
            found[path + (token,)] = trie.counts[child]
            stack.append((child, path + (token,)))
    return found


def test_counts_are_windowed_occurrences() -> None:
    trie = TokenTrie(window=3)
    trie.add([1, 2, 3, 1, 2, 4])
    assert trie.counts[trie.walk([1, 2])] == 2
    assert trie.counts[trie.walk([1, 2, 3])] == 1 and trie.counts[trie.walk([1, 2, 4])] == 1
    assert trie.walk([2, 3, 1, 2]) is None  # longer than the window: not stored
    assert trie.walk([4, 1]) is None and trie.walk([9]) is None
    assert trie.texts == 1 and trie.tokens == 6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.data(), st.integers(2, 6))
def test_extend_step_by_step_equals_adding_at_once(tokens: list[int], data, window: int) -> None:
    """Temporary branches grow after every decoding step; the result must equal one add."""
    cuts = sorted(data.draw(st.lists(st.integers(1, len(tokens)), max_size=5)))
    grown = TokenTrie(window)
    known = 0
    for cut in cuts + [len(tokens)]:
        grown.extend(tokens[:cut], known)
        known = cut
    whole = TokenTrie(window)
    whole.add(tokens)
    assert paths(grown) == paths(whole)


def test_retrieval_is_best_first_by_frequency_within_limits() -> None:
    trie = TokenTrie(window=8)
    for text in ([5, 6, 7, 8, 9], [5, 6, 7, 8, 1], [5, 6, 7, 2], [5, 6, 3]):
        trie.add(text)
    draft = retrieve([trie], [0, 5, 6], RetrievalConfig(max_nodes=3, max_depth=12, max_suffix=2))
    # after "5 6": 7 (3 times), then 7-8 (2), then ties of count 1 -> 3 nodes: 7, 8 (under 7), and one count-1 node
    assert draft.tokens[:2] == [7, 8] and draft.parents[:2] == [-1, 0]
    assert len(draft) == 3
    assert draft.chances == [3 / 4, 2 / 4, 1 / 4]  # of the 4 occurrences of "5 6": 7, 7-8, a count-1 path
    assert draft.first(2) == DraftTree([7, 8], [-1, 0], [3 / 4, 2 / 4])
    assert all(p < i for i, p in enumerate(draft.parents))
    deep = retrieve([trie], [5, 6], RetrievalConfig(max_nodes=64, max_depth=2, max_suffix=2))
    assert deep.longest_branch() == 2
    assert sorted(zip(deep.parents, deep.tokens)) == sorted([(-1, 7), (-1, 3), (0, 8), (0, 2)])


def test_retrieval_backs_off_to_shorter_suffixes_and_merges_tries() -> None:
    pool, temporary = TokenTrie(window=6), TokenTrie(window=6)
    pool.add([1, 2, 3, 4])
    temporary.add([9, 2, 3, 5])
    temporary.add([2, 3, 5])
    config = RetrievalConfig(max_nodes=8, max_depth=3, max_suffix=3)
    # "7 2 3" never occurs; "2 3" does in both tries: 5 (count 2) ranks before 4 (count 1)
    draft = retrieve([pool, temporary], [7, 2, 3], config)
    assert draft.tokens[0] == 5 and 4 in draft.tokens
    assert draft.chances[0] == 2 / 3 and draft.chances[draft.tokens.index(4)] == 1 / 3  # "2 3": 3 occurrences
    assert retrieve([pool], [42], config).tokens == []
    assert retrieve([pool], [1, 2], config, max_depth=0).tokens == []
