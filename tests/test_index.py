"""Item index I/O, collision detection and resolution, and the trie over real identifiers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recspec.errors import RecspecError
from recspec.itemids.build import dataset_identifiers, level_codes, load_released, resolve
from recspec.itemids.collisions import collision_groups, collision_rate, resolve_append, resolve_reassign
from recspec.itemids.index import ItemIndex


def test_round_trip(tmp_path: Path) -> None:
    codes = np.array([[0, 1, 2], [3, 1, 0], [0, 0, 0]])
    index = ItemIndex.from_codes(["7", "8", "9"], codes)
    assert index.identifiers[1] == ("<a_3>", "<b_1>", "<c_0>")
    index.save(tmp_path / "item_index.json")
    loaded = ItemIndex.load(tmp_path)
    assert loaded == index
    assert loaded.tokens == ["<a_0>", "<a_3>", "<b_0>", "<b_1>", "<c_0>", "<c_2>"]
    np.testing.assert_array_equal(level_codes(loaded)[0], codes)
    np.testing.assert_array_equal(loaded.positions(["9", "7"]), [2, 0])
    with pytest.raises(RecspecError, match="unknown item id"):
        loaded.positions(["7", "10"])


@pytest.mark.parametrize(("content", "message"), [
    ("[1, 2]", "expected a JSON object"),
    ('{"0": ["<a_1>"], "1": "<a_2>"}', "item '1': expected a non-empty list"),
    ('{"0": ["<a_1>", "<b_1>"], "1": ["<a_2>"]}', "same, non-zero length"),
    ('{"0": ["<a_1>"', "line 1: malformed JSON"),
    ("{}", "no items"),
])
def test_malformed_index_files(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "item_index.json").write_text(content)
    with pytest.raises(RecspecError, match=message):
        ItemIndex.load(tmp_path / "item_index.json")


def test_collisions_detected_and_reassigned_by_cost() -> None:
    codes = np.array([[0, 0, 1], [0, 0, 1], [0, 0, 1], [1, 0, 1], [0, 0, 0]])
    assert [g.tolist() for g in collision_groups(codes)] == [[0, 1, 2]]
    assert collision_rate(codes) == pytest.approx(3 / 5)
    costs = np.zeros((5, 4))
    costs[0] = [9, 5, 0, 9]  # item 0 prefers code 2
    costs[1] = [9, 0.1, 9, 9]  # item 1 is the closest to its current code 1: it stays
    costs[2] = [9, 3, 9, 0]  # item 2 prefers code 3
    fixed, moved = resolve_reassign(codes, 4, costs)
    assert moved == [0, 2]
    np.testing.assert_array_equal(fixed[:, -1], [2, 1, 3, 1, 0])
    np.testing.assert_array_equal(fixed[:, :-1], codes[:, :-1])  # only the last level changes
    assert collision_rate(fixed) == 0


def test_reassign_without_costs_and_overflow() -> None:
    codes = np.array([[0, 1], [0, 1], [0, 0], [0, 1]])
    fixed, moved = resolve_reassign(codes, 4)
    assert moved == [1, 3]
    np.testing.assert_array_equal(fixed[:, 1], [1, 2, 0, 3])
    with pytest.raises(RecspecError, match="needs 2 free last-level codes but has 1"):
        resolve_reassign(codes, 3)


def test_append_adds_a_level() -> None:
    codes = np.array([[0, 1], [0, 1], [2, 0], [0, 1]])
    fixed = resolve_append(codes)
    np.testing.assert_array_equal(fixed[:, -1], [0, 1, 0, 2])
    assert collision_rate(fixed) == 0
    _, _, stats = resolve(codes, [4, 4], "append")
    assert stats["codebook_sizes"] == [4, 4, 3]
    with pytest.raises(RecspecError, match="unknown collision resolution"):
        resolve(codes, [4, 4], "drop")


def test_beauty_identifiers_loaded_and_resolved(beauty, beauty_dir: Path) -> None:
    raw = ItemIndex.load(beauty_dir / "item_index.json")
    assert len(raw) == 12035 and raw.length == 4
    groups = collision_groups(raw.codes)
    assert len(groups) == 9 and sum(len(g) for g in groups) == 21  # as the data README warns
    index, stats = load_released(beauty_dir / "item_index.json")
    assert stats["collisions_after"]["rate"] == 0
    assert stats["moved_items"] == 21 - 9
    assert collision_groups(index.codes) == []
    changed = [i for i in range(len(raw)) if raw.identifiers[i] != index.identifiers[i]]
    assert len(changed) == 12 and sorted(stats["changes"]) == sorted(raw.item_keys[i] for i in changed)
    for i in changed:  # the first three tokens never change
        assert raw.identifiers[i][:3] == index.identifiers[i][:3]
    assert dataset_identifiers(beauty).identifiers == index.identifiers


def test_trie_accepts_exactly_the_beauty_items(beauty_dir: Path) -> None:
    index, _ = load_released(beauty_dir / "item_index.json")
    offset = 5  # identifier tokens after a few control tokens, as a model vocabulary would have them
    trie = index.trie({t: offset + i for i, t in enumerate(index.tokens)}, vocab_size=offset + len(index.tokens))
    ids = torch.as_tensor(index.codes + offset)
    leaves = trie.walk(ids)
    np.testing.assert_array_equal(trie.items(leaves).numpy(), np.arange(len(index)))
    # a random identifier that is no item is rejected; every allowed first token starts an item
    rng = np.random.default_rng(0)
    fake = torch.as_tensor(rng.integers(offset, offset + len(index.tokens), size=(2000, 4)))
    real = {tuple(r) for r in ids.tolist()}
    accepted = trie.items(trie.walk(fake)) >= 0
    assert accepted.tolist() == [tuple(r) in real for r in fake.tolist()]
    first = trie.allowed_mask(torch.tensor([trie.root]))[0].nonzero().flatten().tolist()
    assert first == sorted({r[0] for r in real})


def test_index_against_a_dataset_with_unknown_items(tmp_path: Path, beauty) -> None:
    (tmp_path / "item_index.json").write_text(json.dumps({"0": ["<a_1>"], "1": ["<a_2>"]}))
    with pytest.raises(RecspecError, match="unknown item id"):
        dataset_identifiers(beauty, tmp_path)


def test_trie_of_colliding_index_is_refused() -> None:
    index = ItemIndex.from_codes(["1", "2"], np.array([[0, 1], [0, 1]]))
    with pytest.raises(RecspecError, match="same identifier"):
        index.trie()
