"""Tokenizer, prompt encoder and model presets, on a synthetic index and split (and real Beauty where present)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from recspec.data import Dataset, Interactions, split_dataset
from recspec.data.splits import PAD_ITEM, Examples
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.examples import PromptEncoder, last_per_user, one_target_per_row, truncate_history
from recspec.decoding.cost import measure_call_cost
from recspec.models.presets import PRESETS, build_model, count_parameters
from recspec.models.tokenizer import (
    CONTROL_TOKENS,
    build_tokenizer,
    check_same_vocabulary,
    identifier_token_ids,
    index_fingerprint,
    load_tokenizer_dir,
    save_tokenizer,
)


def synthetic_index(num_items: int = 30, levels: int = 3, codes_per_level: int = 6, seed: int = 0) -> ItemIndex:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, codes_per_level, (num_items, levels))
    codes[:, -1] = np.arange(num_items)  # unique identifiers
    return ItemIndex.from_codes([f"item{i}" for i in range(num_items)], codes)


def synthetic_dataset(num_items: int = 30, num_users: int = 25, n: int = 400, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    inter = Interactions(users=rng.integers(0, num_users, n), items=rng.integers(0, num_items, n),
                         timestamps=rng.integers(0, 1000, n))
    # dataset item i is index item "item{perm[i]}": dataset order differs from index order
    perm = rng.permutation(num_items)
    return Dataset("synthetic", "test", inter, [f"u{u}" for u in range(num_users)], [f"item{p}" for p in perm])


@pytest.fixture(scope="module")
def setup():
    index = synthetic_index()
    dataset = synthetic_dataset()
    split = split_dataset(dataset, "loo", max_history=6)
    tokenizer = build_tokenizer(index)
    return index, dataset, split, tokenizer, PromptEncoder(index, dataset.item_ids, tokenizer)


def plain_prompt(index: ItemIndex, dataset: Dataset, tokenizer, history: list[int]) -> list[int]:
    vocab = tokenizer.get_vocab()
    row = {k: i for i, k in enumerate(index.item_keys)}
    tokens = ["<bos>"] + [t for item in history for t in index.identifiers[row[dataset.item_ids[item]]]] + ["<sep>"]
    return [vocab[t] for t in tokens]


# ---------------------------------------------------------------------- tokenizer

def test_tokenizer_ids_and_round_trip(setup, tmp_path) -> None:
    index, _, _, tokenizer, _ = setup
    assert len(tokenizer) == 4 + len(index.tokens)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == list(CONTROL_TOKENS)
    specials = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.sep_token_id)
    assert specials == (0, 1, 2, 3)
    ids = identifier_token_ids(tokenizer, index)
    assert [ids[t] for t in index.tokens] == list(range(4, 4 + len(index.tokens)))
    text = "<bos> " + " ".join(index.identifiers[5]) + " <sep>"
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encoded == [1] + [ids[t] for t in index.identifiers[5]] + [3]
    assert tokenizer.decode(encoded) == text

    save_tokenizer(tokenizer, index, tmp_path / "tok")
    loaded = load_tokenizer_dir(tmp_path / "tok", index)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded(text, add_special_tokens=False)["input_ids"] == encoded
    check_same_vocabulary(tokenizer, loaded)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "tok").get_vocab() == tokenizer.get_vocab()
    trie = index.trie(ids, len(tokenizer))
    assert trie is not None


def test_vocabulary_mismatch_and_fingerprint(setup, tmp_path) -> None:
    index, _, _, tokenizer, _ = setup
    other = synthetic_index(num_items=31)
    with pytest.raises(RecspecError, match="share a vocabulary"):
        check_same_vocabulary(tokenizer, build_tokenizer(other))
    with pytest.raises(RecspecError, match="lacks identifier token"):
        identifier_token_ids(build_tokenizer(synthetic_index(num_items=10)), index)

    index.save(tmp_path / "item_index.json")
    assert index_fingerprint(index) == hashlib.sha256((tmp_path / "item_index.json").read_bytes()).hexdigest()
    assert index_fingerprint(ItemIndex.load(tmp_path / "item_index.json")) == index_fingerprint(index)
    assert index_fingerprint(other) != index_fingerprint(index)
    save_tokenizer(tokenizer, index, tmp_path / "tok")
    with pytest.raises(RecspecError, match="another item index"):
        load_tokenizer_dir(tmp_path / "tok", other)


# ---------------------------------------------------------------------- encoder

def check_encoder(index, dataset, tokenizer, encoder, examples) -> None:
    prompts = encoder.prompts(examples)
    assert len(prompts) == len(examples)
    for i in range(len(examples)):
        assert prompts[i].tolist() == plain_prompt(index, dataset, tokenizer, examples.history_of(i).tolist())


def test_prompts_equal_plain_construction(setup) -> None:
    index, dataset, split, tokenizer, encoder = setup
    for examples in (split.train, split.valid, split.test):
        check_encoder(index, dataset, tokenizer, encoder, examples)
    assert encoder.prompt_lengths(split.train).tolist() == [len(p) for p in encoder.prompts(split.train)]


def test_prompts_on_beauty(beauty) -> None:
    index = ItemIndex.load(beauty.item_index_path)
    tokenizer = build_tokenizer(index)
    encoder = PromptEncoder(index, beauty.item_ids, tokenizer)
    split = split_dataset(beauty)
    picked = split.test.subset(np.arange(0, len(split.test), 97))
    check_encoder(index, beauty, tokenizer, encoder, picked)
    assert len(encoder.prompts(split.train)) == len(split.train)  # all of them, vectorized


def test_training_batch_is_left_padded_prompt_plus_answer(setup) -> None:
    index, dataset, split, tokenizer, encoder = setup
    rows = np.arange(0, len(split.train), 3)
    batch = encoder.training_batch(split.train, rows)
    L = index.length
    prompts = encoder.prompts(split.train, rows)
    width = max(len(p) for p in prompts) + L
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["position_ids"].shape == (len(rows), width)
    assert batch["labels"].shape == (len(rows), L)
    for j, i in enumerate(rows):
        p = len(prompts[j])
        answer = plain_prompt(index, dataset, tokenizer, split.train.targets(i).tolist())[1:-1]
        assert batch["input_ids"][j, width - p - L:width - L].tolist() == prompts[j].tolist()
        assert batch["input_ids"][j, width - L:].tolist() == answer == batch["labels"][j].tolist()
        assert (batch["input_ids"][j, :width - p - L] == tokenizer.pad_token_id).all()
        assert batch["attention_mask"][j].tolist() == [0] * (width - p - L) + [1] * (p + L)
        assert batch["position_ids"][j, width - p - L:].tolist() == list(range(p + L))


def test_prompt_batch_left_padding(setup) -> None:
    _, _, split, _, encoder = setup
    prompts = encoder.prompts(split.valid)
    batch = encoder.prompt_batch(split.valid)
    width = batch["input_ids"].shape[1]
    for j, p in enumerate(prompts):
        assert batch["input_ids"][j, width - len(p):].tolist() == p.tolist()
        assert batch["attention_mask"][j].tolist() == [0] * (width - len(p)) + [1] * len(p)
        assert batch["position_ids"][j, width - len(p):].tolist() == list(range(len(p)))


def test_encoder_errors(setup) -> None:
    index, dataset, split, tokenizer, encoder = setup
    history = np.array([[PAD_ITEM, 3], [PAD_ITEM, PAD_ITEM], [1, 2]])
    examples = Examples(np.arange(3), history, np.arange(4), np.array([1, 2, 3]))
    with pytest.raises(RecspecError, match=r"example\(s\) 1 .*empty history"):
        encoder.prompts(examples)
    bad = Examples(np.arange(1), np.array([[5, 999]]), np.arange(2), np.array([1]))
    with pytest.raises(RecspecError, match="unknown item index.*999"):
        encoder.prompts(bad)
    bad_target = Examples(np.arange(1), np.array([[5, 6]]), np.arange(2), np.array([1000]))
    with pytest.raises(RecspecError, match="unknown target item.*1000"):
        encoder.training_batch(bad_target)
    multi = split.valid if (np.diff(split.valid.target_offsets) > 1).any() else None
    if multi is not None:
        with pytest.raises(RecspecError, match="one per example"):
            encoder.training_batch(multi)
    with pytest.raises(RecspecError, match="unknown item id"):
        PromptEncoder(index, dataset.item_ids + ["nope"], tokenizer)


def test_example_selection(setup) -> None:
    _, _, split, _, encoder = setup
    train = split.train
    short = truncate_history(train, 2)
    assert short.history.shape[1] == 2
    np.testing.assert_array_equal(short.history, train.history[:, -2:])
    pairs = one_target_per_row(split.valid)
    assert len(pairs) == len(split.valid.target_items)
    encoder.training_batch(pairs)  # one target each
    kept = last_per_user(train, 2)
    for user in np.unique(train.users):
        mine = np.flatnonzero(train.users == user)
        np.testing.assert_array_equal(kept[np.isin(kept, mine)], mine[-2:])


# ---------------------------------------------------------------------- presets

def test_preset_parameter_counts() -> None:
    tokenizer = build_tokenizer(synthetic_index(num_items=256, levels=4, codes_per_level=256))  # ~ Beauty's 4 x 256
    target = build_model("target-small", tokenizer)
    mini = build_model("target-mini", tokenizer)
    draft = build_model("draft-tiny", tokenizer)
    assert target.config.vocab_size == mini.config.vocab_size == draft.config.vocab_size == len(tokenizer)
    assert (target.config.pad_token_id, target.config.bos_token_id, target.config.eos_token_id) == (0, 1, 2)
    assert target.config.max_position_embeddings == 512
    assert 24e6 <= count_parameters(target) <= 28e6
    assert 3.4e6 <= count_parameters(mini) <= 3.8e6
    assert 0.3e6 <= count_parameters(draft) <= 0.6e6
    assert set(PRESETS) >= {"target-small", "target-mini", "draft-tiny"}


def test_build_model_is_seeded_and_timed(setup) -> None:
    _, _, _, tokenizer, _ = setup
    a, b = build_model("draft-tiny", tokenizer, seed=3), build_model("draft-tiny", tokenizer, seed=3)
    c = build_model("draft-tiny", tokenizer, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    assert measure_call_cost(a, batch=2, seq_len=8, repeats=2, warmup=1) > 0
    assert measure_call_cost(a, batch=2, seq_len=4, repeats=2, warmup=1, past_len=8) > 0
    with pytest.raises(RecspecError, match="unknown model preset"):
        build_model("huge", tokenizer)
