"""Recall@K and NDCG@K with any number of ground-truth items per user (full ranking by generation).

A user's targets are de-duplicated. Recall@K = hits in the top K / number of targets.
NDCG@K = sum over hits at rank r (1-based) of 1 / log2(r + 1), divided by the ideal DCG of
min(K, number of targets) hits at the top. Both are averaged over users.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pad_targets(targets: Sequence[np.ndarray]) -> np.ndarray:
    """int64 [n, max targets]: each user's unique targets, right-padded with -2 (never an item)."""
    unique = [np.unique(t) for t in targets]
    out = np.full((len(unique), max((len(t) for t in unique), default=1)), -2, dtype=np.int64)
    for row, t in enumerate(unique):  # once per user at evaluation time, not in decoding
        out[row, :len(t)] = t
    return out


def hit_matrix(ranked: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """bool [n, K]: whether the item at each rank is a target. ranked: int [n, K] (-1 = no item); targets: padded [n, T]."""
    return (ranked[:, :, None] == targets[:, None, :]).any(-1) & (ranked >= 0)


def recall_ndcg(ranked: np.ndarray, targets: Sequence[np.ndarray], ks: Sequence[int]) -> dict[str, float]:
    """Mean Recall@k and NDCG@k for each k in ``ks``; ranked: int [n, K_max], best first."""
    padded = pad_targets(targets)
    counts = (padded >= 0).sum(1)
    hits = hit_matrix(ranked, padded)
    discounts = 1.0 / np.log2(np.arange(2, ranked.shape[1] + 2))
    out = {}
    for k in ks:
        if k > ranked.shape[1]:
            raise ValueError(f"cannot compute @{k} from lists of {ranked.shape[1]} items")
        dcg = (hits[:, :k] * discounts[:k]).sum(1)
        ideal = np.cumsum(discounts[:k])[np.minimum(counts, k) - 1]
        out[f"recall@{k}"] = float((hits[:, :k].sum(1) / counts).mean())
        out[f"ndcg@{k}"] = float((dcg / ideal).mean())
    return out
