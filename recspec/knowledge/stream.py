"""The streaming set-up of LASER (laser.txt sections 2.2 and 4.1.1) on an interaction data set.

Per user, the interactions are sorted by time (ties by their order in the file). The last
``future_share`` of them (at least one) is the *future*: never shown to the LLM, it is the test
set of the downstream CTR check. The remaining ``n`` interactions are the user's history, split
into an *old* part ``h[:m]`` and a *new* part ``h[n - m:]`` with ``n/2 < m < n``
(``m = round(old_share * n)`` clamped into that range): the two parts overlap, as a user's
behaviour stream does, and the new part ends with the most recent history. Items are shuffled
with ``seed`` and split in half: *existing* items (first half) and *new* items.

Knowledge of the old parts and of the existing items is generated first (plain greedy decoding)
and fills the retrieval pools; knowledge of the new parts and the new items is what speculative
decoding accelerates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recspec.data.dataset import Dataset
from recspec.errors import RecspecError

SIDES = ("user", "item")
PARTS = ("old", "new")


@dataclass(frozen=True)
class StreamSplit:
    """Interaction indices (into ``dataset.interactions``), oldest first, per dense user.

    ``old``, ``new``, ``future``: one int64 array per user; ``existing_items``, ``new_items``:
    sorted int64 dense item indices, a partition of all items.
    """

    old: list[np.ndarray]
    new: list[np.ndarray]
    future: list[np.ndarray]
    existing_items: np.ndarray
    new_items: np.ndarray
    settings: dict

    def old_interactions(self) -> np.ndarray:
        """int64: every interaction in some user's old part (what was known before the stream
        moved on): the training data of the collaborative-filtering model."""
        return np.sort(np.concatenate(self.old))

    def history(self, user: int) -> np.ndarray:
        """The user's whole history (old and new parts, no future), oldest first."""
        return np.union1d(self.old[user], self.new[user])

    def entities(self, side: str, part: str) -> np.ndarray:
        """Dense user or item indices that get a knowledge text of ``part``: every user with a
        non-empty part; existing items for ``old``, new items for ``new``."""
        check_side_part(side, part)
        if side == "item":
            return self.existing_items if part == "old" else self.new_items
        parts = self.old if part == "old" else self.new
        return np.array([u for u, rows in enumerate(parts) if len(rows)], dtype=np.int64)


def check_side_part(side: str, part: str) -> None:
    if side not in SIDES:
        raise RecspecError(f"unknown side {side!r}; choose one of {', '.join(SIDES)}")
    if part not in PARTS:
        raise RecspecError(f"unknown part {part!r}; choose one of {', '.join(PARTS)}")


def stream_split(dataset: Dataset, old_share: float = 0.75, future_share: float = 0.1, seed: int = 0) -> StreamSplit:
    """Split ``dataset`` as the module describes."""
    if not 0.5 < old_share < 1:
        raise RecspecError(f"old_share must lie in (0.5, 1), got {old_share}")
    if not 0 < future_share < 0.5:
        raise RecspecError(f"future_share must lie in (0, 0.5), got {future_share}")
    inter = dataset.interactions
    order = np.lexsort((np.arange(len(inter)), inter.timestamps, inter.users))
    bounds = np.searchsorted(inter.users[order], np.arange(dataset.num_users + 1))
    old, new, future = [], [], []
    for user in range(dataset.num_users):
        rows = order[bounds[user]:bounds[user + 1]]
        n_future = max(1, int(round(future_share * len(rows)))) if len(rows) >= 3 else 0
        history, ahead = rows[:len(rows) - n_future], rows[len(rows) - n_future:]
        n = len(history)
        m = min(max(int(round(old_share * n)), n // 2 + 1), n - 1) if n >= 2 else n
        old.append(history[:m])
        new.append(history[n - m:] if n >= 2 else history[:0])
        future.append(ahead)
    items = np.random.default_rng(seed).permutation(dataset.num_items)
    half = dataset.num_items // 2
    return StreamSplit(old=old, new=new, future=future, existing_items=np.sort(items[:half]),
                       new_items=np.sort(items[half:]),
                       settings={"old_share": old_share, "future_share": future_share, "seed": seed})
