"""The trainer: a causal LM trained on a :class:`TrainingTask`, resumable at step granularity.

Tasks: next-item identifiers (L_Rec, :class:`SupervisedTask`), alignment data
(:mod:`recspec.align.task`), text-draft distillation (:mod:`recspec.align.distill`). A
:class:`Trainer` is one call's run: a :class:`TrainState` of counters (saved with every
checkpoint) and the methods ``step`` / ``evaluate`` / ``checkpoint``; :func:`train` runs one.

Loss: the task's (:class:`SupervisedTask`: next-token cross-entropy on the L answer tokens only,
mean over tokens). AdamW (no decay on 1-D weights: norms, biases), linear warm-up then cosine
decay, gradient clipping, fixed seeds.

Batches: every epoch shuffles the training examples (seeded by ``(seed, epoch)``), cuts the
shuffled order into pools of ``bucket_batches`` batches, sorts each pool by sequence length and
cuts it into batches, then shuffles the batches. This keeps batches random while cutting padding
to a few percent (Beauty histories run from 1 to 20 items: 10 to 86 tokens).

Packed training (``pack`` > 1, :class:`~recspec.models.packing.PackedTask`): a row is up to
``pack`` consecutive examples of one user sharing one history, and ``batch_size`` counts rows;
logged tokens/s counts the tokens fed (the shared history once), so compare runs of different pack
sizes by examples/s.

Precision: ``precision="auto"`` trains with bfloat16 autocast (float32 master weights and
optimizer state) where the hardware does bf16 matrix products natively (CUDA with bf16, CPUs with
AVX512-BF16 / AMX), else float32 (bf16 trains the small presets faster there).

A budget in minutes is a number of examples: the logged examples/s of a first epoch (or
``python -m benchmarks.lab pack``) tells how many; choose ``max_train_examples`` /
``last_per_user`` / ``max_history``, ``pack`` and ``epochs`` to match, and keep ``max_minutes`` as
the safety stop. Other processes on the same cores slow multi-thread training far more than their
share; set ``threads=1`` on a shared machine.

Output folder of the item-identifier tasks (their model store,
:class:`~recspec.models.checkpoint.ModelFolders`; a task may bring another store)::

    out_dir/checkpoint/   model.safetensors + config.json, tokenizer + recspec.json,
                          trainer_state.{safetensors,json} (optimizer, scheduler, RNG, counters,
                          history: tensors and JSON, never a serialized object), checksums.json
    out_dir/best/         the best model so far + tokenizer + recspec.json (metric, epoch),
                          checksums.json (sha256 of every file, checked on load)
    out_dir/train_log.jsonl   one line per evaluation (normally once per epoch)

Both folders are written whole under a temporary name and renamed into place. ``train`` with an
``out_dir`` holding a checkpoint continues from it; a checkpoint is written every
``checkpoint_minutes``, at each epoch end, when the time budget runs out and on Ctrl-C (SIGINT
is deferred to the end of the running optimizer step, then the checkpoint is saved and
KeyboardInterrupt re-raised; a second Ctrl-C aborts at once, keeping the previous checkpoint).

Resume is exact on CPU: the epoch order depends only on ``(seed, epoch)``, the steps already
done in the interrupted epoch are skipped, and weights, optimizer moments, scheduler and RNG
state are restored bit for bit, so the final weights equal those of an uninterrupted run (a test
checks this in float32; bf16 autocast was checked bit-exact too on the development CPU). Limits:
on GPU, non-deterministic kernels can make them differ in the last bits (as two uninterrupted GPU
runs already do); a different thread count may change float summation order; and a run stopped
by the time budget in mid-epoch evaluates that partial epoch (logged with ``"partial": true``),
which may become the kept best model where an uninterrupted run would have kept another.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from recspec.data.splits import Examples, SplitData
from recspec.devices import resolve_device
from recspec.errors import RecspecError
from recspec.fileio import write_text_atomic
from recspec.hub import keep_logits_at
from recspec.models.checkpoint import ModelFolders
from recspec.models.examples import PromptEncoder, last_per_user, one_target_per_row, truncate_history
from recspec.statefile import changed_settings

LOG_FILE = "train_log.jsonl"
LOSS_WINDOW = 50  # optimizer steps per point of a run's training-loss curve
RECALL_METRIC, LOSS_METRIC = "recall@10", "valid_loss"


@dataclass
class TrainConfig:
    """Training options. All but ``max_minutes``, ``checkpoint_minutes`` and ``device`` fix the
    training trajectory and must not change when a run is resumed."""

    lr: float = 1e-3
    batch_size: int = 64
    epochs: int = 10
    warmup_steps: int = 200
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    max_grad_norm: float = 1.0
    patience: int = 2  # evaluations without improvement before stopping early
    seed: int = 0
    max_train_examples: int | None = None  # seeded random subsample (after last_per_user)
    last_per_user: int | None = None  # keep only each user's most recent N training examples
    max_history: int | None = None  # cut training histories to the N most recent items
    pack: int = 1  # examples of one user fed as one sequence (recspec.models.packing); 1 = one each
    bucket_batches: int = 32  # batches per length-sorted pool; 0 = plain shuffle
    precision: str = "auto"  # "auto", "bf16" or "fp32"
    max_valid_examples: int = 2048  # validation loss (when no evaluate function) on at most this many
    max_minutes: float | None = None  # training-time budget of one call (evaluation not counted)
    checkpoint_minutes: float = 5.0
    device: str = "cpu"  # "cpu", "cuda", "auto"
    threads: int | None = None  # CPU threads for training (None: torch's default, one per core)

    RESUMABLE_CHANGES = ("max_minutes", "checkpoint_minutes", "device", "threads")

    def __post_init__(self) -> None:
        checks = {
            "lr": 0 < self.lr < math.inf, "batch_size": self.batch_size >= 1, "epochs": self.epochs >= 1,
            "warmup_steps": self.warmup_steps >= 0, "weight_decay": 0 <= self.weight_decay < math.inf,
            "patience": self.patience >= 1, "bucket_batches": self.bucket_batches >= 0,
            "max_grad_norm": 0 < self.max_grad_norm < math.inf, "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "betas": len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas),
            "checkpoint_minutes": 0 < self.checkpoint_minutes < math.inf,
            "max_valid_examples": self.max_valid_examples >= 1,
            "max_train_examples": self.max_train_examples is None or self.max_train_examples >= 1,
            "last_per_user": self.last_per_user is None or self.last_per_user >= 1,
            "max_history": self.max_history is None or self.max_history >= 1,
            "pack": self.pack >= 1,
            "max_minutes": self.max_minutes is None or self.max_minutes > 0,
            "threads": self.threads is None or self.threads >= 1,
            "precision": self.precision in ("auto", "bf16", "fp32"),
            "device": self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise RecspecError(f"bad training option(s): {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")
        self.betas = tuple(self.betas)

    def trajectory(self) -> dict[str, Any]:
        """The options that determine the result (compared on resume)."""
        values = dataclasses.asdict(self)
        values["betas"] = list(values["betas"])
        return {k: v for k, v in values.items() if k not in self.RESUMABLE_CHANGES}


@dataclass
class TrainResult:
    out_dir: Path
    best_dir: Path
    metric: str  # "recall@10" (higher is better) or "valid_loss" (lower is better)
    best_value: float
    best_epoch: int
    epochs_run: int  # evaluations done, partial ones included
    steps: int
    stopped: str  # "epochs", "early stop", "time budget"
    history: list[dict[str, Any]] = field(default_factory=list)
    tokens_per_s: float = 0.0  # real (non-pad) training tokens per second, over the whole run
    examples_per_s: float = 0.0


# ---------------------------------------------------------------------- helpers

def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (None for plain float32)."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and _cpu_has_bf16() else None


def refuse_packing(config: TrainConfig, what: str) -> None:
    """Refuse ``config.pack`` above 1 for ``what``, which trains one example a row (packing is
    next-item training's: :mod:`recspec.models.packing`)."""
    if config.pack != 1:
        raise RecspecError(f"{what} trains one example a sequence; pack={config.pack} is for next-item training "
                           f"(recspec train --pack)")


def select_training_examples(examples: Examples, config: TrainConfig) -> Examples:
    """The training examples ``config`` selects: last N per user, then a seeded subsample, then
    histories cut to ``max_history``. Order is kept."""
    rows = np.arange(len(examples))
    if config.last_per_user is not None:
        rows = last_per_user(examples, config.last_per_user)
    if config.max_train_examples is not None and len(rows) > config.max_train_examples:
        rng = np.random.default_rng([config.seed, 1])
        rows = np.sort(rng.choice(rows, config.max_train_examples, replace=False))
    selected = examples if len(rows) == len(examples) else examples.subset(rows)
    if config.max_history is not None:
        selected = truncate_history(selected, config.max_history)
    return selected


def epoch_batches(lengths: np.ndarray, batch_size: int, bucket_batches: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Batches (arrays of example positions) of one epoch, length-bucketed, seeded by (seed, epoch)."""
    rng = np.random.default_rng([seed, 2, epoch])
    order = rng.permutation(len(lengths))
    if bucket_batches > 0:
        pool = batch_size * bucket_batches
        for start in range(0, len(order), pool):
            chunk = order[start:start + pool]
            order[start:start + pool] = chunk[np.argsort(lengths[chunk], kind="stable")]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if bucket_batches > 0:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``, or no context for plain float32 (``None``)."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()


def answer_loss(model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None,
                reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on the answer tokens and the float32 logits there ``[b * L, V]``.

    ``batch``: :meth:`PromptEncoder.training_batch` (left-padded, answers in the last L columns,
    ``labels`` [b, L]). Only the last ``L + 1`` positions' logits are computed where the model
    takes ``logits_to_keep`` (transformers' causal LMs do), so the output layer never runs over
    the prompt.
    """
    length = batch["labels"].shape[1]
    keep = keep_logits_at(model, length + 1)
    with autocast(batch["input_ids"].device, autocast_dtype):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False, **keep).logits
    picked = logits[:, -length - 1:-1].reshape(-1, logits.shape[-1]).float()
    loss = torch.nn.functional.cross_entropy(picked, batch["labels"].reshape(-1), reduction=reduction)
    return loss, picked


@torch.no_grad()
def level_losses(model, encoder: PromptEncoder, pairs: Examples, batch_size: int, device: torch.device,
                 autocast_dtype: torch.dtype | None = None) -> np.ndarray:
    """float64 ``[L]``: the mean cross-entropy of each identifier level's answer token over
    ``pairs`` (one target each), fed ``batch_size`` at a time in prompt-length order. A model that
    has learnt the catalogue's identifiers has a near-zero last level wherever an identifier prefix
    leaves few items."""
    if len(pairs) == 0:
        raise RecspecError("no examples to compute the answer loss on")
    order = np.argsort(encoder.prompt_lengths(pairs), kind="stable")
    total = torch.zeros(encoder.length, dtype=torch.float64)
    for start in range(0, len(order), batch_size):
        batch = {k: v.to(device) for k, v in encoder.training_batch(pairs, order[start:start + batch_size]).items()}
        loss = answer_loss(model, batch, autocast_dtype, reduction="none")[0]
        total += loss.reshape(-1, encoder.length).sum(0).double().cpu()
    return (total / len(pairs)).numpy()


class _InterruptGuard:
    """Defers SIGINT while ``deferring`` (an optimizer step, a checkpoint write) and records it."""

    def __init__(self) -> None:
        self.deferring = False
        self.requested = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> _InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: object) -> None:
        if self.deferring and not self.requested:
            self.requested = True
            return
        raise KeyboardInterrupt


class ModelStore(Protocol):
    """Where a run keeps its model: a checkpoint (the weights with the trainer's state) and the
    best model so far (:class:`~recspec.models.checkpoint.ModelFolders` for item-identifier tasks)."""

    checkpoint_path: Path  # named in messages
    best_dir: Path

    def read_checkpoint(self) -> dict[str, Any] | None:
        """The trainer's state saved with the checkpoint (checked), or None when there is none."""

    def load_checkpoint(self, model, saved: dict[str, Any]) -> None:
        """Put the checkpoint's weights into ``model`` (``saved``: what :meth:`read_checkpoint` returned)."""

    def save_checkpoint(self, model, state: dict[str, Any], info: dict[str, Any]) -> None:
        """Save ``model`` with the trainer's ``state``; ``info``: epoch and step."""

    def save_best(self, model, info: dict[str, Any]) -> None:
        """Save ``model`` as the best so far; ``info``: metric, value, epoch, step, partial."""

    def load_best(self, model) -> None:
        """Put the best model's weights into ``model``."""


class TrainingTask(Protocol):
    """What :func:`train` trains on: examples it can batch, a loss, a validation loss, and the
    store that saves the model (and, for item-identifier tasks, its tokenizer, index and prompt)."""

    def lengths(self) -> np.ndarray:
        """int64 [n]: real (non-pad) tokens of each training row, an example or a pack of them
        (bucketing, tokens/s)."""

    def examples_in(self, rows: np.ndarray) -> int:
        """Training examples in batch rows ``rows`` (a row may hold several: packed training)."""

    def check(self) -> None:
        """Raise what batching any example would raise, before training starts."""

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The tensors of training rows ``rows`` (``input_ids`` among them: padded tokens)."""

    def loss(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        """Scalar training loss of a batch (mean)."""

    def validation_loss(self, model, device: torch.device, autocast_dtype: torch.dtype | None) -> float:
        """Loss on held-out data (lower is better), used when there is no evaluate function."""

    def store(self, out_dir: Path) -> ModelStore:
        """Where the run in ``out_dir`` keeps its checkpoint and best model."""


class OneExampleRows:
    """A training task whose batch rows each hold one training example."""

    def examples_in(self, rows: np.ndarray) -> int:
        return len(rows)


class SupervisedTask(OneExampleRows):
    """Next-item training (L_Rec): ``split.train`` as selected by the config, answer-token
    cross-entropy, validation loss on (at most ``max_valid_examples``) validation pairs."""

    def __init__(self, encoder: PromptEncoder, split: SplitData, config: TrainConfig) -> None:
        self.encoder, self.split, self.config = encoder, split, config
        self.examples = select_training_examples(split.train, config)
        if len(self.examples) == 0:
            raise RecspecError("no training examples to train on")

    def lengths(self) -> np.ndarray:
        return self.encoder.prompt_lengths(self.examples) + self.encoder.length

    def check(self) -> None:
        self.encoder.check(self.examples, targets=True)

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        return self.encoder.training_batch(self.examples, rows)

    def loss(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        return answer_loss(model, batch, autocast_dtype)[0]

    @torch.no_grad()
    def validation_loss(self, model, device: torch.device, autocast_dtype: torch.dtype | None) -> float:
        """Mean answer-token cross-entropy on (at most ``max_valid_examples``) validation pairs."""
        config, encoder = self.config, self.encoder
        pairs = one_target_per_row(self.split.valid)
        if len(pairs) == 0:
            raise RecspecError("the split has no validation examples; pass an evaluate function or another split")
        if len(pairs) > config.max_valid_examples:
            rows = np.sort(np.random.default_rng([config.seed, 3]).choice(len(pairs), config.max_valid_examples,
                                                                            replace=False))
            pairs = pairs.subset(rows)
        if config.max_history is not None:
            pairs = truncate_history(pairs, config.max_history)
        return float(level_losses(model, encoder, pairs, config.batch_size, device, autocast_dtype).mean())

    def store(self, out_dir: Path) -> ModelFolders:
        return ModelFolders(out_dir, self.encoder)


# ---------------------------------------------------------------------- training

@dataclass
class TrainState:
    """A run's counters, saved with every checkpoint (as JSON, :meth:`to_json`): where it is, its
    best evaluation so far, its log and its throughput."""

    epoch: int = 0  # epochs finished
    batch_in_epoch: int = 0  # steps done in the running epoch
    step: int = 0  # optimizer steps done
    finished: bool = False
    stopped: str = ""  # why it finished: "epochs" or "early stop"
    best_value: float | None = None
    best_epoch: int = -1
    since_best: int = 0  # full-epoch evaluations since the best one
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per evaluation (train_log.jsonl)
    train_seconds: float = 0.0
    train_tokens: int = 0
    train_examples: int = 0
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0
    epoch_tokens: int = 0
    epoch_padded: int = 0
    epoch_examples: int = 0
    epoch_seconds: float = 0.0
    partial_evaluated_at: int = -1  # the step of the last time-budget (partial-epoch) evaluation
    #: training-loss curve points not yet in a log row: [step, examples trained on, mean loss of the
    #: window's examples] every LOSS_WINDOW steps (each log row carries those since the row before)
    loss_curve: list[list[float]] = field(default_factory=list)
    window_loss_sum: float = 0.0
    window_examples: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> TrainState:
        return cls(**values)

    def record_step(self, loss: float, examples: int, tokens: int, padded: int, seconds: float) -> None:
        """Count one optimizer step: its mean ``loss``, ``examples``, real and padded tokens, time."""
        self.step += 1
        self.batch_in_epoch += 1
        self.epoch_loss_sum += loss * examples
        self.epoch_loss_count += examples
        self.window_loss_sum += loss * examples
        self.window_examples += examples
        self.epoch_tokens += tokens
        self.epoch_padded += padded
        self.epoch_examples += examples
        self.epoch_seconds += seconds
        self.train_seconds += seconds
        self.train_tokens += tokens
        self.train_examples += examples
        if self.step % LOSS_WINDOW == 0:
            self.loss_curve.append([self.step, self.train_examples, self.window_loss_sum / max(1, self.window_examples)])
            self.window_loss_sum, self.window_examples = 0.0, 0

    def take_curve_points(self) -> list[list[float]]:
        """The loss-curve points recorded since the last log row (handed over: the next call has
        only newer ones)."""
        points, self.loss_curve = self.loss_curve, []
        return points

    def next_epoch(self) -> None:
        """Move to the next epoch, its counters at zero."""
        self.epoch += 1
        self.batch_in_epoch = self.epoch_loss_count = self.epoch_tokens = self.epoch_padded = self.epoch_examples = 0
        self.epoch_loss_sum = self.epoch_seconds = 0.0


#: Options added to :class:`TrainConfig` after checkpoints were written without them, with the
#: value those runs had; every other option must be in a checkpoint's saved config.
ADDED_OPTIONS = {"pack": 1}
SAVED_KEYS = ("config", "metric", "optimizer", "scheduler", "rng", "train")  # the trainer's part of a checkpoint
TRAIN_STATE_KEYS = frozenset(item.name for item in dataclasses.fields(TrainState))
#: TrainState counters added after checkpoints were written without them (they resume at their default)
ADDED_STATE = frozenset({"loss_curve", "window_loss_sum", "window_examples"})


def build_optimizer(model, config: TrainConfig, total_steps: int
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters (no decay on 1-D ones: norms, biases) and its schedule."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=config.betas)
    warmup = min(config.warmup_steps, total_steps // 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, warmup, total_steps, config.min_lr_ratio))
    return optimizer, scheduler


class Trainer:
    """One call's training of ``model`` on ``task`` into ``out_dir`` (see the module docstring and
    :func:`train`, which runs it); ``baseline``: evaluate the untrained model first, logged as
    epoch 0 and never kept as the best."""

    def __init__(self, model, task: TrainingTask, out_dir: Path, config: TrainConfig | None = None,
                 evaluate: Callable[[Any], dict[str, float]] | None = None, progress: bool = True,
                 callback: Callable[[dict[str, Any]], None] | None = None, metric: str = RECALL_METRIC,
                 baseline: bool = False) -> None:
        self.config = config = config or TrainConfig()
        self.model, self.task, self.out_dir, self.store = model, task, Path(out_dir), task.store(Path(out_dir))
        self.evaluate_fn, self.progress, self.callback, self.baseline = evaluate, progress, callback, baseline
        self.device = resolve_device(config.device)
        self.autocast_dtype = resolve_precision(config.precision, self.device)
        self.metric = metric if evaluate is not None else LOSS_METRIC
        self.lengths = task.lengths()
        self.steps_per_epoch = math.ceil(len(self.lengths) / config.batch_size)
        task.check()  # fail now, not in the middle of an epoch
        model.to(self.device)
        self.optimizer, self.scheduler = build_optimizer(model, config, self.steps_per_epoch * config.epochs)
        self.state = TrainState()
        self.guard = _InterruptGuard()
        self.consistent = True  # False only while an optimizer step is half done
        self.saving = False  # True while a checkpoint is written
        self.budget = None if config.max_minutes is None else config.max_minutes * 60.0
        self.call_seconds = 0.0  # training time of this call (the budget counts it)
        self.last_checkpoint = 0.0

    def run(self) -> TrainResult:
        """Resume or start, train until the run ends or this call's budget runs out, checkpoint;
        returns with the best weights loaded into the model. Ctrl-C: checkpoint, then
        KeyboardInterrupt saying where it is."""
        self.resume()
        threads_before = torch.get_num_threads()
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.model.train()
        try:
            with self.guard:
                self.train_epochs()
        except KeyboardInterrupt:
            if self.consistent and not self.saving:
                self.checkpoint()
                raise KeyboardInterrupt(f"checkpoint saved at epoch {self.state.epoch + 1}, step {self.state.step} "
                                        f"in {self.store.checkpoint_path}; run again with the same output folder to "
                                        f"resume") from None
            raise
        finally:
            torch.set_num_threads(threads_before)
        return self.result()

    def resume(self) -> None:
        """Continue from the store's checkpoint (trained with the same options and metric), or seed
        a fresh run."""
        saved, where = self.store.read_checkpoint(), self.store.checkpoint_path
        if saved is None:
            torch.manual_seed(self.config.seed)
        else:
            if any(key not in saved for key in SAVED_KEYS) or not (
                    TRAIN_STATE_KEYS - ADDED_STATE <= set(saved["train"]) <= TRAIN_STATE_KEYS):
                raise RecspecError(f"{where}: not a checkpoint of this trainer; delete it to start over, or choose "
                                   f"another output folder")
            before = {**ADDED_OPTIONS, **saved["config"]}  # options added since then had their default
            shown = changed_settings(before, self.config.trajectory())
            if shown:
                raise RecspecError(f"{where}: the checkpoint was trained with other options ({shown}); "
                                   f"resume with the same options or choose another output folder")
            if saved["metric"] != self.metric:
                raise RecspecError(f"{where}: the run selects on {saved['metric']}, this call on {self.metric}; "
                                   f"resume with the same selection (evaluate function and metric)")
            self.store.load_checkpoint(self.model, saved)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            torch.set_rng_state(saved["rng"]["torch"])
            if self.device.type == "cuda" and saved["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(saved["rng"]["cuda"], self.device)
            self.state = TrainState.from_json(saved["train"])
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def train_epochs(self) -> None:
        """Epochs until the run is finished or this call's time budget runs out."""
        if self.baseline and self.state.step == 0 and not self.state.history:
            self.evaluate_baseline()
        self.last_checkpoint = time.perf_counter()
        while not self.state.finished:
            if self.state.batch_in_epoch >= self.steps_per_epoch:
                self.end_epoch()
            elif self.run_epoch():
                self.stop_for_budget()
                return

    def run_epoch(self) -> bool:
        """Train the rest of the current epoch (checkpoints every ``checkpoint_minutes``); True when
        this call's time budget ran out in it."""
        state, config = self.state, self.config
        batches = epoch_batches(self.lengths, config.batch_size, config.bucket_batches, config.seed, state.epoch)
        bar = self.progress_bar()
        try:
            for rows in batches[state.batch_in_epoch:]:
                loss = self.step(rows)
                if bar is not None:
                    bar.update(1)
                    speed = state.epoch_tokens / max(state.epoch_seconds, 1e-9)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed:.0f}", refresh=False)
                if self.callback is not None:
                    self.callback({"epoch": state.epoch, "step": state.step, "batch_in_epoch": state.batch_in_epoch,
                                   "loss": loss})
                if self.guard.requested:
                    raise KeyboardInterrupt
                if self.budget is not None and self.call_seconds >= self.budget:
                    return True
                if time.perf_counter() - self.last_checkpoint >= config.checkpoint_minutes * 60.0:
                    self.checkpoint()
                    self.after_deferred()
                    self.last_checkpoint = time.perf_counter()
        finally:
            if bar is not None:
                bar.close()
        return False

    def step(self, rows: np.ndarray) -> float:
        """One optimizer step on training rows ``rows`` (SIGINT deferred to its end); its loss."""
        started = time.perf_counter()
        examples = self.task.examples_in(rows)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in self.task.batch(rows).items()}
        self.guard.deferring = True
        self.consistent = False
        loss = self.task.loss(self.model, batch, self.autocast_dtype)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        loss_value = float(loss.detach())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        self.state.record_step(loss_value, examples, int(self.lengths[rows].sum()), int(batch["input_ids"].numel()),
                               seconds)
        self.call_seconds += seconds
        self.consistent = True
        self.guard.deferring = False
        return loss_value

    def scores(self) -> dict[str, float]:
        """The evaluate function's scores of the model (eval mode, no grad), or the task's
        validation loss."""
        self.model.eval()
        with torch.no_grad():
            if self.evaluate_fn is not None:
                scores = {k: float(v) for k, v in self.evaluate_fn(self.model).items()}
                if self.metric not in scores:
                    raise RecspecError(f"the evaluate function returned {sorted(scores)}, without {self.metric!r}")
            else:
                scores = {LOSS_METRIC: self.task.validation_loss(self.model, self.device, self.autocast_dtype)}
        self.model.train()
        return scores

    def evaluate(self, partial: bool) -> None:
        """Evaluate, log, keep the best; counts toward patience unless ``partial``. SIGINT stays
        deferred (the bookkeeping and the checkpoint after it run to the end)."""
        started = time.perf_counter()
        scores = self.scores()
        self.guard.deferring = True
        state, value = self.state, scores[self.metric]
        best = state.best_value
        improved = best is None or (value > best if self.evaluate_fn is not None else value < best)
        row = self.log_row(partial, scores, improved, started, state.take_curve_points())
        if improved:
            self.store.save_best(self.model, {"metric": self.metric, "value": value, "epoch": state.epoch + 1,
                                              "step": state.step, "partial": partial})
            state.best_value, state.best_epoch = value, state.epoch + 1
        if not partial:
            state.since_best = 0 if improved else state.since_best + 1
        self.write_log(row)

    def log_row(self, partial: bool, scores: dict[str, float], improved: bool, started: float,
                curve: list[list[float]]) -> dict[str, Any]:
        """The log row of an evaluation of the current epoch (begun at ``started``), carrying the
        loss-curve points ``curve`` recorded since the previous row."""
        state, seconds = self.state, self.state.epoch_seconds
        return {"epoch": state.epoch + 1, "partial": partial, "step": state.step,
                "batches": state.batch_in_epoch, "of_batches": self.steps_per_epoch,
                "train_loss": state.epoch_loss_sum / max(1, state.epoch_loss_count),
                "lr": self.scheduler.get_last_lr()[0], **scores, "best": improved,
                "examples": state.epoch_examples, "tokens": state.epoch_tokens,
                "padded_tokens": state.epoch_padded, "train_seconds": round(seconds, 3),
                "tokens_per_s": state.epoch_tokens / seconds if seconds else 0.0,
                "examples_per_s": state.epoch_examples / seconds if seconds else 0.0,
                "loss_curve": curve, "eval_seconds": round(time.perf_counter() - started, 3)}

    def evaluate_baseline(self) -> None:
        """Log the untrained model's scores as epoch 0."""
        started = time.perf_counter()
        scores = self.scores()
        self.write_log({"epoch": 0, "baseline": True, "step": 0, **scores,
                        "eval_seconds": round(time.perf_counter() - started, 3)})

    def write_log(self, row: dict[str, Any]) -> None:
        """Append ``row`` to the history and rewrite ``train_log.jsonl``."""
        self.state.history.append(row)
        write_text_atomic(self.out_dir / LOG_FILE, "".join(json.dumps(row) + "\n" for row in self.state.history))

    def end_epoch(self) -> None:
        """Evaluate the finished epoch, move to the next, decide whether the run is over, checkpoint."""
        self.evaluate(partial=False)
        state = self.state
        state.next_epoch()
        if state.epoch >= self.config.epochs:
            state.finished, state.stopped = True, "epochs"
        elif state.since_best >= self.config.patience:
            state.finished, state.stopped = True, "early stop"
        self.checkpoint()
        self.after_deferred()

    def stop_for_budget(self) -> None:
        """The time budget ran out: evaluate a partial epoch (once), checkpoint."""
        state = self.state
        if state.batch_in_epoch < self.steps_per_epoch and state.partial_evaluated_at != state.step:
            self.evaluate(partial=True)
            state.partial_evaluated_at = state.step
        self.checkpoint()
        self.after_deferred()

    def checkpoint(self) -> None:
        """Save the model with the optimizer, schedule, RNG and counters (SIGINT deferred meanwhile)."""
        was = self.guard.deferring
        self.guard.deferring = self.saving = True
        try:
            rng = {"torch": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
            state = {"config": self.config.trajectory(), "metric": self.metric,
                     "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "rng": rng,
                     "train": self.state.to_json()}
            self.store.save_checkpoint(self.model, state, {"epoch": self.state.epoch, "step": self.state.step})
        finally:
            self.guard.deferring = was
            self.saving = False

    def after_deferred(self) -> None:
        """End a deferral of SIGINT, raising the KeyboardInterrupt that came meanwhile."""
        self.guard.deferring = False
        if self.guard.requested:
            raise KeyboardInterrupt

    def progress_bar(self):
        """The current epoch's progress bar (None without progress)."""
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.steps_per_epoch, initial=self.state.batch_in_epoch, desc=f"epoch {self.state.epoch + 1}",
                    unit="batch", dynamic_ncols=True, leave=False)

    def result(self) -> TrainResult:
        """The run's result, the best weights loaded into the model."""
        state = self.state
        if state.best_value is not None:
            self.store.load_best(self.model)
        seconds = state.train_seconds
        return TrainResult(
            out_dir=self.out_dir, best_dir=self.store.best_dir, metric=self.metric,
            best_value=float("nan") if state.best_value is None else float(state.best_value),
            best_epoch=state.best_epoch, epochs_run=sum(not row.get("baseline") for row in state.history),
            steps=state.step, stopped=state.stopped if state.finished else "time budget", history=list(state.history),
            tokens_per_s=state.train_tokens / seconds if seconds else 0.0,
            examples_per_s=state.train_examples / seconds if seconds else 0.0,
        )


def train(model, task: TrainingTask, out_dir: Path, config: TrainConfig | None = None,
          evaluate: Callable[[Any], dict[str, float]] | None = None, progress: bool = True,
          callback: Callable[[dict[str, Any]], None] | None = None, metric: str = RECALL_METRIC) -> TrainResult:
    """Train ``model`` on ``task`` (see the module docstring); returns with the best weights
    loaded into ``model``.

    evaluate: called with the model (eval mode, no grad) after every epoch; must return a dict with
    ``metric`` (higher is better; early stopping and the best model follow it). Without it, the
    task's validation loss is used (lower is better).
    callback: called after every optimizer step with a dict of counters (epoch, step, loss); a
    KeyboardInterrupt raised there stops training like Ctrl-C (checkpoint first).
    """
    return Trainer(model, task, out_dir, config, evaluate, progress, callback, metric).run()
