"""Collaborative embeddings for the collaborative retrieval pools: matrix factorisation trained
with BPR in torch on the known interactions, then k-means on the user or item vectors.

BPR (Rendle et al.): for an observed (user, item) pair and an item drawn uniformly at random,
maximise ``log sigmoid(u . i_pos - u . i_neg)`` with L2 regularisation; Adam, mini-batches,
fixed seed. Any interactions count as positive feedback (ratings are not used), as for the
LightGCN embeddings laser.txt clusters.
"""

from __future__ import annotations

import numpy as np
import torch

from recspec.errors import RecspecError


def bpr_embeddings(users: np.ndarray, items: np.ndarray, num_users: int, num_items: int, dim: int = 32,
                   epochs: int = 30, batch_size: int = 1024, lr: float = 0.01, l2: float = 1e-4,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train MF-BPR on the pairs ``(users[j], items[j])`` (dense indices, int64 ``[n]``): float32
    user vectors ``[num_users, dim]`` and item vectors ``[num_items, dim]``."""
    if len(users) == 0:
        raise RecspecError("no interactions to train the collaborative-filtering model on")
    generator = torch.Generator().manual_seed(seed)
    user_vectors = torch.nn.Parameter(torch.randn(num_users, dim, generator=generator) * 0.1)
    item_vectors = torch.nn.Parameter(torch.randn(num_items, dim, generator=generator) * 0.1)
    optimizer = torch.optim.Adam([user_vectors, item_vectors], lr=lr)
    pairs_u, pairs_i = torch.from_numpy(users).long(), torch.from_numpy(items).long()
    for _ in range(epochs):
        order = torch.randperm(len(pairs_u), generator=generator)
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            u, pos = user_vectors[pairs_u[batch]], item_vectors[pairs_i[batch]]
            neg = item_vectors[torch.randint(num_items, (len(batch),), generator=generator)]
            margin = (u * pos).sum(1) - (u * neg).sum(1)
            loss = -torch.nn.functional.logsigmoid(margin).mean()
            loss = loss + l2 * (u.square().sum(1) + pos.square().sum(1) + neg.square().sum(1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return user_vectors.detach().numpy().copy(), item_vectors.detach().numpy().copy()


def kmeans_labels(vectors: np.ndarray, groups: int, seed: int = 0) -> np.ndarray:
    """int64 ``[n]``: the k-means cluster (``groups`` clusters, 3 restarts) of each row."""
    if not 1 <= groups <= len(vectors):
        raise RecspecError(f"cannot cluster {len(vectors)} vectors into {groups} groups")
    from sklearn.cluster import KMeans  # the 'train' extra
    return KMeans(groups, n_init=3, random_state=seed).fit_predict(vectors).astype(np.int64)
