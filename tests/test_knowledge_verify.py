"""Greedy and relaxed (laser.txt Eq. 8) verification on hand-built distributions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recspec.decoding.tree import ancestor_matrix
from recspec.errors import RecspecError
from recspec.decoding.acceptance import accepted_path, greedy_accept, relaxed_accept
from recspec.knowledge.verify import Verification


def logits_of(rows: list[list[float]]) -> torch.Tensor:
    """[1, N, V] logits whose softmax is exactly the given probability rows."""
    return torch.tensor(rows, dtype=torch.float64).log()[None]


# node 0 is the root; nodes 1, 2 are children of the root; node 3 a child of node 1
PARENTS = torch.tensor([[-1, 0, 0, 1]])
PROBS = [[0.5, 0.3, 0.15, 0.05],   # after the root
         [0.05, 0.15, 0.3, 0.5],   # after node 1
         [0.25, 0.25, 0.25, 0.25],
         [0.25, 0.25, 0.25, 0.25]]


def test_greedy_accepts_only_the_argmax_of_the_parent() -> None:
    tokens = torch.tensor([[9, 0, 1, 3]])
    assert greedy_accept(tokens, PARENTS, logits_of(PROBS)).tolist() == [[True, True, False, True]]


@pytest.mark.parametrize(("k", "p", "expected"), [
    (2, 0.1, [True, True, True, False]),   # node 3 (q = 0.15) ranks 3rd after node 1
    (1, 0.1, [True, True, False, False]),  # node 2 (q = 0.3) ranks 2nd after the root
    (3, 0.1, [True, True, True, True]),
    (3, 0.2, [True, True, True, False]),   # 0.15 is not above p
    (2, 0.3, [True, True, False, False]),  # q = 0.3 is not above p = 0.3 (strict)
    (2, 0.6, [True, True, False, False]),  # node 1 (q = 0.5 <= p) passes as the greedy token
])
def test_relaxed_is_eq8(k: int, p: float, expected: list[bool]) -> None:
    tokens = torch.tensor([[9, 0, 1, 1]])  # q: node 1 0.5 (rank 1), node 2 0.3 (rank 2), node 3 0.15 (rank 3)
    assert relaxed_accept(tokens, PARENTS, logits_of(PROBS), k, p)[0].tolist() == expected


def test_relaxed_counts_ties_at_the_kth_probability_as_top_k() -> None:
    tokens = torch.tensor([[0, 3, 1]])
    parents = torch.tensor([[-1, 0, 0]])
    probs = [[0.1, 0.3, 0.3, 0.3], [0.25] * 4, [0.25] * 4]
    assert relaxed_accept(tokens, parents, logits_of(probs), 2, 0.1).tolist() == [[True, True, True]]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.floats(0.0, 0.9), st.integers(0, 2**31 - 1))
def test_relaxed_matches_a_per_node_reading_of_eq8(k: int, p: float, seed: int) -> None:
    """Against a per-node loop: accept iff the token is the argmax, or fewer than k tokens are
    strictly more probable and q(token) > p."""
    generator = torch.Generator().manual_seed(seed)
    n, vocab = 7, 6
    logits = torch.randn(1, n, vocab, generator=generator) * 2
    logits[0, 1, 2] = logits[0, 1, 3]  # an exact tie
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2]])
    tokens = torch.randint(vocab, (1, n), generator=generator)
    probs = torch.softmax(logits.float(), dim=-1)[0]
    expected = [True]
    for node in range(1, n):
        q = probs[parents[0, node]]
        token_prob = q[tokens[0, node]]
        greedy = int(q.argmax()) == int(tokens[0, node])
        expected.append(greedy or bool((q > token_prob).sum() < k and token_prob > p))
    assert relaxed_accept(tokens, parents, logits, k, p)[0].tolist() == expected


def test_accepted_path_is_the_deepest_fully_accepted_branch() -> None:
    parents = torch.tensor([[-1, 0, 1, 0, 3, 4]])  # two branches: 0-1-2 and 0-3-4-5
    ancestors = ancestor_matrix(parents)
    accept = torch.tensor([[True, True, True, True, True, False]])
    last, path = accepted_path(accept, ancestors)
    assert last.tolist() == [2] and path[0].nonzero()[:, 0].tolist() == [0, 1, 2]  # 0-3-4 is as deep: first wins
    accept = torch.tensor([[True, False, True, True, True, True]])  # node 2 accepted but its parent is not
    last, path = accepted_path(accept, ancestors)
    assert last.tolist() == [5] and path[0].nonzero()[:, 0].tolist() == [0, 3, 4, 5]
    last, path = accepted_path(torch.tensor([[True, False, False, False, False, False]]), ancestors)
    assert last.tolist() == [0] and path.sum().item() == 1


@pytest.mark.parametrize(("k", "p"), [(0, 0.1), (-1, 0.1), (2, -0.01), (2, 1.0), (2, 1.5), (True, 0.1)])
def test_bad_k_or_p_is_refused(k, p) -> None:
    with pytest.raises(RecspecError, match="relaxed verification needs"):
        Verification("relaxed", k, p)
    with pytest.raises(RecspecError, match="unknown verification"):
        Verification("sampling")
