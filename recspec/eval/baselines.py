"""Reference rankings a recommender must beat: the most-popular baseline.

``most popular``: every user gets the same list, the items ranked by how often they occur among
the interactions the model could have seen before the evaluated part (the training part for
validation, training and validation for test), ties broken by the smaller item index. A
generative recommender whose Recall@K does not beat it has not learnt anything about users.
"""

from __future__ import annotations

import numpy as np

from recspec.data.dataset import SPLIT_TEST, SPLIT_VALID, Dataset


def most_popular(dataset: Dataset, labels: np.ndarray, part: str, k: int) -> np.ndarray:
    """int64 ``[k]``: the ``k`` most frequent items among the interactions before ``part``
    (``"valid"`` or ``"test"``), most frequent first. ``labels``: int8 ``[num_interactions]``, the
    split's part of each interaction (0 train, 1 valid, 2 test)."""
    seen = labels < (SPLIT_VALID if part == "valid" else SPLIT_TEST)
    counts = np.bincount(dataset.interactions.items[seen], minlength=dataset.num_items)
    order = np.argsort(-counts, kind="stable")  # stable: ties keep the smaller item index first
    return order[:k].astype(np.int64)
