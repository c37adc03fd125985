"""Checkpoints trained elsewhere (LC-Rec, MiniOneRec style): `recspec import`, and recommending
from one without importing it.

Such a checkpoint is a Hugging Face causal LM folder (``config.json``, safetensors weights, a
tokenizer whose vocabulary already holds the identifier tokens), an item index file mapping each
item to its identifier tokens (``{"item": ["<a_1>", "<b_2>", ...]}``, the layout of recspec's own
``item_index.json``) and a prompt: text with a ``{history}`` slot
(:class:`~recspec.models.examples.TextTemplate`, optionally rendered by the tokenizer's chat
template) or the template of one of recspec's presets. :func:`peer_parts` checks all of it before
any weight is read, each problem one line: a folder that asks for its own code to be run (an
``auto_map``, a model or tokenizer class transformers lacks: refused before transformers could ask
whether to run it), a config whose model is not exactly what the safetensors headers hold (weights
missing, unexpected or of another shape, absurd sizes: :func:`~recspec.hub.check_weights_fit`), a
malformed config or tokenizer, a folder recspec wrote itself (it needs no import), identifier tokens
missing from the tokenizer or not one token each, token ids beyond the model's embeddings, a
template without ``{history}`` or one whose pieces tokenize otherwise than the whole prompt text
(or that the tokenizer cannot tokenize at all), an index that knows none of the data set's items, a
folder without safetensors weights. :func:`import_checkpoint` then writes the folder
`recspec train` writes (``best/`` with the weights, tokenizer, ``recspec.json`` and checksums;
``item_index.json``, ``run.json`` and ``serving.json`` beside it), atomically, so that every command
takes it and it serves without the data set;
:func:`load_peer` builds the same :class:`~recspec.recommend.Recommender` in memory and writes
nothing (`recspec recommend --target HF_DIR --index ...`).

An index with colliding identifiers is resolved as recspec resolves released ones
(:func:`~recspec.itemids.build.load_index`). Items of the data set that the index lacks cannot be
recommended: their interactions are left out of histories and targets (``only_indexed_items`` in
``run.json``, :func:`~recspec.models.run_data.run_dataset`). Nothing from the model folder is executed:
no remote code, weights only from safetensors (pickled weights are refused unopened), the chat
template rendered by transformers' sandboxed Jinja.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recspec.data import Dataset, Examples, load_dataset, split_dataset
from recspec.data.loaders import keep_items, recorded_spec
from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, check_output_dir
from recspec.hub import CONFIG_FILE, check_weights_fit, load_config, load_tokenizer, loading_errors
from recspec.itemids.build import load_index
from recspec.models.checkpoint import (BEST_DIR, check_vocabulary_fits, load_safetensors_lm, save_model_dir,
                                       write_run_info)
from recspec.models.examples import PromptEncoder, TextTemplate
from recspec.models.run_data import ServingData
from recspec.models.presets import preset_template
from recspec.models.tokenizer import RECSPEC_JSON, check_one_token_each
from recspec.recommend import Recommender, check_drafts, check_k, folder_precisions


@dataclass(frozen=True)
class PeerSpec:
    """A checkpoint trained elsewhere: its ``model`` folder, ``index`` file and prompt
    ``template`` (a text template, or the name of a recspec preset whose template it takes), and
    the data set it recommends for (``format``, ``split`` and ``max_history`` as for `recspec
    train`)."""

    model: Path
    index: Path
    template: TextTemplate | str
    dataset: str
    format: str | None = None
    split: str | None = None
    max_history: int = 20


@dataclass
class PeerParts:
    """A checked checkpoint: its model ``folder``, the prompt ``encoder`` (tokenizer, item index,
    token template) for ``dataset`` (without the items the index lacks), the run ``info``, the
    ``provenance`` a recspec folder records and the ``serving`` data it keeps, and ``notes`` for the
    user (items moved or left out, a pad token chosen)."""

    folder: Path
    encoder: PromptEncoder
    dataset: Dataset
    info: dict[str, Any]
    provenance: dict[str, Any]
    serving: ServingData
    notes: list[str]


def check_model_folder(folder: Path) -> int:
    """Check a model folder before anything is loaded from it: not a folder recspec wrote (train's
    or import's, which every command takes as it is), a ``config.json`` transformers knows
    without remote code (:func:`~recspec.hub.load_config`); the vocabulary size it gives the
    embeddings (:func:`peer_parts` then checks the safetensors hold exactly that model)."""
    if not folder.is_dir():
        raise RecspecError(f"{folder}: no such model folder")
    if (folder / RECSPEC_JSON).is_file() or (folder / BEST_DIR / RECSPEC_JSON).is_file():
        raise RecspecError(f"{folder}: already a recspec model folder (it has {RECSPEC_JSON}); pass it to --target "
                           f"as it is, without --index")
    if not (folder / CONFIG_FILE).is_file():
        raise RecspecError(f"{folder}: no {CONFIG_FILE}; not a Hugging Face model folder")
    return int(load_config(folder).get_text_config().vocab_size)


def check_whole_text(encoder: PromptEncoder, template: TextTemplate, dataset: Dataset, examples: Examples) -> None:
    """Refuse a template whose pieces (the text before and after the slot, the separator) do not
    tokenize as the whole prompt text does, checked on the first example's prompt."""
    history = [dataset.item_ids[item] for item in examples.history_of(0)]
    identifiers = [encoder.index.identifiers[row] for row in encoder.index.positions(history)]
    whole = template.encode(encoder.tokenizer, template.history_text(identifiers))
    pieces = encoder.prompts(examples, np.arange(1))[0].tolist()
    if pieces != whole:
        at = next((i for i, (a, b) in enumerate(zip(pieces, whole)) if a != b), min(len(pieces), len(whole)))
        shown = [encoder.tokenizer.decode(ids[at:at + 3]) for ids in (pieces, whole)]
        raise RecspecError(f"the prompt template tokenizes otherwise in pieces than as one text (from token {at}: "
                           f"{shown[0]!r} vs {shown[1]!r}); put a space or a line break between {{history}} and the "
                           f"words around it")


def peer_parts(spec: PeerSpec) -> PeerParts:
    """Every check of ``spec`` (module doc), each a one-line :class:`RecspecError`, no weight read."""
    folder = Path(spec.model)
    vocab_size = check_model_folder(folder)
    tokenizer = load_tokenizer(folder)
    index, moved = load_index(spec.index)
    with loading_errors(folder, "tokenize the identifiers with its tokenizer"):
        check_one_token_each(tokenizer, index)
    check_vocabulary_fits(tokenizer, vocab_size, folder, index)
    check_weights_fit(folder)
    notes = [f"{len(moved)} items of {spec.index} shared their identifier with another item and were moved to "
             f"free last-level codes (`recspec ids show {spec.index}` lists them)"] if moved else []
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise RecspecError(f"{folder}: the tokenizer has neither a pad nor an end-of-sequence token; give it a "
                               f"pad token in its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
        notes.append(f"the tokenizer has no pad token: {tokenizer.eos_token} pads batches (padding is masked, so "
                     f"no score changes)")
    text = spec.template if isinstance(spec.template, TextTemplate) else None
    with loading_errors(folder, "tokenize the prompt template with its tokenizer"):
        template = text.tokens(tokenizer) if text else preset_template(str(spec.template), tokenizer)
    everything = load_dataset(spec.dataset, spec.format)
    dataset = keep_items(everything, index.item_keys)
    if dataset is not everything:
        notes.append(dataset.notes[-1])
    split = split_dataset(dataset, spec.split, spec.max_history)
    encoder = PromptEncoder(index, dataset.item_ids, tokenizer, template)
    if text:
        with loading_errors(folder, "tokenize a prompt with its tokenizer"):
            check_whole_text(encoder, text, dataset, split.test if len(split.test) else split.train)
    info = {"dataset": recorded_spec(spec.dataset), "format": spec.format, "split": split.kind,
            "max_history": spec.max_history, "only_indexed_items": True, "imported": str(folder.resolve())}
    provenance = {"model": str(folder.resolve()), "index": str(Path(spec.index).resolve()),
                  "prompt": text.to_json() if text else {"preset": spec.template}, "moved_items": sorted(moved)}
    return PeerParts(folder, encoder, dataset, info, provenance, ServingData.from_split(dataset, split), notes)


def import_checkpoint(spec: PeerSpec, out: Path, overwrite: bool = False) -> PeerParts:
    """Write the recspec model folder of ``spec`` to ``out`` (module doc), whole or not at all; the
    checked parts (their ``notes`` for the user). The weights keep the dtype they were saved in."""
    check_output_dir(out, overwrite)
    parts = peer_parts(spec)
    model = load_safetensors_lm(parts.folder, dtype="auto")
    with atomic_dir(out, overwrite) as tmp:
        save_model_dir(tmp / BEST_DIR, model, parts.encoder.tokenizer, parts.encoder, {"imported": parts.provenance})
        write_run_info(tmp, parts.encoder.index, parts.info, parts.serving)
    return parts


def load_peer(spec: PeerSpec, device: str = "cpu", draft_dir: str | Path | Sequence[str | Path] | None = None,
              k: int | None = None, dtype: str = "auto", draft_dtype: str | None = None
              ) -> tuple[Recommender, list[str]]:
    """The :class:`Recommender` of ``spec`` without writing anything (the model as the imported
    folder would load it), with a draft model folder (e.g. another imported checkpoint; draft
    heads need the imported folder), the models in ``dtype`` / ``draft_dtype``
    (:func:`~recspec.precision.resolve_pair`: ``auto`` keeps the checkpoint's saved dtype on
    CUDA, said in its ``notes``); the notes on the checkpoint for the user."""
    models, heads = check_drafts(draft_dir)
    precisions = folder_precisions(dtype, draft_dtype, device, spec.model, models, heads, draft_dir)
    parts = peer_parts(spec)
    check_k(k, parts.encoder.index, spec.index)
    model = load_safetensors_lm(parts.folder, dtype=precisions.target.dtype, device=device)
    recommender = Recommender.from_parts(model, parts.encoder, parts.dataset, parts.info, device, models, heads,
                                         draft_dtype=precisions.draft.dtype)
    recommender.notes.extend(precisions.notes())
    return recommender, parts.notes
