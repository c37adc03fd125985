"""The trainer on a synthetic, learnable pattern: learning, checkpoints, exact resume, loading."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from recspec.data import Dataset, Interactions, split_dataset
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.examples import PromptEncoder, one_target_per_row
from recspec.models.presets import build_model
from recspec.models.tokenizer import build_tokenizer
from recspec.models.checkpoint import load_trained
from recspec.models import train as train_module
from recspec.models.train import SupervisedTask, TrainConfig, epoch_batches, level_losses, lr_lambda, train
from recspec.statefile import load_state

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_ITEMS = 40


def pattern_dataset(num_users: int = 150, seed: int = 0) -> Dataset:
    """Every user walks item x -> (3x + 1) mod 40 (a permutation): the next item is f(last item)."""
    rng = np.random.default_rng(seed)
    users, items, times = [], [], []
    for user in range(num_users):
        item = int(rng.integers(NUM_ITEMS))
        for t in range(int(rng.integers(4, 12))):
            users.append(user)
            items.append(item)
            times.append(t)
            item = (3 * item + 1) % NUM_ITEMS
    inter = Interactions(np.array(users), np.array(items), np.array(times))
    return Dataset("pattern", "test", inter, [f"u{u}" for u in range(num_users)], [f"i{i}" for i in range(NUM_ITEMS)])


def pattern_index() -> ItemIndex:
    rng = np.random.default_rng(1)
    codes = np.stack([np.arange(NUM_ITEMS) // 8, np.arange(NUM_ITEMS) % 8, rng.integers(0, 4, NUM_ITEMS)], axis=1)
    return ItemIndex.from_codes([f"i{i}" for i in range(NUM_ITEMS)], codes)


@pytest.fixture(scope="module")
def setup():
    dataset = pattern_dataset()
    index = pattern_index()
    split = split_dataset(dataset, "loo", max_history=5)
    tokenizer = build_tokenizer(index)
    return index, split, tokenizer, PromptEncoder(index, dataset.item_ids, tokenizer)


CONFIG = dict(epochs=2, batch_size=32, lr=3e-3, warmup_steps=5, precision="fp32", checkpoint_minutes=60.0)


def teacher_forced_accuracy(model, encoder, examples) -> float:
    """Fraction of examples whose L answer tokens are all the argmax given the true prefix."""
    batch = encoder.training_batch(one_target_per_row(examples))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    length = batch["labels"].shape[1]
    right = logits[:, -length - 1:-1].argmax(-1) == batch["labels"]
    return float(right.all(dim=1).float().mean())


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a, b) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def log_rows(out_dir) -> list[dict]:
    drop = {"train_seconds", "tokens_per_s", "examples_per_s", "eval_seconds", "loss_curve"}
    lines = (out_dir / "train_log.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in lines]


def test_learns_the_pattern(setup, tmp_path) -> None:
    index, split, tokenizer, encoder = setup
    model = build_model("draft-tiny", tokenizer)
    before = teacher_forced_accuracy(model, encoder, split.valid)
    config = TrainConfig(**{**CONFIG, "epochs": 5})
    result = train(model, SupervisedTask(encoder, split, config), tmp_path / "run", config, progress=False)
    losses = [row["train_loss"] for row in result.history]
    assert losses[-1] < 0.5 * losses[0]
    assert [row["valid_loss"] for row in result.history][-1] < result.history[0]["valid_loss"]
    assert result.metric == "valid_loss" and result.stopped == "epochs" and result.epochs_run == 5
    accuracy = teacher_forced_accuracy(model, encoder, split.valid)
    assert before < 0.2 and accuracy > 0.9
    assert result.tokens_per_s > 0 and result.examples_per_s > 0
    assert len(log_rows(tmp_path / "run")) == 5

    loaded, loaded_tokenizer = load_trained(tmp_path / "run", index)
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert teacher_forced_accuracy(loaded, encoder, split.valid) == accuracy


def logged_curve(out_dir) -> list[list[float]]:
    """The training-loss curve of a run: every log row's points, in order."""
    lines = (out_dir / "train_log.jsonl").read_text().splitlines()
    return [point for line in lines for point in json.loads(line).get("loss_curve", [])]


def test_resume_after_interruption_is_exact(setup, tmp_path, monkeypatch) -> None:
    index, split, tokenizer, encoder = setup
    monkeypatch.setattr(train_module, "LOSS_WINDOW", 4)
    config = TrainConfig(**CONFIG)
    reference = train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "a", config, progress=False)
    steps_per_epoch = reference.steps // 2

    # 1. KeyboardInterrupt raised between steps, in epoch 1
    def stop_at(step):
        def callback(info):
            if info["step"] == step:
                raise KeyboardInterrupt
        return callback

    with pytest.raises(KeyboardInterrupt):
        train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "b", config, progress=False,
              callback=stop_at(7))
    saved = load_state(tmp_path / "b" / "checkpoint", "trainer_state", "")
    assert saved["train"]["step"] == 7 and saved["train"]["batch_in_epoch"] == 7

    # 2. Ctrl-C (SIGINT) in the middle of a forward pass of epoch 2: deferred to the end of that step
    model = build_model("draft-tiny", tokenizer, seed=9)  # other initial weights: the checkpoint replaces them
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += module.training  # training steps only (validation runs in eval mode)
        if module.training and calls["n"] == 20:
            signal.raise_signal(signal.SIGINT)

    model.register_forward_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        train(model, SupervisedTask(encoder, split, config), tmp_path / "b", config, progress=False)
    saved = load_state(tmp_path / "b" / "checkpoint", "trainer_state", "")
    # the step running when SIGINT came completed: 7 + 20 steps, in epoch 2
    assert saved["train"]["step"] == 27 > steps_per_epoch and saved["train"]["epoch"] == 1

    # 3. a time budget that runs out after one step, then the rest
    stopped = train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "b",
                    TrainConfig(**{**CONFIG, "max_minutes": 1e-6}), progress=False)
    assert stopped.stopped == "time budget" and stopped.steps == saved["train"]["step"] + 1
    assert stopped.history[-1]["partial"]
    resumed = train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "b", config, progress=False)

    assert resumed.steps == reference.steps and resumed.stopped == "epochs"
    assert_same_weights(tmp_path / "a" / "checkpoint", tmp_path / "b" / "checkpoint")
    full_epochs = [row for row in log_rows(tmp_path / "b") if not row["partial"]]
    reference_rows = log_rows(tmp_path / "a")
    for row, ref in zip(full_epochs, reference_rows, strict=True):
        assert {k: v for k, v in row.items() if k != "best"} == {k: v for k, v in ref.items() if k != "best"}
    # the loss curve survives the interruptions: the same points, whichever log row carries them
    curve, reference_curve = logged_curve(tmp_path / "b"), logged_curve(tmp_path / "a")
    assert [point[:2] for point in curve] == [point[:2] for point in reference_curve]
    assert [point[2] for point in curve] == pytest.approx([point[2] for point in reference_curve], rel=1e-6)
    assert [point[0] for point in curve] == list(range(4, reference.steps + 1, 4))

    # a finished run called again returns at once with the best model
    again = train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "a", config, progress=False)
    assert again.steps == reference.steps and again.best_value == reference.best_value
    assert_same_weights(tmp_path / "a" / "best", tmp_path / "b" / "best")


def test_loss_curve_and_level_losses(setup, tmp_path, monkeypatch) -> None:
    """The log's loss curve: a point every LOSS_WINDOW steps, the examples trained on so far and
    the example-weighted mean of the window's step losses; ``level_losses`` is each level's
    cross-entropy of a plain forward per example, and their mean the validation loss."""
    from benchmarks.lab.curve import run as write_curves

    index, split, tokenizer, encoder = setup
    monkeypatch.setattr(train_module, "LOSS_WINDOW", 3)
    config = TrainConfig(**CONFIG)
    task = SupervisedTask(encoder, split, config)
    losses: list[float] = []
    model = build_model("draft-tiny", tokenizer)
    result = train(model, task, tmp_path / "run", config, progress=False,
                   callback=lambda info: losses.append(info["loss"]))
    sizes = [len(rows) for epoch in range(2)
             for rows in epoch_batches(task.lengths(), config.batch_size, config.bucket_batches, config.seed, epoch)]
    assert len(sizes) == len(losses) == result.steps
    curve = logged_curve(tmp_path / "run")
    assert [point[0] for point in curve] == list(range(3, result.steps + 1, 3))
    for step, examples, loss in curve:
        window = slice(step - 3, step)
        assert examples == sum(sizes[:step])
        assert loss == pytest.approx(np.average(losses[window], weights=sizes[window]), rel=1e-9)

    markdown = write_curves(tmp_path, [tmp_path / "run"], ["run"], [1], "valid_loss", [], budget=1e9, target=None,
                            name="c")
    saved = json.loads((tmp_path / "c.json").read_text())["runs"][0]["loss_curve"]
    assert [[p["step"], p["examples"], p["loss"]] for p in saved] == curve
    last = curve[-1]
    assert f"{last[2]:.3f} ({last[0]}, {last[1]})" in markdown
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"

    pairs = one_target_per_row(split.valid)
    levels = level_losses(model.eval(), encoder, pairs, 7, torch.device("cpu"))
    expected = np.zeros(encoder.length)
    with torch.no_grad():
        for row in range(len(pairs)):
            batch = encoder.training_batch(pairs, np.array([row]))
            logits = model(input_ids=batch["input_ids"]).logits[0, -encoder.length - 1:-1]
            expected += torch.nn.functional.cross_entropy(logits, batch["labels"][0], reduction="none").numpy()
    np.testing.assert_allclose(levels, expected / len(pairs), rtol=1e-5)
    assert float(levels.mean()) == pytest.approx(task.validation_loss(model, torch.device("cpu"), None), rel=1e-6)


def test_resume_refuses_other_options_and_index(setup, tmp_path) -> None:
    index, split, tokenizer, encoder = setup
    config = TrainConfig(**{**CONFIG, "epochs": 1})
    train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "run", config, progress=False)
    with pytest.raises(RecspecError, match="other options.*lr"):
        train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "run",
              TrainConfig(**{**CONFIG, "epochs": 1, "lr": 1e-4}), progress=False)
    with pytest.raises(RecspecError, match="does not fit this model"):
        train(build_model("draft-tiny", tokenizer, hidden_size=64), SupervisedTask(encoder, split, config), tmp_path / "run", config,
              progress=False)
    with pytest.raises(RecspecError, match="selects on valid_loss"):
        train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "run", config, progress=False,
              evaluate=lambda model: {"recall@10": 0.0})

    other = ItemIndex.from_codes(index.item_keys, index.codes[:, ::-1] % 4)
    with pytest.raises(RecspecError, match="another item index"):
        load_trained(tmp_path / "run", other)
    with pytest.raises(RecspecError, match="no such folder"):
        load_trained(tmp_path / "missing", index)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecspecError, match="not a trained model folder"):
        load_trained(tmp_path / "empty", index)
    model, _ = load_trained(tmp_path / "run" / "checkpoint", index)
    assert not model.training


def test_evaluate_drives_early_stopping(setup, tmp_path) -> None:
    _, split, tokenizer, encoder = setup
    scores = iter([0.5, 0.6, 0.55, 0.58, 0.9])

    def evaluate(model):
        assert not model.training
        return {"recall@10": next(scores), "ndcg@10": 0.1}

    config = TrainConfig(**{**CONFIG, "epochs": 10, "patience": 2, "max_train_examples": 200})
    result = train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "run", config, evaluate,
                   progress=True)
    assert result.stopped == "early stop" and result.epochs_run == 4
    assert result.metric == "recall@10" and result.best_value == 0.6 and result.best_epoch == 2
    assert [row["best"] for row in result.history] == [True, True, False, False]
    assert sum(row["examples"] for row in result.history) == 4 * 200
    best = json.loads((tmp_path / "run" / "best" / "recspec.json").read_text())
    assert best["best"]["epoch"] == 2

    with pytest.raises(RecspecError, match="without 'recall@10'"):
        train(build_model("draft-tiny", tokenizer), SupervisedTask(encoder, split, config), tmp_path / "other", config,
              lambda model: {"ndcg@10": 0.0}, progress=False)


def test_batches_and_schedule() -> None:
    lengths = np.random.default_rng(0).integers(10, 90, 1000)
    batches = epoch_batches(lengths, 32, 8, seed=0, epoch=0)
    assert sorted(np.concatenate(batches).tolist()) == list(range(1000))
    assert all(np.array_equal(a, b) for a, b in zip(batches, epoch_batches(lengths, 32, 8, seed=0, epoch=0)))
    assert not all(np.array_equal(a, b) for a, b in zip(batches, epoch_batches(lengths, 32, 8, seed=0, epoch=1)))
    padding = sum(len(b) * lengths[b].max() - lengths[b].sum() for b in batches) / lengths.sum()
    assert padding < 0.1  # unbucketed: about 0.5
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)
    with pytest.raises(RecspecError, match="bad training option"):
        TrainConfig(batch_size=0)
