"""Finding and resolving identifier collisions (two items with the same token sequence).

Two resolutions:
- ``reassign`` (default): within each colliding group one item keeps the identifier and the
  others move to free codes of the last level under the same prefix, chosen by minimum total
  distance between their last-level residual and the free codewords (Hungarian assignment) when
  distances are known, else the lowest free codes. The length L stays the same, so every item
  still costs exactly L decoding steps, and only the last token of the moved items changes.
- ``append``: an extra level whose token is the item's rank within its group (TIGER). Always
  succeeds, but adds one decoding step for every item.
"""

from __future__ import annotations

import numpy as np

from recspec.errors import RecspecError

RESOLUTIONS = ("reassign", "append")


def collision_groups(codes: np.ndarray) -> list[np.ndarray]:
    """Groups (int64 arrays of item rows, ascending) of items sharing an identifier; codes: int [n, L]."""
    _, inverse, counts = np.unique(codes, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(counts)[:-1]
    return [g for g in np.split(order, bounds) if len(g) > 1]


def collision_rate(codes: np.ndarray) -> float:
    """Fraction of items whose identifier is shared with at least one other item."""
    return sum(len(g) for g in collision_groups(codes)) / len(codes)


def resolve_reassign(codes: np.ndarray, codebook_size: int,
                     costs: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
    """Move all but one item of each colliding group to a free last-level code of the same prefix.

    codes: int [n, L]; costs: float [n, codebook_size] distance of each item to each last-level
    code, or None. Returns the new codes and the rows of the items that moved.
    """
    from scipy.optimize import linear_sum_assignment  # the 'train' extra

    codes = codes.copy()
    prefixes = {tuple(row) for row in codes[:, :-1]}
    used: dict[tuple, set[int]] = {p: set() for p in prefixes}
    for row in codes:
        used[tuple(row[:-1])].add(int(row[-1]))
    moved: list[int] = []
    for group in collision_groups(codes):
        prefix = tuple(codes[group[0], :-1])
        if costs is not None:
            keeper = group[np.argmin(costs[group, codes[group[0], -1]])]
        else:
            keeper = group[0]
        movers = group[group != keeper]
        free = np.array(sorted(set(range(codebook_size)) - used[prefix]), dtype=np.int64)
        if len(free) < len(movers):
            raise RecspecError(
                f"cannot resolve collisions by re-assignment: prefix {list(prefix)} needs {len(movers)} free "
                f"last-level codes but has {len(free)}; use a larger last codebook or --collisions append")
        if costs is not None:
            rows, cols = linear_sum_assignment(costs[np.ix_(movers, free)])
            chosen = np.empty(len(movers), dtype=np.int64)
            chosen[rows] = free[cols]
        else:
            chosen = free[:len(movers)]
        codes[movers, -1] = chosen
        used[prefix].update(int(c) for c in chosen)
        moved.extend(int(m) for m in movers)
    return codes, sorted(moved)


def resolve_append(codes: np.ndarray) -> np.ndarray:
    """Add a level whose code is each item's rank among the items sharing its identifier: int [n, L+1]."""
    _, inverse = np.unique(codes, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    sorted_groups = inverse[order]
    group_start = np.searchsorted(sorted_groups, sorted_groups, side="left")
    rank = np.empty(len(codes), dtype=np.int64)
    rank[order] = np.arange(len(codes)) - group_start
    return np.concatenate([codes, rank[:, None]], axis=1)
