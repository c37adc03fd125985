"""The item prior of ``--draft items`` (recspec.decoding.item_prior): its transition counts, a
user's item weights, their marginals through the trie, and histories read back from prompts.
Exactness of speculative search with it on trained models: tests/exactness.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recspec.decoding.item_prior import (ItemDraft, TransitionPrior, child_log_probs, node_mass,
                                         prompt_histories)
from recspec.decoding.prompts import left_pad
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie


def following(prior: TransitionPrior) -> torch.Tensor:
    """The prior's transition table as a dense ``[next, previous]`` matrix."""
    size = len(prior.popular)
    previous = torch.repeat_interleave(torch.arange(size), prior.starts[1:] - prior.starts[:-1])
    return torch.zeros(size, size).index_put_((prior.successors, previous), prior.chances)


def test_fit_counts_direct_successions() -> None:
    """P(j | i) from direct successions only; popularity from every occurrence."""
    prior = TransitionPrior.fit([np.array([0, 1, 2]), np.array([0, 1]), np.array([1, 0])], num_items=4)
    matrix = following(prior)
    expected = torch.zeros(4, 4)
    expected[1, 0] = 1.0  # 0 -> 1 twice, nothing else after 0
    expected[2, 1], expected[0, 1] = 0.5, 0.5  # after 1: 2 once, 0 once
    torch.testing.assert_close(matrix, expected)
    torch.testing.assert_close(prior.popular, torch.tensor([3, 3, 1, 0]) / 7.0)


def test_scores_weigh_the_latest_items_most_and_fall_back_to_popularity() -> None:
    prior = TransitionPrior.fit([np.array([0, 1, 2]), np.array([0, 1]), np.array([1, 0]), np.array([3])],
                                num_items=4, decay=0.5, smoothing=0.1)
    matrix, popular = following(prior), prior.popular
    scores = prior.scores(torch.tensor([[-1, 0, 1], [-1, -1, 3], [-1, -1, -1]]))
    # user 0: 0.5 * P(. | 0) + 1 * P(. | 1), normalised, then 10% popularity
    mixed = 0.5 * matrix[:, 0] + matrix[:, 1]
    torch.testing.assert_close(scores[0], 0.9 * mixed / mixed.sum() + 0.1 * popular)
    # nothing ever followed item 3, and no history: popularity alone
    torch.testing.assert_close(scores[1], popular)
    torch.testing.assert_close(scores[2], popular)
    torch.testing.assert_close(scores.sum(dim=1), torch.ones(3))


@pytest.fixture
def codes() -> torch.Tensor:
    """60 distinct 3-token identifiers over tokens 10..19 (level 1), 20..25, 30..33: row i is item i's."""
    generator = torch.Generator().manual_seed(0)
    drawn: set[tuple[int, ...]] = set()
    while len(drawn) < 60:
        drawn.add(tuple(first + int(torch.randint(size, (1,), generator=generator))
                        for first, size in ((10, 10), (20, 6), (30, 4))))
    return torch.tensor(sorted(drawn))


@pytest.fixture
def trie(codes: torch.Tensor) -> ItemTrie:
    return ItemTrie(codes, vocab_size=40)


def test_node_mass_and_child_log_probs_are_the_item_weights_marginals(trie: ItemTrie) -> None:
    """A node weighs the items under its prefix (checked against a walk of every item's prefixes);
    a child's q is its share of its node's weight, over the trie's children only."""
    scores = torch.rand(3, trie.num_items, generator=torch.Generator().manual_seed(1))
    mass = node_mass(trie, scores)
    leaves = torch.arange(trie.num_nodes)[trie.items(torch.arange(trie.num_nodes)) >= 0]
    items = trie.items(leaves)
    for depth in range(trie.depth + 1):  # brute force: every item adds its weight to its prefix of each depth
        expected = torch.zeros(3, trie.num_nodes)
        nodes = leaves.clone()
        for _ in range(trie.depth - depth):
            nodes = trie.parent(nodes)
        expected.index_add_(1, nodes, scores[:, items])
        at = torch.arange(trie.num_nodes)[trie.node_depth(torch.arange(trie.num_nodes)) == depth]
        torch.testing.assert_close(mass[:, at], expected[:, at])
    torch.testing.assert_close(mass[:, trie.root], scores.sum(dim=1))
    level_one = trie.step(torch.zeros(3, dtype=torch.int64), torch.tensor([10, 11, 12]))
    assert (level_one > 0).all()
    nodes = torch.tensor([[trie.root, int(level_one[0]), int(level_one[1])], [trie.root, -1, int(level_one[2])]])
    rows = torch.tensor([2, 0])  # the users of the two node rows, of the three that mass holds
    log_q = child_log_probs(trie, mass, nodes, rows)  # [2, 3, V]
    for b in range(2):
        for i in range(3):
            node = nodes[b, i]
            tokens, real = trie.children(node[None])
            tokens = tokens[0, real[0]]
            if node < 0:
                assert tokens.numel() == 0
                continue
            children = trie.step(node.repeat(len(tokens)), tokens)
            torch.testing.assert_close(log_q[b, i, tokens].exp(), mass[rows[b], children] / mass[rows[b], node])
            others = torch.ones(trie.vocab_size, dtype=torch.bool)
            others[tokens] = False
            assert (log_q[b, i, others] == torch.finfo(torch.float32).min).all()


def test_histories_are_read_back_from_prompts(codes: torch.Tensor, trie: ItemTrie) -> None:
    """Prompts of other tokens around whole identifiers (the template's, here 1..5) give back
    each row's items, oldest first, right-aligned; a partial identifier is refused."""
    identifier = codes.tolist()
    histories = [[3, 17, 42], [5], [8, 0, 59, 12, 33]]
    prompts = [torch.tensor([1, 2] + sum((identifier[i] + [4] for i in h), []) + [5]) for h in histories]
    read = prompt_histories(left_pad(prompts, 0, torch.device("cpu")), trie)
    assert read.shape == (3, 5)
    assert read.tolist() == [[-1, -1, 3, 17, 42], [-1, -1, -1, -1, 5], [8, 0, 59, 12, 33]]
    broken = [torch.tensor([1] + identifier[3] + identifier[4][:2] + [5])]
    with pytest.raises(RecspecError, match="not whole"):
        prompt_histories(left_pad(broken, 0, torch.device("cpu")), trie)


def test_bad_settings_and_another_trie_are_refused(trie: ItemTrie) -> None:
    with pytest.raises(RecspecError, match="decay and smoothing"):
        TransitionPrior.fit([np.array([0, 1])], num_items=2, decay=0.0)
    with pytest.raises(RecspecError, match="training part is empty"):
        TransitionPrior.fit([], num_items=2)
    with pytest.raises(RecspecError, match="must lie in"):
        TransitionPrior.fit([np.array([0, 5])], num_items=2)
    draft = ItemDraft(TransitionPrior.fit([np.arange(60)], num_items=60), trie)
    assert draft.for_trie(trie) is draft
    other = ItemTrie(torch.tensor([[10, 20, 30], [11, 21, 31]]), vocab_size=40)
    assert (trie.prefix_nodes(other) < 0).any()  # not a sub-trie (tests/test_prior_subtrie.py: one that is)
    with pytest.raises(RecspecError, match="another item index"):
        draft.for_trie(other)
    with pytest.raises(RecspecError, match="another item index"):  # a prior over fewer items than the trie
        ItemDraft(TransitionPrior.fit([np.arange(50)], num_items=50), trie).for_trie(trie)
