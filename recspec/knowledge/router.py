"""Which retrieval pool each user or item drafts from (laser.txt section 3.2).

Grouping schemes, each giving every user (or item) a *pool key* such as ``collaborative:3``:

* ``global``: one pool of all earlier knowledge (ReSD, the GRP ablation);
* ``collaborative``: k-means (``groups`` clusters) on MF-BPR embeddings trained on the old-part
  interactions (:mod:`recspec.knowledge.cf`);
* ``attribute``: users by age band (under 18, 18-24, 25-34, 35-44, 45-55, 56 and over); items by
  genre: the five most common genres of the data set keep their own group and every other genre
  falls into ``other``; an item joins the least common of its kept genres (the most specific),
  or ``other``;
* ``random``: a seeded random partition with the collaborative groups' sizes (the RRP ablation);
* ``router`` (LASER's binary router, the CRP): the collaborative pool for users / items with at
  least ``min_interactions`` old-part interactions, the attribute pool for the others.

A pool is filled with the earlier knowledge of every user or item whose group under the pool's
scheme is the pool's key, whatever that user or item is routed to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from recspec.data.dataset import Dataset
from recspec.errors import RecspecError
from recspec.knowledge.cf import bpr_embeddings, kmeans_labels
from recspec.knowledge.stream import StreamSplit

GROUPINGS = ("global", "collaborative", "attribute", "random", "router")
AGE_BANDS = ((18, "under 18"), (25, "18-24"), (35, "25-34"), (45, "35-44"), (56, "45-55"), (200, "56 and over"))
KEPT_GENRES = 5


@dataclass(frozen=True)
class PoolRouting:
    """``routes``: the pool key each entity (dense user or item index) drafts from;
    ``labels``: per scheme, each entity's group key under it (which pools its knowledge fills)."""

    routes: np.ndarray
    labels: dict[str, np.ndarray]

    def members(self, key: str) -> np.ndarray:
        """Entities whose earlier knowledge fills pool ``key``."""
        return np.flatnonzero(self.labels[key.split(":")[0]] == key)


def age_band(age: int) -> str:
    if age < 0:
        return "unknown age"
    return next(name for upper, name in AGE_BANDS if age < upper)


def attribute_labels(dataset: Dataset, side: str) -> np.ndarray:
    """``attribute:<group>`` per user (age band) or item (genre rule of the module docstring)."""
    if side == "user":
        ages = dataset.user_info.ages if dataset.user_info is not None else None
        if ages is None:
            raise RecspecError(f"dataset {dataset.name} has no user ages; attribute pools need them")
        return np.array([f"attribute:{age_band(a)}" for a in ages])
    genres = dataset.item_info.genres if dataset.item_info is not None else None
    if genres is None:
        raise RecspecError(f"dataset {dataset.name} has no item genres; attribute pools need them")
    frequency = Counter(g for item in genres for g in item)
    kept = [g for g, _ in frequency.most_common(KEPT_GENRES)]
    rarest_first = sorted(kept, key=lambda g: frequency[g])
    return np.array([f"attribute:{next((g for g in rarest_first if g in item), 'other')}" for item in genres])


def route_pools(dataset: Dataset, split: StreamSplit, side: str, grouping: str, groups: int = 5,
                min_interactions: int = 10, seed: int = 0) -> PoolRouting:
    """The routing of every user or item under ``grouping`` (see the module docstring)."""
    if grouping not in GROUPINGS:
        raise RecspecError(f"unknown grouping {grouping!r}; choose one of {', '.join(GROUPINGS)}")
    count = dataset.num_users if side == "user" else dataset.num_items
    labels = {"global": np.full(count, "global", dtype=object).astype(str)}
    if grouping in ("attribute", "router"):
        labels["attribute"] = attribute_labels(dataset, side)
    if grouping in ("collaborative", "random", "router"):
        known = split.old_interactions()
        inter = dataset.interactions
        vectors = bpr_embeddings(inter.users[known], inter.items[known], dataset.num_users, dataset.num_items,
                                 seed=seed)[0 if side == "user" else 1]
        clusters = kmeans_labels(vectors, groups, seed)
        labels["collaborative"] = np.array([f"collaborative:{c}" for c in clusters])
        shuffled = np.random.default_rng(seed).permutation(clusters)
        labels["random"] = np.array([f"random:{c}" for c in shuffled])
    if grouping != "router":
        return PoolRouting(routes=labels[grouping], labels=labels)
    column = dataset.interactions.users if side == "user" else dataset.interactions.items
    counts = np.bincount(column[known], minlength=count)
    routes = np.where(counts >= min_interactions, labels["collaborative"], labels["attribute"])
    return PoolRouting(routes=routes, labels=labels)
