"""Training a generative recommender end to end: data set -> identifiers -> tokenizer -> preset
model -> supervised training with validation Recall@10 (trie-constrained beam search)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from recspec.data import Dataset, load_dataset, split_dataset
from recspec.data.loaders import recorded_spec
from recspec.data.splits import SplitData
from recspec.errors import RecspecError
from recspec.fileio import check_writable_dir
from recspec.eval.metrics import recall_ndcg
from recspec.itemids.build import dataset_identifiers
from recspec.models.examples import PromptEncoder, one_target_per_row
from recspec.models.presets import build_model, preset_template, preset_tokenizer
from recspec.models.tokenizer import identifier_token_ids
from recspec.models.checkpoint import CHECKPOINT_DIR, write_run_info
from recspec.models.run_data import ServingData
from recspec.models.packing import next_item_task
from recspec.models.train import TrainConfig, TrainResult, level_losses, train
from recspec.recommend import item_rows
from recspec.statefile import has_state


def prepare_training_dir(out_dir: Path, overwrite: bool) -> Path:
    """``out_dir`` for a training run: resumed if it holds a checkpoint (a model's ``checkpoint/``
    folder, or a head's ``checkpoint.{safetensors,json}`` state), else it must be empty or absent
    (an occupied folder is replaced only with ``overwrite``)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RecspecError(f"{out_dir}: is a file; --out takes a folder")
    check_writable_dir(out_dir)
    resuming = (out_dir / CHECKPOINT_DIR).is_dir() or has_state(out_dir, CHECKPOINT_DIR)
    if out_dir.exists() and any(out_dir.iterdir()) and not resuming:
        if not overwrite:
            raise RecspecError(f"{out_dir}: already exists and holds no checkpoint to resume; "
                               f"choose another --out or pass --overwrite")
        shutil.rmtree(out_dir)
    return out_dir


def training_data(dataset_spec: str, preset: str, ids: str | Path | None = None, format: str | None = None,
                  split_kind: str | None = None, max_history: int = 20,
                  short_prompt: bool = False) -> tuple[Dataset, SplitData, PromptEncoder]:
    """What training ``preset`` on ``dataset_spec`` reads: the data set, its split, and the prompt
    encoder over its identifiers (``ids``, default the data set's own) and the preset's tokenizer
    (with its short prompt if ``short_prompt``)."""
    dataset = load_dataset(dataset_spec, format)
    split = split_dataset(dataset, split_kind, max_history)
    index = dataset_identifiers(dataset, ids)
    tokenizer = preset_tokenizer(preset, index)
    return dataset, split, PromptEncoder(index, dataset.item_ids, tokenizer,
                                         preset_template(preset, tokenizer, short_prompt))


def fit(dataset_spec: str, out_dir: Path, preset: str, ids: str | Path | None = None, format: str | None = None,
        split_kind: str | None = None, max_history: int = 20, config: TrainConfig | None = None,
        valid_users: int = 512, overwrite: bool = False, progress: bool = True,
        short_prompt: bool = False) -> TrainResult:
    """Train ``preset`` on ``dataset_spec`` into ``out_dir`` (resuming a checkpoint found there);
    ``short_prompt``: an LLM preset's short prompt (:data:`~recspec.models.presets.LLM_SHORT`).

    Validation: Recall@10 / NDCG@10 of tree-attention beam search (K = 10) on the first
    ``valid_users`` validation users after every epoch; the best epoch's weights are kept. Each
    evaluation also logs the answer loss per identifier level on those users (``loss_level_1`` ..):
    a model that has learnt the catalogue's identifiers has a small last level.
    """
    from recspec.decoding import tree_beam_search

    out_dir = prepare_training_dir(out_dir, overwrite)
    config = config or TrainConfig()
    dataset, split, encoder = training_data(dataset_spec, preset, ids, format, split_kind, max_history, short_prompt)
    index, tokenizer = encoder.index, encoder.tokenizer
    write_run_info(out_dir, index, {"dataset": recorded_spec(dataset_spec), "format": format, "split": split.kind,
                                    "max_history": max_history, "preset": preset,
                                    "prompt": encoder.template.to_json()},  # a resume's settings checked first
                   ServingData.from_split(dataset, split))
    model = build_model(preset, tokenizer, seed=config.seed)
    trie = index.trie(identifier_token_ids(tokenizer, index), vocab_size=len(tokenizer))
    valid = split.valid.subset(np.arange(min(valid_users, len(split.valid))))
    if len(valid) == 0:
        raise RecspecError(f"dataset {dataset.name}: the {split.kind} split has no validation users")
    prompts = encoder.prompts(valid)
    targets = [valid.targets(i) for i in range(len(valid))]
    table = item_rows(dataset.item_ids, index.item_keys)

    pairs = one_target_per_row(valid)

    def evaluate(model: Any) -> dict[str, float]:
        device = next(model.parameters()).device
        topk = tree_beam_search(model, prompts, trie.to(device), 10, encoder.pad_id, batch_size=32)
        rows = topk.items.cpu().numpy()
        losses = level_losses(model, encoder, pairs, 32, device)
        return {**recall_ndcg(np.where(rows >= 0, table[rows.clip(0)], -1), targets, [10]),
                **{f"loss_level_{j + 1}": float(value) for j, value in enumerate(losses)}}

    return train(model, next_item_task(encoder, split, config), out_dir, config, evaluate=evaluate, progress=progress)

