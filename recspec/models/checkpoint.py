"""Trained model folders: writing and reading them (not training them).

A training run's ``out_dir`` holds ``best/`` and ``checkpoint/`` model folders (Hugging Face
weights and config, the tokenizer with ``recspec.json``, ``checksums.json``; the checkpoint also
the trainer's state, :mod:`recspec.statefile`), and beside them ``item_index.json`` and
``run.json`` (the data set, format, split and history cap it was trained with) and ``serving.json``
(what serving needs of the data set: :mod:`recspec.models.run_data`), listed with their sha256 in
the ``out_dir``'s own ``checksums.json``. Every folder is written whole under a temporary name and
checked against its checksums when it is read, and a listing must name every file that decides
the model's answers (:data:`MODEL_FILES`, :data:`RUN_FILES`, and ``serving.json`` where present):
one that leaves such a file out is refused, not trusted for what it omits. A training folder
written before recspec listed its run files is refused with a line naming ``recspec upgrade``,
which lists them (:func:`upgrade_run_dir`) after checking its model folder, and writes the
``serving.json`` of a folder written before recspec kept one, from the data set it was trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from recspec.accel import accelerate
from recspec.errors import RecspecError
from recspec.fileio import CHECKSUMS, atomic_dir, read_json, record_checksums, sha256_file, verify_checksums, write_json_atomic
from recspec.hub import check_finite_weights, loading_errors
from recspec.itemids.index import ItemIndex
from recspec.models.examples import PromptEncoder
from recspec.models.run_data import SERVING_FILE, ServingData, recorded_dataset, run_split
from recspec.models.tokenizer import (RECSPEC_JSON, check_index, identifier_token_ids, index_fingerprint,
                                      load_tokenizer_dir, read_metadata, save_tokenizer)
from recspec.statefile import changed_settings, has_state, load_state, refuse_object_files, save_state

CHECKPOINT_DIR, BEST_DIR, STATE_NAME, WEIGHTS_FILE = "checkpoint", "best", "trainer_state", "model.safetensors"
RUN_FILE, INDEX_FILE = "run.json", "item_index.json"
#: The files beside ``best/`` that decide a trained model's answers (its item identifiers; its data
#: set, split and history cap), listed in the training folder's ``checksums.json``.
RUN_FILES = (INDEX_FILE, RUN_FILE)
#: The run files a listing must name where the folder holds them: ``serving.json``, which folders
#: written before recspec kept one lack (:func:`upgrade_run_dir` adds it).
RUN_FILES_IF_PRESENT = (SERVING_FILE,)
#: The files of a model folder that decide its answers (weights, architecture, tokenizer, item
#: index fingerprint and prompt template in ``recspec.json``): its listing must name each.
MODEL_FILES = ("config.json", WEIGHTS_FILE, RECSPEC_JSON)
#: Files transformers reads from a model folder where present (generation settings, tokenizer): a
#: listing must name each one the folder holds.
MODEL_FILES_IF_PRESENT = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MODEL_REMEDY = "the model folder is damaged; train it again or restore it from a copy"
RUN_REMEDY = "the training folder is damaged; train it again or restore it from a copy"


def write_run_info(out_dir: Path, index: ItemIndex, info: dict[str, Any], serving: ServingData | None = None) -> None:
    """Record the index, the data set / split a model is trained on and its ``serving`` data (what
    it answers raw histories with, without the data set; None: none kept, as for a draft trained
    on alignment data, which serves beside its target), beside its checkpoints, all listed.

    A folder that already records a run (a training being resumed) must record the same one: the
    same item index and the same value for every key both records have (data set, split, history
    cap, preset, prompt, alignment method ...); otherwise :class:`RecspecError` names what differs
    and nothing is written, so a resume never continues a checkpoint on other data silently.
    """
    if (out_dir / RUN_FILE).is_file() and (out_dir / INDEX_FILE).is_file():
        shown = changed_settings(read_json(out_dir / RUN_FILE), info)
        if index_fingerprint(ItemIndex.load(out_dir / INDEX_FILE)) != index_fingerprint(index):
            shown = ", ".join(filter(None, (shown, f"{INDEX_FILE}: other item identifiers")))
        if shown:
            raise RecspecError(f"{out_dir}: holds a run trained otherwise ({shown}); resume it with the same "
                               "settings, or train into another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    index.save(out_dir / INDEX_FILE)
    write_json_atomic(out_dir / RUN_FILE, info)
    if serving is not None:
        serving.save(out_dir)
    record_checksums(out_dir, run_files(out_dir))


def run_folder(model_dir: Path) -> Path:
    """The training folder of ``model_dir``: itself or its parent (for ``best/``), whichever holds
    ``run.json`` and ``item_index.json``."""
    for folder in (model_dir, model_dir.parent):
        if (folder / RUN_FILE).is_file() and (folder / INDEX_FILE).is_file():
            return folder
    raise RecspecError(f"{model_dir}: no {RUN_FILE} / {INDEX_FILE}; not a folder written by `recspec train`")


def verify_run_files(folder: Path) -> None:
    """Check the training folder's ``run.json``, ``item_index.json`` and ``serving.json`` (where it
    has one) against its ``checksums.json``, which must list each; a folder without that listing
    (written before recspec kept one) is refused with a line naming ``recspec upgrade``."""
    if not (folder / CHECKSUMS).is_file():
        raise RecspecError(f"{folder}: no {CHECKSUMS} covers its {RUN_FILE} and {INDEX_FILE} (a folder written by an "
                           f"earlier recspec); run `recspec upgrade {folder}` once to check and list them")
    verify_checksums(folder, RUN_REMEDY, run_files(folder))


def run_files(folder: Path) -> tuple[str, ...]:
    """The run files of a training ``folder`` its listing must name: :data:`RUN_FILES` and those of
    :data:`RUN_FILES_IF_PRESENT` it holds."""
    return (*RUN_FILES, *(name for name in RUN_FILES_IF_PRESENT if (folder / name).exists()))


def run_info(model_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The training folder of ``model_dir`` (itself or its parent, for ``best/``) and its ``run.json``,
    both run files checked against the folder's listing first (:func:`verify_run_files`)."""
    folder = run_folder(model_dir)
    verify_run_files(folder)
    return folder, read_json(folder / RUN_FILE)


def upgrade_run_dir(path: str | Path) -> tuple[Path, tuple[str, ...]]:
    """Bring a training folder written by an earlier recspec up to date (``path``: the folder or
    its ``best/``). Run files not listed yet: its model folder is checked against its own listing
    and the item index against the model's, then ``checksums.json`` beside them lists ``run.json``
    and ``item_index.json``; a listing it has is checked, never rewritten for them (that would
    bless an edit). No ``serving.json`` (:mod:`recspec.models.run_data`): it is written from the
    data set the run records (read here: a data set that cannot be read is a one-line error, and
    nothing is written) and listed too, so that the folder serves without the data set. The
    listing's path and the files newly listed (none: nothing to do)."""
    folder = run_folder(Path(path))
    listed = (folder / CHECKSUMS).is_file()
    if listed:
        verify_run_files(folder)
    index = ItemIndex.load(folder / INDEX_FILE)
    if not listed:
        check_index(trained_model_dir(folder), index)
    info = read_json(folder / RUN_FILE)  # strict JSON: a malformed record is named, not listed
    if (folder / SERVING_FILE).is_file():
        if listed:
            return folder / CHECKSUMS, ()
        ServingData.load(folder)  # its shape checked before it is listed
    else:
        dataset = recorded_dataset(info, index, f"run `recspec upgrade {folder}` where it can, to write {SERVING_FILE} "
                                                f"from it")
        ServingData.from_split(dataset, run_split(dataset, info)).save(folder)
    names = run_files(folder)
    record_checksums(folder, names)
    return folder / CHECKSUMS, (SERVING_FILE,) if listed else names


def load_weights(model, folder: Path) -> None:
    """Load ``folder/model.safetensors`` into ``model`` exactly (tied weights may be absent)."""
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise RecspecError(f"{folder}: no {WEIGHTS_FILE}")
    weights = load_file(str(path))
    own = model.state_dict()
    unexpected = sorted(set(weights) - set(own))
    shapes = sorted(k for k in weights if k in own and own[k].shape != weights[k].shape)
    if unexpected or shapes:
        what = "; ".join(part for part in (", ".join(unexpected[:3]) and "unexpected " + ", ".join(unexpected[:3]),
                                           ", ".join(shapes[:3]) and "other shape of " + ", ".join(shapes[:3])) if part)
        raise RecspecError(f"{path}: does not fit this model ({what}); pass a model built like the run's")
    loaded_ptrs = {own[k].data_ptr() for k in weights}
    missing = [k for k in own if k not in weights and own[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise RecspecError(f"{path}: lacks {', '.join(missing[:3])}; pass a model built like the run's")
    with torch.no_grad():
        for key, value in weights.items():
            own[key].copy_(value)


def save_model_dir(path: Path, model, tokenizer, encoder: PromptEncoder, extra: dict[str, Any],
                    state: dict[str, Any] | None = None) -> None:
    """Write the model folder ``path`` whole (weights, tokenizer, ``recspec.json`` with ``extra``,
    the trainer's ``state`` when given, checksums) under a temporary name."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every checkpoint
    try:
        with atomic_dir(path, overwrite=True) as tmp:
            _fill_model_dir(tmp, model, tokenizer, encoder, extra, state)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _fill_model_dir(tmp: Path, model, tokenizer, encoder: PromptEncoder, extra: dict[str, Any],
                    state: dict[str, Any] | None) -> None:
    model.save_pretrained(tmp)  # transformers 5 always writes safetensors
    if not (tmp / WEIGHTS_FILE).is_file():
        raise RuntimeError(f"save_pretrained wrote no {WEIGHTS_FILE} (sharded?); the model is too large")
    save_tokenizer(tokenizer, encoder.index, tmp, {"prompt": encoder.template.to_json(), **extra})
    if state is not None:
        save_state(tmp, STATE_NAME, state)
    record_checksums(tmp)


class ModelFolders:
    """The model folders of a training run on item identifiers (the trainer's model store):
    ``out_dir/checkpoint/`` (the model with the trainer's state) and ``out_dir/best/``, each a
    model folder with the tokenizer, ``recspec.json`` (index, prompt template and ``extra``) and
    checksums."""

    REMEDY = "delete the checkpoint folder to start over, or choose another output folder"

    def __init__(self, out_dir: Path, encoder: PromptEncoder) -> None:
        self.encoder = encoder
        self.checkpoint_path, self.best_dir = Path(out_dir) / CHECKPOINT_DIR, Path(out_dir) / BEST_DIR

    def read_checkpoint(self) -> dict[str, Any] | None:
        """The trainer's state in the checkpoint (its folder checked: no object files, checksums,
        the same item index), or None when there is no checkpoint."""
        if self.checkpoint_path.is_dir():
            refuse_object_files(self.checkpoint_path, self.REMEDY)
        if not has_state(self.checkpoint_path, STATE_NAME):
            return None
        verify_model_dir(self.checkpoint_path, self.REMEDY)
        check_index(self.checkpoint_path, self.encoder.index)
        return load_state(self.checkpoint_path, STATE_NAME, self.REMEDY)

    def load_checkpoint(self, model, saved: dict[str, Any]) -> None:
        """The checkpoint's weights into ``model`` (they are in its folder, not in ``saved``)."""
        load_weights(model, self.checkpoint_path)

    def save_checkpoint(self, model, state: dict[str, Any], info: dict[str, Any]) -> None:
        """Write the checkpoint folder: ``model``, the trainer's ``state``, ``info`` in ``recspec.json``."""
        save_model_dir(self.checkpoint_path, model, self.encoder.tokenizer, self.encoder, {"checkpoint": info}, state)

    def save_best(self, model, info: dict[str, Any]) -> None:
        """Write ``model`` as the best one, ``info`` (metric, value, epoch, ...) in ``recspec.json``."""
        save_model_dir(self.best_dir, model, self.encoder.tokenizer, self.encoder, {"best": info})

    def load_best(self, model) -> None:
        """The best model's weights into ``model``."""
        load_weights(model, self.best_dir)


def weights_fingerprint(model_dir: Path, name: str = WEIGHTS_FILE) -> str:
    """sha256 of the folder's weights file ``name``: from its ``checksums.json`` where recspec
    wrote one (the loader has checked it), else hashed here."""
    listing = model_dir / CHECKSUMS
    if listing.is_file():
        entry = read_json(listing).get("files", {}).get(name)
        if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    return sha256_file(model_dir / name)


def verify_model_dir(folder: Path, remedy: str = MODEL_REMEDY) -> None:
    """Check a model folder against its ``checksums.json``, which must list every file that decides
    its answers (:data:`MODEL_FILES`, and those of :data:`MODEL_FILES_IF_PRESENT` it holds)."""
    present = [name for name in MODEL_FILES_IF_PRESENT if (folder / name).exists()]
    verify_checksums(folder, remedy, (*MODEL_FILES, *present))


def trained_model_dir(path: str | Path) -> Path:
    """The model folder of a training ``out_dir`` (its ``best/``), or ``path`` itself (a ``best/`` or
    ``checkpoint/`` folder), its files checked against its ``checksums.json``
    (:func:`verify_model_dir`); a folder holding no trained model (a training folder without
    ``best/`` included), or a damaged one, is an error naming the file."""
    path = Path(path)
    if not path.exists():
        raise RecspecError(f"{path}: no such folder; train a model first")
    folder = path / BEST_DIR if (path / BEST_DIR).is_dir() else path
    if (folder / RUN_FILE).is_file() or not any((folder / name).is_file()
                                                 for name in (CHECKSUMS, "config.json", WEIGHTS_FILE)):
        raise RecspecError(f"{path}: not a trained model folder (no {BEST_DIR}/ and no config.json + {WEIGHTS_FILE})")
    verify_model_dir(folder)
    read_metadata(folder)
    return folder


def check_vocabulary_fits(tokenizer, vocab_size: int, folder: Path, index: ItemIndex | None = None) -> None:
    """Refuse a tokenizer with ids beyond the model's ``vocab_size`` embeddings (more rows than the
    tokenizer has, as models pad them to a round number, are fine), naming the identifier tokens
    of ``index`` among them: an extended tokenizer whose model was not resized."""
    if len(tokenizer) <= vocab_size:
        return
    outside = sorted((i, t) for t, i in identifier_token_ids(tokenizer, index).items() if i >= vocab_size) \
        if index is not None else []
    named = f"; identifier tokens {', '.join(t for _, t in outside[:3])} ({len(outside)} in all) have ids from " \
            f"{outside[0][0]} to {outside[-1][0]}" if outside else ""
    raise RecspecError(f"{folder}: the model has {vocab_size} token embeddings but its tokenizer {len(tokenizer)} "
                       f"tokens{named}; resize the model's embeddings to the tokenizer "
                       f"(model.resize_token_embeddings(len(tokenizer))) before saving it")


def load_trained(path: str | Path, index=None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a trained folder (see :func:`trained_model_dir`) on ``device`` in
    ``dtype`` (:mod:`recspec.precision` resolves ``--dtype``), for decoding. With ``index``, a
    folder built for another item index is refused. The model is accelerated for ``device`` as
    :func:`load_safetensors_lm` says."""
    folder = trained_model_dir(path)
    tokenizer = load_tokenizer_dir(folder, index)
    model = load_safetensors_lm(folder, dtype=dtype, device=device)
    check_vocabulary_fits(tokenizer, model.config.get_text_config().vocab_size, folder, index)
    return model, tokenizer


def load_safetensors_lm(folder: Path, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu"):
    """The causal LM of a model folder on ``device``, in eval mode: weights from safetensors only
    (a pickle is never opened), no code from the folder (no ``trust_remote_code``), every weight
    the config describes present in them with its shape before any is read
    (:func:`~recspec.hub.check_weights_fit`: none is left randomly initialised), every weight
    checked finite, and accelerated for ``device`` under accel's policy
    (:func:`~recspec.accel.accelerate`: on the CPU, an LLM-sized model's products by recspec's
    small-row kernels, a small Llama's calls by one function, grouped-query attention packed;
    none of them for a 16-bit model, which runs on transformers' own forward).
    ``dtype``: ``"auto"`` keeps the dtype the weights were saved in (what ``recspec import``
    copies); a weight that 16-bit cannot hold (float16 overflows above 65504) is refused by the
    finiteness check."""
    from transformers import AutoModelForCausalLM

    from recspec.hub import check_weights_fit

    config = check_weights_fit(folder)
    with loading_errors(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype, use_safetensors=True,
                                                     trust_remote_code=False)
    check_finite_weights(model, folder)
    return accelerate(model.to(device).eval(), device)
