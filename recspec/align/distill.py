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

Resumable: ``checkpoint.{safetensors,json}`` (trainable weights, optimizer, schedule, epoch and
step, history; tensors and JSON, never a serialized object) is written atomically at every epoch end and
when the time budget runs out; a second call continues
from it (the epoch's batch order depends only on ``(seed, epoch)``, so steps done are skipped).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.decoding.beam import left_pad
from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, atomic_path, check_writable_dir, read_json, record_checksums, write_json_atomic
from recspec.hub import keep_last_logits
from recspec.models.layer_draft import layer_draft, parse_layers
from recspec.models.train import TrainConfig, lr_lambda
from recspec.statefile import has_state, load_state, refuse_object_files, save_state

CORPUS, CHECKPOINT, BEST, SETTINGS, DRAFT_INFO = "corpus.jsonl", "checkpoint", "best", "distill.json", "draft.json"
CHUNK = 8  # prompts sampled together (one seeded chunk of corpus.jsonl)


@dataclass(frozen=True)
class DistillConfig:
    """``layers``: target layers the draft starts from (``"0,29"``); ``prompts``: corpus prompts
    (half users, half movies); ``max_new_tokens``: sampled tokens per prompt; ``valid_fraction``:
    held-out share of the corpus; the rest are training options."""

    layers: str = "0,29"
    prompts: int = 384
    max_new_tokens: int = 128
    valid_fraction: float = 0.125
    epochs: int = 6
    batch_size: int = 8
    lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {"prompts": self.prompts >= 2 * CHUNK, "max_new_tokens": self.max_new_tokens >= 1,
                  "valid_fraction": 0 < self.valid_fraction < 1, "epochs": self.epochs >= 1,
                  "batch_size": self.batch_size >= 1, "lr": 0 < self.lr < math.inf,
                  "warmup_steps": self.warmup_steps >= 0, "weight_decay": 0 <= self.weight_decay < math.inf,
                  "max_grad_norm": 0 < self.max_grad_norm < math.inf}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise RecspecError(f"bad distillation option(s): {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


def trainable_draft(target, layers: list[int]):
    """The draft over ``layers`` of ``target``: copies of those layers and of the final norm
    (trainable), the target's embeddings and output layer (shared, frozen)."""
    draft = layer_draft(target, layers)
    draft.model.layers = copy.deepcopy(draft.model.layers)
    draft.model.norm = copy.deepcopy(draft.model.norm)
    for name, parameter in draft.named_parameters():
        parameter.requires_grad_(name.startswith(("model.layers.", "model.norm.")))
    return draft


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
                  progress: bool = True) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, sampled response ids)`` of ``prompts`` knowledge prompts, read from ``path``
    where chunks are already there and sampled (and appended, one line per pair) where not."""
    from tqdm.auto import tqdm

    from recspec.data import load_dataset
    from recspec.decoding.text_sampling import TextOptions, generate
    from recspec.knowledge.prompts import chat_ids, random_prompt_texts

    dataset = load_dataset("ml-100k")
    users = random_prompt_texts(dataset, "user", prompts // 2, seed=1)
    items = random_prompt_texts(dataset, "item", prompts - len(users), seed=1)
    texts = [text for pair in zip(users, items) for text in pair] + items[len(users):]
    ids = [chat_ids(tokenizer, text) for text in texts]
    done = _complete_rows(path)
    done = done[:len(done) - len(done) % CHUNK]  # a chunk cut short by an interruption is redone
    if [row["prompt"] for row in done] != ids[:len(done)]:
        raise RecspecError(f"{path}: made from other prompts; remove it or choose another --out")
    with atomic_path(path) as tmp:  # rewrite the complete chunks, then append
        tmp.write_text("".join(json.dumps(row) + "\n" for row in done))
    bar = tqdm(total=len(ids), initial=len(done), desc="sampling the corpus", unit="prompt", disable=not progress)
    for start in range(len(done), len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        options = TextOptions(max_new_tokens=max_new_tokens, seed=seed * 100003 + start)
        out = generate("sample", target, None, [torch.tensor(p) for p in chunk], options,
                       tokenizer.pad_token_id, tokenizer.eos_token_id)
        rows = [{"prompt": p, "response": r} for p, r in zip(chunk, out.tokens)]
        with open(path, "a") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in rows))
        done += rows
        bar.update(len(chunk))
    bar.close()
    return [(row["prompt"], row["response"]) for row in done if row["response"]]


def response_log_probs(model, pairs: list[tuple[list[int], list[int]]], pad_token_id: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the next token at each response position of each ``(prompt, response)``:
    float32 ``[b, R, V]`` (``R`` the longest response, responses right-aligned) and the bool mask
    ``[b, R]`` of real positions. Only the last ``R + 1`` positions reach the output layer."""
    width = max(len(response) for _, response in pairs)
    batch = left_pad([torch.tensor(p + r) for p, r in pairs], pad_token_id, next(model.parameters()).device)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   use_cache=False, **keep_last_logits(model, width + 1)).logits[:, -(width + 1):-1]
    lengths = torch.tensor([len(r) for _, r in pairs], device=logits.device)
    real = torch.arange(width, device=logits.device)[None, :] >= width - lengths[:, None]
    return torch.log_softmax(logits.float(), dim=-1), real


def forward_kl(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean over real positions of KL(p || q); ``p``, ``q`` log-probs ``[b, R, V]``, ``real`` ``[b, R]``."""
    kl = (p.exp() * (p - q)).sum(dim=-1)
    return kl[real].mean()


def acceptance(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per real position ``sum_v min(p, q) = 1 - TVD(p, q)``: ``[n]``."""
    return torch.minimum(p.exp(), q.exp()).sum(dim=-1)[real]


def validation_acceptance(target, draft, pairs, pad_token_id: int, batch_size: int) -> float:
    """Mean per-token acceptance of ``draft`` against ``target`` over the responses of ``pairs``."""
    values = []
    with torch.inference_mode():
        for start in range(0, len(pairs), batch_size):
            part = pairs[start:start + batch_size]
            p, real = response_log_probs(target, part, pad_token_id)
            q, _ = response_log_probs(draft, part, pad_token_id)
            values.append(acceptance(p, q, real))
    return float(torch.cat(values).mean())


def _save_best(path: Path, draft, tokenizer, info: dict[str, Any]) -> None:
    with atomic_dir(path, overwrite=True) as tmp:
        draft.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / DRAFT_INFO, info)
        record_checksums(tmp)


def distill(target_spec: str, out_dir: Path, config: DistillConfig = DistillConfig(),
            max_minutes: float | None = None, progress: bool = True) -> dict[str, Any]:
    """Sample the corpus, then train (or go on training) the draft; returns the run's summary."""
    from tqdm.auto import tqdm

    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    out_dir = Path(out_dir)
    remedy = "delete it to start over, or choose another --out"
    if out_dir.is_dir():
        refuse_object_files(out_dir, remedy)
    check_writable_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"target": str(target_spec), **asdict(config)}
    if (out_dir / SETTINGS).is_file() and read_json(out_dir / SETTINGS) != settings:
        raise RecspecError(f"{out_dir}: holds a distillation with other settings; choose another --out")
    write_json_atomic(out_dir / SETTINGS, settings)
    target, tokenizer = load_causal_lm(target_spec), load_tokenizer(target_spec)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    layers = parse_layers(config.layers, target.config.num_hidden_layers)
    pairs = sample_corpus(target, tokenizer, out_dir / CORPUS, config.prompts, config.max_new_tokens, config.seed,
                          progress)
    cut = len(pairs) - max(1, round(len(pairs) * config.valid_fraction))
    train, valid = pairs[:cut], pairs[cut:]
    torch.manual_seed(config.seed)
    draft = trainable_draft(target, layers).train()
    trainable = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() > 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0}],
                                  lr=config.lr)
    steps_per_epoch = math.ceil(len(train) / config.batch_size)
    total = steps_per_epoch * config.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, config.warmup_steps, total, TrainConfig.min_lr_ratio))
    state = {"epoch": 0, "step_in_epoch": 0, "history": [], "best": -1.0}
    if has_state(out_dir, CHECKPOINT):
        saved = load_state(out_dir, CHECKPOINT, remedy)
        draft.load_state_dict(saved["weights"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = saved["state"]
    else:
        state["history"].append({"epoch": 0, "valid_acceptance": validation_acceptance(
            target, draft, valid, tokenizer.pad_token_id, config.batch_size)})

    def checkpoint() -> None:
        weights = {name: p.detach() for name, p in draft.named_parameters() if p.requires_grad}
        save_state(out_dir, CHECKPOINT, {"weights": weights, "optimizer": optimizer.state_dict(),
                                         "scheduler": scheduler.state_dict(), "state": state})

    started, stopped = time.perf_counter(), "epochs"
    tokens = 0
    while state["epoch"] < config.epochs:
        epoch = state["epoch"]
        order = np.random.default_rng([config.seed, epoch]).permutation(len(train))
        batches = [order[i:i + config.batch_size] for i in range(0, len(order), config.batch_size)]
        bar = tqdm(total=len(batches), initial=state["step_in_epoch"], desc=f"distilling (epoch {epoch + 1})",
                   unit="step", disable=not progress)
        for rows in batches[state["step_in_epoch"]:]:
            part = [train[i] for i in rows]
            with torch.no_grad():
                p, real = response_log_probs(target, part, tokenizer.pad_token_id)
            q, _ = response_log_probs(draft, part, tokenizer.pad_token_id)
            loss = forward_kl(p, q, real)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            tokens += int(real.sum())
            state["step_in_epoch"] += 1
            bar.update(1)
            bar.set_postfix(kl=f"{loss.item():.3f}")
            if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                stopped = "time budget"
                break
        bar.close()
        partial = state["step_in_epoch"] < len(batches)
        if not partial:
            state["epoch"], state["step_in_epoch"] = epoch + 1, 0
        draft.eval()
        value = validation_acceptance(target, draft, valid, tokenizer.pad_token_id, config.batch_size)
        draft.train()
        state["history"].append({"epoch": epoch + 1, "partial": partial, "valid_acceptance": value,
                                 "train_kl": loss.item()})
        if value > state["best"]:
            state["best"] = value
            _save_best(out_dir / BEST, draft, tokenizer, {"target": str(target_spec), "layers": layers,
                                                           "valid_acceptance": value, "epoch": epoch + 1})
        checkpoint()
        if stopped != "epochs":
            break
    seconds = time.perf_counter() - started
    return {"stopped": stopped, "history": state["history"], "best_acceptance": state["best"],
            "train_pairs": len(train), "valid_pairs": len(valid), "seconds": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9), "best_dir": str(out_dir / BEST)}
