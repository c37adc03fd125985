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



def test_most_popular_counts_only_what_precedes_the_part() -> None:
    """Validation ranks by training interactions, test by training + validation; ties go to the
    smaller item index."""
    from recspec.data import Dataset, Interactions
    from recspec.eval.baselines import most_popular

    items = np.array([3, 3, 1, 1, 2, 0, 2, 2, 4, 4, 4])
    labels = np.array([0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2], dtype=np.int8)
    inter = Interactions(users=np.zeros(len(items), dtype=np.int64), items=items, timestamps=np.arange(len(items)))
    data = Dataset("toy", "test", inter, ["u"], [str(i) for i in range(5)])
    assert most_popular(data, labels, "valid", 4).tolist() == [1, 3, 0, 2]  # 1 and 3 tie at 2: 1 first
    assert most_popular(data, labels, "test", 3).tolist() == [2, 1, 3]  # item 4 is only in the test part
