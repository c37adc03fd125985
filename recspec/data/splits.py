"""Train / validation / test splits and the examples built from them.

Three kinds of split:
- ``time``: all interactions sorted by timestamp and cut 8:1:1 (AtSpeed). A cut never falls
  inside a group of equal timestamps, so every validation/test interaction is strictly later than
  every training one.
- ``loo``: leave-one-out per user (LC-Rec, TIGER): last interaction is test, second-last is
  validation, the rest train.
- ``given``: the split a dataset was released with (the AtSpeed Beauty files).

Examples: every training interaction with at least one earlier training interaction of the same
user is a training example (history = up to ``max_history`` previous items, target = that item).
Each user with interactions in the validation (test) split is one validation (test) example: the
history is the user's last ``max_history`` items before that split (train for validation,
train + validation for test), the targets are all of the user's items in the split. Users whose
history would be empty (cold-start) are left out and counted in ``SplitData.dropped``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recspec.data.dataset import SPLIT_NAMES, SPLIT_TEST, SPLIT_TRAIN, SPLIT_VALID, Dataset
from recspec.errors import RecspecError

SPLIT_KINDS = ("time", "loo", "given")
PAD_ITEM = -1


@dataclass(frozen=True)
class Examples:
    """A set of (user, history, targets) examples as arrays.

    users: int64 [n]. history: int64 [n, H], most recent item last, left-padded with ``PAD_ITEM``.
    target_offsets: int64 [n + 1] and target_items: int64 [total]: the targets of example i are
    ``target_items[target_offsets[i]:target_offsets[i + 1]]``.
    """

    users: np.ndarray
    history: np.ndarray
    target_offsets: np.ndarray
    target_items: np.ndarray

    def __len__(self) -> int:
        return len(self.users)

    def targets(self, i: int) -> np.ndarray:
        return self.target_items[self.target_offsets[i]:self.target_offsets[i + 1]]

    def history_of(self, i: int) -> np.ndarray:
        row = self.history[i]
        return row[row != PAD_ITEM]

    def history_lengths(self) -> np.ndarray:
        """int64 [n]: number of real (non-pad) items in each history."""
        return (self.history != PAD_ITEM).sum(axis=1)

    def subset(self, index: np.ndarray) -> Examples:
        """The examples at positions ``index`` (int64 [m]), in that order."""
        counts = np.diff(self.target_offsets)[index]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        starts = self.target_offsets[index]
        gather = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1])
        return Examples(self.users[index], self.history[index], offsets, self.target_items[gather])


@dataclass(frozen=True)
class SplitData:
    """A split of one dataset: per-interaction labels and the examples of each part."""

    kind: str
    max_history: int
    labels: np.ndarray  # int8 [num_interactions]: 0 train, 1 valid, 2 test
    train: Examples
    valid: Examples
    test: Examples
    dropped: dict[str, int]  # cold-start users left out of valid / test (empty history)

    def sizes(self) -> dict[str, int]:
        """Interactions per part."""
        counts = np.bincount(self.labels, minlength=3)
        return {name: int(c) for name, c in zip(SPLIT_NAMES, counts)}


def time_labels(timestamps: np.ndarray, ratios: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> np.ndarray:
    """int8 [n] split labels by global time, cut at the given ratios on tie-group boundaries."""
    n = len(timestamps)
    order = np.argsort(timestamps, kind="stable")
    sorted_times = timestamps[order]
    fractions = np.cumsum(ratios)[:2] / sum(ratios)
    cuts = []
    for fraction in fractions:
        cut = int(round(fraction * n))
        # move the cut past every interaction sharing the timestamp just before it
        cuts.append(int(np.searchsorted(sorted_times, sorted_times[cut - 1], side="right")) if cut > 0 else 0)
    labels = np.empty(n, dtype=np.int8)
    labels[order] = np.searchsorted(np.asarray(cuts), np.arange(n), side="right").astype(np.int8)
    return labels


def leave_one_out_labels(users: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """int8 [n] labels: each user's last interaction is test, the one before it validation."""
    order = np.lexsort((np.arange(len(users)), timestamps, users))
    sorted_users = users[order]
    ends = np.searchsorted(sorted_users, sorted_users, side="right")
    from_end = ends - 1 - np.arange(len(users))
    labels = np.empty(len(users), dtype=np.int8)
    labels[order] = np.select([from_end == 0, from_end == 1], [SPLIT_TEST, SPLIT_VALID], SPLIT_TRAIN)
    return labels


def history_windows(items: np.ndarray, ends: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """int64 [m, width]: ``items[max(start, end - width):end]`` per row, left-padded with PAD_ITEM."""
    cols = ends[:, None] - np.arange(width, 0, -1)[None, :]
    valid = cols >= starts[:, None]
    return np.where(valid, items[np.clip(cols, 0, None)], PAD_ITEM).astype(np.int64)


def split_dataset(dataset: Dataset, kind: str | None = None, max_history: int = 20,
                  ratios: tuple[float, float, float] = (0.8, 0.1, 0.1)) -> SplitData:
    """Split ``dataset`` and build its training, validation and test examples.

    ``kind`` defaults to ``given`` for datasets released with a split and ``time`` otherwise.
    """
    if max_history < 1:
        raise RecspecError(f"max history must be at least 1, got {max_history}")
    inter = dataset.interactions
    if kind is None:
        kind = "given" if dataset.given_split is not None else "time"
    if kind == "time":
        labels = time_labels(inter.timestamps, ratios)
    elif kind == "loo":
        labels = leave_one_out_labels(inter.users, inter.timestamps)
    elif kind == "given":
        if dataset.given_split is None:
            raise RecspecError(f"dataset {dataset.name} was not released with a split; use --split time or loo")
        labels = dataset.given_split
    else:
        raise RecspecError(f"unknown split {kind!r}; choose one of {', '.join(SPLIT_KINDS)}")

    # sort by (user, split, time, original order): each user's block is train, then valid, then test
    order = np.lexsort((np.arange(len(inter)), inter.timestamps, labels, inter.users))
    users, items, lab = inter.users[order], inter.items[order], labels[order].astype(np.int64)
    user_start = np.searchsorted(users, users, side="left")
    keys = users * 3 + lab

    train_rows = np.flatnonzero((lab == SPLIT_TRAIN) & (np.arange(len(users)) > user_start))
    train = Examples(
        users=users[train_rows],
        history=history_windows(items, train_rows, user_start[train_rows], max_history),
        target_offsets=np.arange(len(train_rows) + 1, dtype=np.int64),
        target_items=items[train_rows].astype(np.int64),
    )

    def evaluation(part: int) -> tuple[Examples, int]:
        part_users = np.unique(users[lab == part])
        first = np.searchsorted(keys, part_users * 3 + part, side="left")
        last = np.searchsorted(keys, part_users * 3 + part, side="right")
        starts = np.searchsorted(users, part_users, side="left")
        keep = first > starts
        part_users, first, last, starts = part_users[keep], first[keep], last[keep], starts[keep]
        counts = last - first
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        gather = np.repeat(first - offsets[:-1], counts) + np.arange(offsets[-1])
        examples = Examples(part_users.astype(np.int64), history_windows(items, first, starts, max_history),
                            offsets, items[gather].astype(np.int64))
        return examples, int((~keep).sum())

    valid, dropped_valid = evaluation(SPLIT_VALID)
    test, dropped_test = evaluation(SPLIT_TEST)
    return SplitData(kind=kind, max_history=max_history, labels=np.asarray(labels, dtype=np.int8), train=train,
                     valid=valid, test=test, dropped={"valid": dropped_valid, "test": dropped_test})
