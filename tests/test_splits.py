"""Split invariants on synthetic data with timestamp ties and on the real Beauty and MovieLens data."""

from __future__ import annotations

import numpy as np
import pytest

from recspec.data import Dataset, Interactions, split_dataset
from recspec.data.splits import PAD_ITEM, time_labels
from recspec.errors import RecspecError


def synthetic(num_users: int = 40, num_items: int = 30, n: int = 600, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    inter = Interactions(users=rng.integers(0, num_users, n), items=rng.integers(0, num_items, n),
                         timestamps=rng.integers(0, 50, n))  # many ties
    return Dataset("synthetic", "test", inter, [str(u) for u in range(num_users)], [str(i) for i in range(num_items)])


def check_time_invariants(dataset: Dataset, max_history: int = 20) -> None:
    split = split_dataset(dataset, "time", max_history)
    times, labels = dataset.interactions.timestamps, split.labels
    assert times[labels == 0].max() < times[labels == 1].min()
    assert times[labels == 1].max() < times[labels == 2].min()
    check_examples(dataset, split, max_history)


def check_examples(dataset: Dataset, split, max_history: int) -> None:
    """Histories hold only earlier-split items of the same user, most recent last, capped."""
    inter = dataset.interactions
    for part, examples in ((1, split.valid), (2, split.test)):
        for i in range(len(examples)):
            user = examples.users[i]
            mine = inter.users == user
            order = np.lexsort((np.flatnonzero(mine), inter.timestamps[mine], split.labels[mine]))
            items, labels = inter.items[mine][order], split.labels[mine][order]
            expected_history = items[labels < part][-max_history:]
            np.testing.assert_array_equal(examples.history_of(i), expected_history)
            np.testing.assert_array_equal(np.sort(examples.targets(i)), np.sort(items[labels == part]))
    assert split.train.history.shape[1] == max_history
    assert (split.train.history_lengths() >= 1).all()


def test_time_split_is_strictly_later_with_ties() -> None:
    for seed in range(5):
        check_time_invariants(synthetic(seed=seed), max_history=5)


def test_time_labels_ratio() -> None:
    labels = time_labels(np.arange(1000))
    np.testing.assert_array_equal(np.bincount(labels), [800, 100, 100])


def test_leave_one_out() -> None:
    dataset = synthetic(n=300)
    split = split_dataset(dataset, "loo", max_history=4)
    inter = dataset.interactions
    for i in range(len(split.test)):
        user = split.test.users[i]
        mine = np.flatnonzero(inter.users == user)
        last = mine[np.lexsort((mine, inter.timestamps[mine]))]
        np.testing.assert_array_equal(split.test.targets(i), [inter.items[last[-1]]])
        np.testing.assert_array_equal(split.test.history_of(i), inter.items[last[:-1]][-4:])
    check_examples(dataset, split, 4)


def test_training_examples_slide_over_history() -> None:
    inter = Interactions(users=np.zeros(5, dtype=np.int64), items=np.arange(5), timestamps=np.arange(5))
    dataset = Dataset("one", "test", inter, ["u"], [str(i) for i in range(5)])
    split = split_dataset(dataset, "loo", max_history=2)
    # train = items 0, 1, 2; examples: [0] -> 1, [0, 1] -> 2
    np.testing.assert_array_equal(split.train.history, [[PAD_ITEM, 0], [0, 1]])
    np.testing.assert_array_equal(split.train.target_items, [1, 2])
    np.testing.assert_array_equal(split.valid.history, [[1, 2]])
    np.testing.assert_array_equal(split.test.history, [[2, 3]])


def test_cold_start_users_are_counted() -> None:
    inter = Interactions(users=np.array([0, 1, 1]), items=np.array([0, 1, 2]), timestamps=np.array([1, 2, 3]))
    dataset = Dataset("cold", "test", inter, ["a", "b"], ["0", "1", "2"])
    split = split_dataset(dataset, "loo")
    assert split.dropped == {"valid": 1, "test": 1}  # user b's valid item and user a's only item
    assert len(split.test) == 1


def test_subset_keeps_targets() -> None:
    split = split_dataset(synthetic(), "time", 5)
    picked = split.test.subset(np.array([2, 0]))
    np.testing.assert_array_equal(picked.targets(0), split.test.targets(2))
    np.testing.assert_array_equal(picked.targets(1), split.test.targets(0))


def test_bad_split_options() -> None:
    with pytest.raises(RecspecError, match="unknown split"):
        split_dataset(synthetic(), "random")
    with pytest.raises(RecspecError, match="not released with a split"):
        split_dataset(synthetic(), "given")
    with pytest.raises(RecspecError, match="max history"):
        split_dataset(synthetic(), "time", 0)


def test_beauty_given_split(beauty) -> None:
    split = split_dataset(beauty)
    assert split.kind == "given"
    assert split.sizes() == {"train": 122241, "valid": 9316, "test": 7313}
    assert len(split.test) == 3553  # the README: 3,553 users have test items
    assert split.dropped == {"valid": 0, "test": 0}
    # test history = train + valid items, last 20; user "1": train 1955 28 12031 2758 2273 9634, test 3004
    first = int(np.flatnonzero(np.array(beauty.user_ids)[split.test.users] == "1")[0])
    np.testing.assert_array_equal(split.test.targets(first), [3003])
    np.testing.assert_array_equal(split.test.history_of(first)[:6], [1954, 27, 12030, 2757, 2272, 9633])
    assert (split.test.history_lengths() <= 20).all()


def test_movielens_time_and_loo(ml100k) -> None:
    check_time_invariants(ml100k)
    split = split_dataset(ml100k, "loo")
    assert len(split.test) == 943 and split.sizes()["test"] == 943
    check_examples(ml100k, split, 20)
