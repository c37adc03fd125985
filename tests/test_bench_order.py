"""Shared benchmark plumbing: the order in which benchmarks take turns, and their plots."""

from __future__ import annotations

from collections import Counter

import pytest

from recspec.bench.report import new_figure, save_figure, turn_order


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


def test_save_figure_writes_a_png_atomically(tmp_path) -> None:
    """A plot lands as a whole PNG under its name, with no temporary file left beside it."""
    figure, axis = new_figure(figsize=(3, 2))
    axis.plot([1, 2, 3], [3, 1, 2])
    save_figure(figure, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [path.name for path in tmp_path.iterdir()] == ["plot.png"]
