"""A small text draft distilled from its target (`recspec distill`), for speculative sampling,
TopK-ImpSpecDec and DSBD on the knowledge-generation prompts.

Why: a draft made of the target's own layers (:mod:`recspec.models.layer_draft`) agrees with
SmolLM2-135M-Instruct on almost nothing unless it keeps nearly all of them (`recspec bench
sampling` measures it), so the draft is trained instead.

* **Draft**: the target's architecture with ``layers`` of its decoder layers and its final norm,
  copied from the target as the starting point and trained, over the target's token embeddings
  and output layer, shared with the target and frozen (SmolLM2 ties them; they are most of a small
  model's parameters and most of its per-token cost, and keeping them makes the two vocabularies
  the same by construction).
* **Corpus**: the target's own samples (temperature 1, seeded) on knowledge prompts of MovieLens
  users and movies (:func:`recspec.knowledge.prompts.random_prompt_texts`, seed 1, so not the
  benchmark's seed-0 prompts), written to ``corpus.jsonl`` in chunks as they are made. The last
  ``valid_fraction`` of it is held out.
* **Loss**: forward KL(p || q) over the full vocabulary at every response position, with the
  target's distributions computed on the fly (nothing stored).
* **Selection**: the validation *acceptance* ``sum_v min(p, q) = 1 - TVD(p, q)``, the expected
  per-token acceptance of speculative sampling at temperature 1 (speculative_decoding.txt
  Definition 3.1 / Corollary 3.6), after every epoch; the best draft is kept in ``best/`` (a
  Hugging Face model folder with the target's tokenizer, for ``--draft``).

Training runs on the common trainer (:class:`recspec.models.train.Trainer`, with
:class:`DistillTask`): AdamW, warm-up and cosine decay, length-bucketed seeded batches, the
validation acceptance of the untrained draft logged as epoch 0, no early stopping, float32.

Resumable: ``checkpoint.{safetensors,json}`` (the draft's trainable weights and the trainer's
state: optimizer, schedule, RNG, counters, history; tensors and JSON, never a serialized object)
is written atomically every ``checkpoint_minutes``, at every epoch end, when the time budget runs
out and on Ctrl-C; a second call continues from it exactly (the epoch's batch order depends only on
``(seed, epoch)``, so steps done are skipped). ``train_log.jsonl`` holds one line per evaluation.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.decoding.prompts import left_pad
from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, atomic_path, check_writable_dir, read_json, record_checksums, write_json_atomic
from recspec.hub import keep_logits_at
from recspec.models.checkpoint import WEIGHTS_FILE
from recspec.models.layer_draft import layer_draft, parse_layers
from recspec.models.train import OneExampleRows, TrainConfig, Trainer, TrainResult, autocast
from recspec.statefile import has_state, load_state, refuse_object_files, save_state, state_files

CORPUS, CHECKPOINT, BEST, SETTINGS, DRAFT_INFO = "corpus.jsonl", "checkpoint", "best", "distill.json", "draft.json"
CHUNK = 8  # prompts sampled together (one seeded chunk of corpus.jsonl) on the CPU
DEVICE_CHUNK = 256  # on an accelerator, where a wider batch costs about what a narrow one does
ACCEPTANCE = "valid_acceptance"  # the selection metric (higher is better)
REMEDY = "delete it to start over, or choose another --out"
Pairs = list[tuple[list[int], list[int]]]  # (prompt ids, response ids) of the corpus
#: Corpus options added after runs were recorded, with the value such a run sampled with.
ADDED_CORPUS_OPTIONS = {"samples": 1}


@dataclass(frozen=True)
class CorpusConfig:
    """Distillation from the target's own samples, whatever it trains (a draft of its layers here,
    a text head in :mod:`recspec.align.text_head`): ``prompts``: corpus prompts (half users, half
    movies); ``max_new_tokens``: sampled tokens per prompt; ``samples``: texts sampled per prompt;
    ``valid_fraction``: held-out share of the corpus (whole prompts); the rest are training options."""

    prompts: int = 384
    max_new_tokens: int = 128
    samples: int = 1
    valid_fraction: float = 0.125
    epochs: int = 6
    batch_size: int = 8
    lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0

    def checks(self) -> dict[str, bool]:
        """Each option's name and whether its value is allowed."""
        return {"prompts": self.prompts >= 2 * CHUNK, "max_new_tokens": self.max_new_tokens >= 1,
                "samples": self.samples >= 1,
                "valid_fraction": 0 < self.valid_fraction < 1, "epochs": self.epochs >= 1,
                "batch_size": self.batch_size >= 1, "lr": 0 < self.lr < math.inf,
                "warmup_steps": self.warmup_steps >= 0, "weight_decay": 0 <= self.weight_decay < math.inf,
                "max_grad_norm": 0 < self.max_grad_norm < math.inf}

    def __post_init__(self) -> None:
        bad = [name for name, ok in self.checks().items() if not ok]
        if bad:
            raise RecspecError(f"bad distillation option(s): {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")

    def training(self, max_minutes: float | None, device: str = "cpu") -> TrainConfig:
        """The trainer's options: these, AdamW's default betas, float32 on ``device``, no early stop."""
        return TrainConfig(lr=self.lr, batch_size=self.batch_size, epochs=self.epochs, warmup_steps=self.warmup_steps,
                           weight_decay=self.weight_decay, betas=(0.9, 0.999), max_grad_norm=self.max_grad_norm,
                           patience=self.epochs,  # reached at the last epoch at the earliest: no early stop
                           seed=self.seed, precision="fp32", max_minutes=max_minutes, device=device)


@dataclass(frozen=True)
class DistillConfig(CorpusConfig):
    """``layers``: target layers the draft starts from (``"0,29"``); the rest as :class:`CorpusConfig`."""

    layers: str = "0,29"


def trainable_draft(target, layers: list[int]):
    """The draft over ``layers`` of ``target``: copies of those layers and of the final norm
    (trainable), the target's embeddings and output layer (shared, frozen)."""
    draft = layer_draft(target, layers)
    draft.model.layers = copy.deepcopy(draft.model.layers)
    draft.model.norm = copy.deepcopy(draft.model.norm)
    for name, parameter in draft.named_parameters():
        parameter.requires_grad_(name.startswith(("model.layers.", "model.norm.")))
    return draft


def trainable_weights(draft) -> dict[str, torch.Tensor]:
    """The draft's trainable parameters by name (all that distillation changes)."""
    return {name: parameter for name, parameter in draft.named_parameters() if parameter.requires_grad}


def load_trainable(draft, weights: dict[str, torch.Tensor]) -> None:
    """Copy the draft's trainable parameters from ``weights`` (which may hold others too)."""
    with torch.no_grad():
        for name, parameter in trainable_weights(draft).items():
            parameter.copy_(weights[name])


def _complete_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path`` up to the first one that is not a whole ``{"prompt", "response"}``
    line (an append torn by a crash, or a damaged line: from there on the corpus is redone)."""
    rows: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(row, dict) or not all(isinstance(row.get(key), list) for key in ("prompt", "response")):
            break
        rows.append(row)
    return rows


def sample_corpus(target, tokenizer, path: Path, prompts: int, max_new_tokens: int, seed: int,
                  progress: bool = True, samples: int = 1) -> Pairs:
    """``(prompt ids, sampled response ids)`` of ``prompts`` knowledge prompts, ``samples`` each
    (one after another), read from ``path`` where chunks are already there and sampled (and
    appended, one line per pair) where not. A chunk is :data:`CHUNK` texts on the CPU and
    :data:`DEVICE_CHUNK` on an accelerator."""
    from tqdm.auto import tqdm

    from recspec.data import load_dataset
    from recspec.decoding.text import SAMPLE, TextOptions, generate
    from recspec.knowledge.prompts import chat_ids, random_prompt_texts

    dataset = load_dataset("ml-100k")
    users = random_prompt_texts(dataset, "user", prompts // 2, seed=1)
    items = random_prompt_texts(dataset, "item", prompts - len(users), seed=1)
    texts = [text for pair in zip(users, items) for text in pair] + items[len(users):]
    ids = [chat_ids(tokenizer, text) for text in texts for _ in range(samples)]
    chunk_size = CHUNK if target.device.type == "cpu" else DEVICE_CHUNK
    done = _complete_rows(path)
    done = done[:len(done) - len(done) % chunk_size]  # a chunk cut short by an interruption is redone
    if [row["prompt"] for row in done] != ids[:len(done)]:
        raise RecspecError(f"{path}: made from other prompts; remove it or choose another --out")
    with atomic_path(path) as tmp:  # rewrite the complete chunks, then append
        tmp.write_text("".join(json.dumps(row) + "\n" for row in done))
    bar = tqdm(total=len(ids), initial=len(done), desc="sampling the corpus", unit="prompt", disable=not progress)
    for start in range(len(done), len(ids), chunk_size):
        chunk = ids[start:start + chunk_size]
        options = TextOptions(max_new_tokens=max_new_tokens, seed=seed * 100003 + start)
        out = generate(SAMPLE, target, None, [torch.tensor(p) for p in chunk], options,
                       tokenizer.pad_token_id, tokenizer.eos_token_id)
        rows = [{"prompt": p, "response": r} for p, r in zip(chunk, out.tokens)]
        with open(path, "a") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in rows))
        done += rows
        bar.update(len(chunk))
    bar.close()
    return [(row["prompt"], row["response"]) for row in done if row["response"]]


def pair_batch(pairs: Pairs, pad_token_id: int) -> dict[str, torch.Tensor]:
    """``(prompt, response)`` pairs as one left-padded batch: ``input_ids``, ``attention_mask``,
    ``position_ids`` of prompt + response, and ``response_lengths``."""
    padded = left_pad([torch.tensor(p + r) for p, r in pairs], pad_token_id, torch.device("cpu"))
    return {"input_ids": padded.input_ids, "attention_mask": padded.attention_mask,
            "position_ids": padded.position_ids, "response_lengths": torch.tensor([len(r) for _, r in pairs])}


def response_outputs(model, batch: dict[str, torch.Tensor], features: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The model's next-token logits at each response position of a :func:`pair_batch`: float32
    ``[b, R, V]`` (``R`` the longest response, responses right-aligned), the bool mask ``[b, R]`` of
    real positions, and with ``features`` its hidden states at every position, each ``[b, L, H]``
    (the embeddings, then every decoder layer's output, the last after the final norm: what the
    output layer reads), else None. Only the last ``R + 1`` positions reach the output layer."""
    lengths = batch["response_lengths"]
    width = int(lengths.max())
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False, output_hidden_states=features,
                **keep_logits_at(model, width + 1))
    real = torch.arange(width, device=out.logits.device)[None, :] >= width - lengths[:, None]
    return out.logits[:, -(width + 1):-1].float(), real, out.hidden_states if features else None


def response_log_probs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the next token at each response position of a :func:`pair_batch`: float32
    ``[b, R, V]`` and the bool mask ``[b, R]`` of real positions (:func:`response_outputs`)."""
    logits, real, _ = response_outputs(model, batch)
    return torch.log_softmax(logits, dim=-1), real


def position_kl(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """KL(p || q) at each real position: ``[n]``; ``p``, ``q`` log-probs ``[b, R, V]``, ``real`` ``[b, R]``."""
    return (p.exp() * (p - q)).sum(dim=-1)[real]


def forward_kl(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean over real positions of KL(p || q); ``p``, ``q`` log-probs ``[b, R, V]``, ``real`` ``[b, R]``."""
    return position_kl(p, q, real).mean()


def acceptance(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per real position ``sum_v min(p, q) = 1 - TVD(p, q)``: ``[n]``."""
    return torch.minimum(p.exp(), q.exp()).sum(dim=-1)[real]


class DraftStore:
    """Where distillation keeps the draft: ``checkpoint.{safetensors,json}`` (its trainable weights
    with the trainer's state; the frozen rest is the target's) and ``best/`` (a Hugging Face model
    folder with the target's tokenizer and ``draft.json``: ``info``, metric value and epoch)."""

    def __init__(self, out_dir: Path, tokenizer, info: dict[str, Any]) -> None:
        self.out_dir, self.tokenizer, self.info = Path(out_dir), tokenizer, info
        self.checkpoint_path, self.best_dir = state_files(out_dir, CHECKPOINT)[1], Path(out_dir) / BEST

    def read_checkpoint(self) -> dict[str, Any] | None:
        return load_state(self.out_dir, CHECKPOINT, REMEDY) if has_state(self.out_dir, CHECKPOINT) else None

    def load_checkpoint(self, model, saved: dict[str, Any]) -> None:
        load_trainable(model, saved["weights"])

    def save_checkpoint(self, model, state: dict[str, Any], info: dict[str, Any]) -> None:
        """``info`` (epoch, step) is in the trainer's ``state`` already."""
        weights = {name: parameter.detach() for name, parameter in trainable_weights(model).items()}
        save_state(self.out_dir, CHECKPOINT, {**state, "weights": weights})

    def save_best(self, model, info: dict[str, Any]) -> None:
        with atomic_dir(self.best_dir, overwrite=True) as tmp:
            model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            write_json_atomic(tmp / DRAFT_INFO, {**self.info, info["metric"]: info["value"], "epoch": info["epoch"]})
            record_checksums(tmp)

    def load_best(self, model) -> None:
        from safetensors.torch import load_file

        load_trainable(model, load_file(str(self.best_dir / WEIGHTS_FILE)))


class DistillTask(OneExampleRows):
    """Distillation as a training task: the training pairs, forward KL(p || q) of the frozen
    target's next-token distributions p against the draft's q at every response position; the
    validation pairs give the acceptance (the selection metric) and the KL."""

    def __init__(self, target, tokenizer, train: Pairs, valid: Pairs, info: dict[str, Any], batch_size: int) -> None:
        self.target, self.tokenizer, self.train, self.valid = target, tokenizer, train, valid
        self.info, self.batch_size = info, batch_size

    def lengths(self) -> np.ndarray:
        return np.array([len(prompt) + len(response) for prompt, response in self.train], dtype=np.int64)

    def check(self) -> None:
        """Nothing to check: every pair is token ids the target sampled itself."""

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        return pair_batch([self.train[i] for i in rows], self.tokenizer.pad_token_id)

    def loss(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        with torch.no_grad():
            p, real = response_log_probs(self.target, batch)
        with autocast(batch["input_ids"].device, autocast_dtype):
            q, _ = response_log_probs(model, batch)
        return forward_kl(p, q, real)

    def validation_scores(self, model) -> dict[str, float]:
        """Mean per-token acceptance (``valid_acceptance``) and KL (``valid_kl``) of the draft
        ``model`` against the target over the validation responses."""
        accepted, kl = [], []
        device = next(model.parameters()).device
        with torch.inference_mode():
            for start in range(0, len(self.valid), self.batch_size):
                batch = pair_batch(self.valid[start:start + self.batch_size], self.tokenizer.pad_token_id)
                batch = {key: value.to(device) for key, value in batch.items()}
                p, real = response_log_probs(self.target, batch)
                q, _ = response_log_probs(model, batch)
                accepted.append(acceptance(p, q, real))
                kl.append(position_kl(p, q, real))
        return {ACCEPTANCE: float(torch.cat(accepted).mean()), "valid_kl": float(torch.cat(kl).mean())}

    def validation_loss(self, model, device: torch.device, autocast_dtype: torch.dtype | None) -> float:
        """Mean KL(p || q) over the validation responses (``model``'s own device, float32)."""
        return self.validation_scores(model)["valid_kl"]

    def store(self, out_dir: Path) -> DraftStore:
        return DraftStore(out_dir, self.tokenizer, self.info)


def open_run(target_spec: str, out_dir: Path, settings: dict[str, Any], added: dict[str, Any] | None = None,
             check: Callable[[Any], Any] | None = None, device: str = "cpu"):
    """Check ``out_dir`` (no serialized objects, writable; a run already there must have had the
    same ``settings``, where a setting of ``added``, options newer than the run, counts as its
    value there when the run does not record it), load the target (frozen, on ``device``) and its
    tokenizer, run ``check(target)`` (which raises for settings the target cannot take), and only
    then record ``settings`` in it, so that a refused call leaves nothing that would refuse the
    corrected one."""
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    out_dir = Path(out_dir)
    if out_dir.is_dir():
        refuse_object_files(out_dir, REMEDY)
    check_writable_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(settings))  # as recorded: tuples are lists
    if (out_dir / SETTINGS).is_file() and {**(added or {}), **read_json(out_dir / SETTINGS)} != settings:
        raise RecspecError(f"{out_dir}: holds a distillation with other settings; choose another --out")
    target, tokenizer = load_causal_lm(target_spec, device=device), load_tokenizer(target_spec)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    if check is not None:
        check(target)
    write_json_atomic(out_dir / SETTINGS, settings)
    return target, tokenizer


def corpus_split(target, tokenizer, out_dir: Path, config: CorpusConfig, progress: bool) -> tuple[Pairs, Pairs]:
    """The corpus of ``out_dir`` (:func:`sample_corpus`), split into training and validation pairs
    at :func:`validation_cut`."""
    pairs = sample_corpus(target, tokenizer, Path(out_dir) / CORPUS, config.prompts, config.max_new_tokens,
                          config.seed, progress, config.samples)
    cut = validation_cut(pairs, config.valid_fraction)
    return pairs[:cut], pairs[cut:]


def validation_cut(pairs: Pairs, fraction: float) -> int:
    """Where the validation pairs begin: the last ``fraction`` of ``pairs`` (at least one), moved
    on past pairs of the prompt before it, so that a prompt's samples (consecutive) stay on one
    side; where that leaves no validation pair, the cut stays inside the last prompt."""
    cut = len(pairs) - max(1, round(len(pairs) * fraction))
    moved = cut
    while moved < len(pairs) and pairs[moved][0] == pairs[moved - 1][0]:
        moved += 1
    return moved if moved < len(pairs) else cut


def run_summary(result: TrainResult, train_pairs: int, valid_pairs: int, started: float) -> dict[str, Any]:
    """What a distillation call returns: how it stopped, its history, the best validation
    acceptance, the corpus split, seconds, training tokens/s and the best folder."""
    return {"stopped": result.stopped, "history": result.history, "best_acceptance": result.best_value,
            "train_pairs": train_pairs, "valid_pairs": valid_pairs, "seconds": time.perf_counter() - started,
            "tokens_per_s": result.tokens_per_s, "best_dir": str(result.best_dir)}


def distill(target_spec: str, out_dir: Path, config: DistillConfig = DistillConfig(),
            max_minutes: float | None = None, progress: bool = True) -> dict[str, Any]:
    """Sample the corpus, then train (or go on training) the draft; returns the run's summary."""
    target, tokenizer = open_run(target_spec, out_dir, {"target": str(target_spec), **asdict(config)},
                                 ADDED_CORPUS_OPTIONS)
    layers = parse_layers(config.layers, target.config.num_hidden_layers)
    train, valid = corpus_split(target, tokenizer, out_dir, config, progress)
    task = DistillTask(target, tokenizer, train, valid, {"target": str(target_spec), "layers": layers},
                       config.batch_size)
    started = time.perf_counter()
    result = Trainer(trainable_draft(target, layers), task, out_dir, config.training(max_minutes),
                     evaluate=task.validation_scores, progress=progress, metric=ACCEPTANCE, baseline=True).run()
    return run_summary(result, len(train), len(valid), started)
