"""The order in which benchmarks take turns between the things they compare."""

from __future__ import annotations

from collections import Counter

import pytest

from recspec.bench.report import turn_order


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_turn_order_is_balanced(n: int) -> None:
    """Over a full cycle (n rounds, 2n for odd n) every name runs once per round, first equally
    often, and right after every other name equally often: no name always follows the same one."""
    names = [f"d{i}" for i in range(n)]
    rounds = [turn_order(names, r) for r in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(order) == names for order in rounds)
    follows = Counter((order[i], order[i + 1]) for order in rounds for i in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    firsts = Counter(order[0] for order in rounds)
    assert len(firsts) == n and len(set(firsts.values())) == 1
