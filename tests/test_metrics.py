"""Recall / NDCG against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recspec.eval.metrics import recall_ndcg


def test_single_target_by_hand() -> None:
    ranked = np.array([[5, 3, 9], [1, 2, 3]])
    m = recall_ndcg(ranked, [np.array([3]), np.array([7])], ks=[1, 3])
    assert m["recall@1"] == 0 and m["recall@3"] == pytest.approx(0.5)
    assert m["ndcg@3"] == pytest.approx((1 / math.log2(3)) / 2)


def test_several_targets_by_hand() -> None:
    ranked = np.array([[4, 8, 2, -1]])
    targets = [np.array([2, 4, 6, 4])]  # duplicates count once
    m = recall_ndcg(ranked, targets, ks=[2, 4])
    assert m["recall@2"] == pytest.approx(1 / 3) and m["recall@4"] == pytest.approx(2 / 3)
    ideal4 = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    assert m["ndcg@4"] == pytest.approx((1 + 1 / math.log2(4)) / ideal4)
    assert m["ndcg@2"] == pytest.approx(1 / (1 + 1 / math.log2(3)))


def test_perfect_and_k_too_large() -> None:
    m = recall_ndcg(np.array([[1, 2]]), [np.array([2, 1])], ks=[2])
    assert m == {"recall@2": 1.0, "ndcg@2": 1.0}
    with pytest.raises(ValueError, match="@3"):
        recall_ndcg(np.array([[1, 2]]), [np.array([1])], ks=[3])

