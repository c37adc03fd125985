"""Top-K recommendation with a trained generative recommender, and evaluation of the results.

A trained model folder (``recspec train --out DIR``, :mod:`recspec.models.checkpoint`) holds
``best/`` (weights, tokenizer, ``recspec.json`` with the item-index fingerprint),
``item_index.json``, ``run.json`` and ``serving.json`` (:mod:`recspec.models.run_data`).
:class:`Recommender` loads all of it and turns examples into top-K item lists with any decoder;
results are written as JSON lines, one object per user: ``{"user": raw id, "items": [raw item
ids, best first], "scores": [...]}``. Recommending for a data set's users reads that data set (the
one the model was trained on, or another); answering raw histories (``folder_only``: the Python
API, ``recspec serve``) reads the folder alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from recspec.data import Dataset, Examples, SplitData, load_dataset
from recspec.decoding import TopK, beam_search, hf_beam_search, tree_beam_search
from recspec.decoding.draft_sources import ModelHeadPair
from recspec.decoding.dsbd import DSBDConfig, dsbd_beam_search
from recspec.decoding.item_prior import DECAY, ITEM_DRAFT, SMOOTHING, ItemDraft, TransitionPrior
from recspec.decoding.target_prior import (ROOT_DRAFT, TargetPrior, is_prior_dir, load_prior, read_prior_config,
                                           uniform_prior)
from recspec.decoding.prefix import share_prefix
from recspec.decoding.registry import ITEMS, Decoder, check_owned, decoder as registered, names, register
from recspec.decoding.rounds import SpecStats
from recspec.decoding.beam_search import sampling_beam_search
from recspec.decoding.beams import distinct_items
from recspec.decoding.speculative_beam import SpecConfig, speculative_beam_search
from recspec.decoding.tree_plan import CostPlanner
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.eval.metrics import recall_ndcg
from recspec.fileio import dumps_strict, write_text_atomic
from recspec.itemids.index import ItemIndex
from recspec.itemids.trie import ItemTrie
from recspec.models.checkpoint import INDEX_FILE, load_trained, run_info, trained_model_dir
from recspec.models.examples import PromptEncoder, saved_template
from recspec.models.head import bind_head, head_dir, head_fingerprint, is_head_dir, load_head, read_head_config
from recspec.models.run_data import SERVING_FILE, ServingData, recorded_dataset, run_dataset, run_split
from recspec.models.tokenizer import check_same_vocabulary, identifier_token_ids, load_tokenizer_dir
from recspec.precision import Precisions, resolve_pair

#: The item decoders' names (registered below, :mod:`recspec.decoding.registry`).
HF, BEAM, TREE_BEAM, BEAM_SAMPLE, AUTO = "hf", "beam", "tree-beam", "beam-sample", "auto"
SPEC_STRICT, SPEC_RELAXED, SPEC_BEAM_SAMPLE, DSBD = "spec-strict", "spec-relaxed", "spec-beam-sample", "dsbd"
#: The exact top-K decoders (trie-constrained beam search), all returning the same items.
BEAM_DECODERS: dict[str, Callable[..., TopK]] = {HF: hf_beam_search, BEAM: beam_search, TREE_BEAM: tree_beam_search}
#: The verification of each speculative beam decoder (:class:`~recspec.decoding.speculative_beam.SpecConfig`).
SPECULATIVE = {SPEC_STRICT: "strict", SPEC_RELAXED: "relaxed", SPEC_BEAM_SAMPLE: "sample"}
#: The kinds of draft folder ``--draft`` names (``KIND:PATH``): a draft model, a head, a target prior.
MODEL_KIND, HEAD_KIND, PRIOR_KIND = "model", "head", "prior"
DRAFT_KINDS = (MODEL_KIND, HEAD_KIND, PRIOR_KIND)
PROGRESS_CHUNK = 256  # users per progress-bar update of Recommender.recommend


@dataclass(frozen=True)
class DecodeOptions:
    """Settings of the sampling and speculative decoders (ignored by the others): ``draft_beams``
    (N) and ``gamma`` of speculative search; ``temperature``, ``seed`` and ``replacement`` of
    sampling (``beam-sample``, ``spec-relaxed``, ``spec-beam-sample``; independent draws may repeat
    an item, which then comes out once); ``draft_width`` (W_S, default 2K), ``min_width`` (W_min, default K), ``threshold`` (t) and
    ``one_cache`` of ``dsbd`` (:class:`~recspec.decoding.dsbd.DSBDConfig`); ``planner``: rounds of
    ``spec-strict`` sized by cost (what ``auto`` sets); ``expand_root``: ``tree-beam`` and
    ``beam-sample`` feed the first identifier level whole with the prompt, one target call fewer
    for the same results (:class:`~recspec.decoding.beam_search.RootTreeCache`)."""

    draft_beams: int = 40
    gamma: int | None = None
    temperature: float = 1.0
    seed: int = 0
    replacement: bool = False
    draft_width: int | None = None
    min_width: int | None = None
    threshold: float | None = None
    one_cache: bool = False
    planner: CostPlanner | None = None
    expand_root: bool = False
    #: Options only some decoders take (field: how the command line spells it).
    OWNED: ClassVar[dict[str, str]] = {"expand_root": "--expand-root"}

    def check(self, decoder: Decoder) -> None:
        """Refuse options ``decoder`` does not take (:func:`~recspec.decoding.registry.check_owned`)."""
        check_owned(self, decoder)

    def dsbd(self, k: int) -> DSBDConfig:
        return DSBDConfig(gamma=self.gamma, draft_width=self.draft_width or 2 * k, min_width=self.min_width or k,
                          threshold=self.threshold, one_cache=self.one_cache, warp=Warp(self.temperature),
                          seed=self.seed)


@dataclass(frozen=True)
class RecommendJob:
    """What ``recspec recommend`` computes, whichever engine runs it: the model folders, the
    decoder and its options, ``k``, the data set (None: the trained one; ``format`` of a path),
    the evaluation ``part``, its first ``users`` (None: all) and the users decoded together."""

    target: Path
    decoder: str = TREE_BEAM
    k: int = 10
    draft: str | None = None
    options: DecodeOptions = DecodeOptions()
    dataset: str | None = None
    format: str | None = None
    part: str = "test"
    users: int | None = None
    batch_size: int = 16
    dtype: str = "auto"
    draft_dtype: str | None = None

    @property
    def draft_dir(self) -> str | None:
        """The draft folders the decoder uses (None for decoders without a draft)."""
        return self.draft if self.decoder in (*DRAFTED, AUTO) else None

    def load(self, device: str = "cpu") -> Recommender:
        return Recommender.load(self.target, load_dataset(self.dataset, self.format) if self.dataset else None,
                                device=device, draft_dir=self.draft_dir, k=self.k, dtype=self.dtype,
                                draft_dtype=self.draft_dtype)

    def decode(self, recommender: Recommender, progress: bool = False) -> tuple[Examples, Decoded]:
        """The job's examples and their top-K by ``recommender`` (from :meth:`load`, or a model
        trained elsewhere), in one process; ``progress``: see :meth:`Recommender.recommend`."""
        examples = recommender.examples(self.part, self.users)
        return examples, recommender.recommend(examples, self.k, self.decoder, self.batch_size, self.options,
                                               progress)


@dataclass
class Decoded:
    """A decoder's top-K items and, for speculative decoders, their per-user statistics;
    ``choice``: what ``auto`` ran and why (empty for the other decoders)."""

    topk: TopK
    stats: SpecStats | None = None
    choice: str = ""

    @staticmethod
    def joined(parts: Sequence[Decoded]) -> Decoded:
        """The results of consecutive groups of users as one (statistics kept where every part has
        them)."""
        stats = None if any(part.stats is None for part in parts) else SpecStats.cat([part.stats for part in parts])
        return Decoded(TopK.cat([part.topk for part in parts]), stats, parts[0].choice)


def item_rows(dataset_keys: Sequence[str], keys: Sequence[str]) -> np.ndarray:
    """int64 [len(keys)]: the dense data-set item of each raw item id (-1 where the data set lacks it)."""
    lookup = {key: i for i, key in enumerate(dataset_keys)}
    return np.array([lookup.get(str(key), -1) for key in keys], dtype=np.int64)


def evaluation_part(split: SplitData | ServingData, part: str) -> Examples:
    """The validation or test examples of ``split`` (or the histories a model folder keeps of
    them); another name is an error."""
    if part not in ("valid", "test"):
        raise RecspecError(f"unknown part {part!r}; choose valid or test")
    return split.valid if part == "valid" else split.test


def check_decoder(name: str, has_draft: bool = False) -> Decoder:
    """The item decoder ``name`` (:mod:`recspec.decoding.registry`); an unknown one, or a drafted
    one without a draft, is an error."""
    spec = registered(name, ITEMS)
    spec.check(DecodeOptions(), has_draft)
    return spec


def run_decoder(name: str, target, draft, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_id: int,
                options: DecodeOptions = DecodeOptions(), batch_size: int | None = None) -> Decoded:
    """Top-``k`` items of every prompt by decoder ``name`` (``draft`` for speculative ones;
    ``auto`` chooses from measurements kept beside the model folders: :meth:`Recommender.recommend`)."""
    spec = registered(name, ITEMS)
    spec.check(options, draft is not None)
    return spec.run(target, draft, prompts, trie, k, pad_id, options, batch_size)


def _beam(name: str) -> Callable[..., Decoded]:
    def run(target, draft, prompts, trie, k, pad_id, options, batch_size) -> Decoded:
        return Decoded(BEAM_DECODERS[name](target, prompts, trie, k, pad_id, batch_size))
    return run


def _tree_beam(target, draft, prompts, trie, k, pad_id, options, batch_size) -> Decoded:
    return Decoded(tree_beam_search(target, prompts, trie, k, pad_id, batch_size, options.expand_root))


def _beam_sample(target, draft, prompts, trie, k, pad_id, options, batch_size) -> Decoded:
    topk = sampling_beam_search(target, prompts, trie, k, pad_id, options.temperature, options.seed,
                                options.replacement, batch_size, options.expand_root)
    return Decoded(distinct_items(topk) if options.replacement else topk)


def _speculative(name: str) -> Callable[..., Decoded]:
    def run(target, draft, prompts, trie, k, pad_id, options, batch_size) -> Decoded:
        config = SpecConfig(draft_beams=options.draft_beams, gamma=options.gamma, verify=SPECULATIVE[name],
                            temperature=options.temperature, seed=options.seed, replacement=options.replacement,
                            planner=options.planner)
        result = speculative_beam_search(target, draft, prompts, trie, k, pad_id, config, batch_size)
        independent = config.verify != "strict" and options.replacement  # independent draws may repeat an item
        return Decoded(distinct_items(result.topk) if independent else result.topk, result.stats)
    return run


def _dsbd(target, draft, prompts, trie, k, pad_id, options, batch_size) -> Decoded:
    topk, stats = dsbd_beam_search(target, draft, prompts, trie, k, pad_id, options.dsbd(k), batch_size)
    return Decoded(distinct_items(topk), stats)


def _auto(target, draft, prompts, trie, k, pad_id, options, batch_size) -> Decoded:
    raise RecspecError("decoder auto chooses from measurements of the loaded models: use Recommender.recommend")


register(HF, ITEMS, _beam(HF), DecodeOptions, exact=True)
register(BEAM, ITEMS, _beam(BEAM), DecodeOptions, exact=True)
register(TREE_BEAM, ITEMS, _tree_beam, DecodeOptions, exact=True, takes=("expand_root",))
register(BEAM_SAMPLE, ITEMS, _beam_sample, DecodeOptions, takes=("expand_root",))
register(SPEC_STRICT, ITEMS, _speculative(SPEC_STRICT), DecodeOptions, drafted=True, exact=True)
register(SPEC_RELAXED, ITEMS, _speculative(SPEC_RELAXED), DecodeOptions, drafted=True)
register(SPEC_BEAM_SAMPLE, ITEMS, _speculative(SPEC_BEAM_SAMPLE), DecodeOptions, drafted=True)
register(DSBD, ITEMS, _dsbd, DecodeOptions, drafted=True)
register(AUTO, ITEMS, _auto, DecodeOptions, exact=True)
#: Every item decoder; those that need a draft; the plain loops that can score the first identifier
#: level in the prompt's call (``expand_root``).
DECODERS = names(ITEMS)
DRAFTED = names(ITEMS, drafted=True)
ROOT_EXPANDING = tuple(name for name in DECODERS if "expand_root" in registered(name, ITEMS).takes)


@dataclass(frozen=True)
class UnloadedDraft:
    """The draft of a recommender loaded without weights (:meth:`Recommender.load`): it says that
    a draft was given, by its :func:`named_draft` name where it has one, so that the decoders that
    need one are allowed; it drafts nothing (the models decode in another process)."""

    name: str | None = None


@dataclass
class Recommender:
    """A trained model with its tokenizer, item index, prompt encoder and trie, for the users of
    ``dataset``, or (``dataset`` None: loaded from its folder alone) for raw histories, with the
    folder's ``saved`` serving data (None for a folder written before recspec kept it)."""

    model: Any
    tokenizer: Any
    index: ItemIndex
    encoder: PromptEncoder
    trie: ItemTrie
    dataset: Dataset | None
    info: dict[str, Any]
    draft: Any = None
    folder: Path | None = None  # the target's model folder
    draft_dirs: tuple[Path, ...] = ()  # the draft's folders (a model, a head, or both)
    saved: ServingData | None = None
    notes: list[str] = field(default_factory=list, compare=False)  # what loading chose (the dtypes), for the user
    # what ``auto`` chose for these models, per (K, batch size): made once per loaded recommender
    auto_choices: dict[tuple[int, int], Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def load(cls, model_dir: str | Path, dataset: Dataset | None = None, device: str = "cpu",
             draft_dir: str | Path | Sequence[str | Path] | None = None, k: int | None = None,
             folder_only: bool = False, dtype: str = "auto", draft_dtype: str | None = None,
             weights: bool = True) -> Recommender:
        """Load ``model_dir`` (a training folder or its ``best/``) for the users of ``dataset``
        (default: the trained one, read now). ``folder_only``: for raw histories, from the folder
        alone (the Python API, ``recspec serve``): no data set is read unless ``dataset`` is given;
        the item ids come from the folder's ``serving.json``, and so do the users ``auto``
        measures on (:meth:`examples`); a folder written before recspec kept that file reads them
        from its data set, or names ``recspec upgrade`` when it cannot be read.
        ``draft_dir``: a draft model for the speculative decoders, refused unless it was
        trained with the same item index and tokenizer, or a draft head (`recspec align train
        --head`), refused unless it was trained for this target, or both (:func:`draft_kinds`):
        the model drafts the first round, the head the rest; or a target prior (`recspec align
        prior`), refused unless it was fitted for this target; or ``"items"``: the item prior of
        :meth:`item_draft`. Neither prior costs a model call. ``k``: the number of items to be asked for,
        refused before any model is loaded when the index has fewer items. ``dtype``, ``draft_dtype``:
        the models' dtypes (:func:`~recspec.precision.resolve_pair`), checked before any work.
        ``weights`` False: no model or draft weights, only what checking and parsing requests needs
        (tokenizer, item index, prompt encoder, trie), the draft an :class:`UnloadedDraft` (a
        server whose decoding runs in a worker process, :mod:`recspec.serve.worker`)."""
        folder, info, models, heads = check_folders(model_dir, draft_dir)
        precisions = folder_precisions(dtype, draft_dtype, device, folder, models, heads, draft_dir)
        index = ItemIndex.load(folder / INDEX_FILE)
        check_k(k, index, folder)
        saved = ServingData.load(folder) if (folder / SERVING_FILE).is_file() else None
        if dataset is not None or not folder_only:  # a data set that cannot be read is named before any weight
            dataset = users_dataset(info, index, dataset)
        elif saved is None:
            dataset = recorded_dataset(info, index, f"{folder} was written before recspec kept {SERVING_FILE}: run "
                                                    f"`recspec upgrade {folder}` where the data set can be read")
        model_folder = trained_model_dir(folder)
        if weights:
            model, tokenizer = load_trained(folder, index, device=device, dtype=precisions.target.dtype)
        else:
            model, tokenizer = None, load_tokenizer_dir(model_folder, index)
        item_keys = saved.item_ids if dataset is None and saved is not None else users_of(dataset).item_ids
        encoder = PromptEncoder(index, item_keys, tokenizer, saved_template(model_folder, tokenizer))
        drafts = (models, heads) if weights else ((), ())
        recommender = cls.from_parts(model, encoder, dataset, info, device, *drafts, model_folder, saved,
                                     precisions.draft.dtype)
        recommender.notes.extend(precisions.notes())
        named = named_draft(draft_dir)
        if not weights and (named or models or heads):
            return replace(recommender, draft=UnloadedDraft(named), draft_dirs=(*models, *heads))
        return replace(recommender, draft=recommender.build_named_draft(named)) if named else recommender

    @classmethod
    def from_parts(cls, model, encoder: PromptEncoder, dataset: Dataset | None, info: dict[str, Any],
                   device: str = "cpu", models: Sequence[Path] = (), heads: Sequence[Path] = (),
                   folder: Path | None = None, saved: ServingData | None = None,
                   draft_dtype: torch.dtype | None = None) -> Recommender:
        """A recommender from a loaded target ``model``, its prompt ``encoder`` for ``dataset`` (None:
        raw histories, over the item ids of its folder's ``saved`` serving data) and its run
        ``info``, with the draft ``models`` and ``heads`` (folders checked by
        :func:`check_drafts`; at most one of each, or a target prior alone in ``heads``) loaded and
        checked against it. ``folder``: the target's model folder, which heads and priors are tied
        to and ``auto`` keeps its measurements in (None for a model loaded from elsewhere,
        :mod:`recspec.importer`). A draft model is loaded in ``draft_dtype`` (None: the target's); a
        head runs in the target's dtype, on its features."""
        index, tokenizer = encoder.index, encoder.tokenizer
        trie = index.trie(identifier_token_ids(tokenizer, index), vocab_size=len(tokenizer)).to(device)
        draft_model = tied = None  # tied: a head, or a target prior (which comes alone)
        if heads and folder is None:
            raise RecspecError("a draft head or target prior is tied to its target's model folder; import the "
                               "target first (`recspec import`) and fit the draft for that folder")
        if heads and is_prior_dir(heads[0]):
            tied = load_prior(heads[0], head_fingerprint(folder, index), trie)
        elif heads:
            tied = bind_head(load_head(heads[0], head_fingerprint(folder, index), device).to(model.dtype), model,
                             tokenizer, index)
        if models:
            draft_model, draft_tokenizer = load_trained(models[0], index, device=device,
                                                        dtype=draft_dtype or model.dtype)
            check_same_vocabulary(draft_tokenizer, tokenizer)
            if saved_template(trained_model_dir(models[0]), draft_tokenizer) != encoder.template:
                raise RecspecError(f"{models[0]}: the draft was trained with another prompt template than the "
                                   f"target; train it with the target's preset family")
        for loaded in (model, draft_model):  # prefix caching: the template's fixed prefix is computed once
            if loaded is not None:
                share_prefix(loaded, encoder.template.prefix)
        draft = ModelHeadPair(draft_model, tied) if draft_model is not None and tied is not None else draft_model or tied
        return cls(model, tokenizer, index, encoder, trie, dataset, info, draft, folder, (*models, *heads), saved)

    def with_draft(self, draft_dir: str | Path | Sequence[str | Path]) -> Recommender:
        """This recommender with another draft (``draft_dir`` as in :meth:`load`), the target's
        weights, encoder and data shared rather than loaded again."""
        named = named_draft(draft_dir)
        if named:
            return replace(self, draft=self.build_named_draft(named), draft_dirs=())
        models, heads = check_drafts(draft_dir)
        device = str(next(self.model.parameters()).device)
        return type(self).from_parts(self.model, self.encoder, self.dataset, self.info, device, models, heads,
                                     self.folder, self.saved)

    @property
    def draft_name(self) -> str | None:
        """The name ``--draft`` gave the draft instead of a folder (:func:`named_draft`): ``items``
        for the item prior, ``root`` for the unfitted target prior; else None."""
        if isinstance(self.draft, UnloadedDraft):
            return self.draft.name
        if isinstance(self.draft, ItemDraft):
            return ITEM_DRAFT
        if isinstance(self.draft, TargetPrior) and not self.draft_dirs:
            return ROOT_DRAFT
        return None

    @property
    def draft_names(self) -> list[str]:
        """What ``--draft`` named: the draft's folders, or its :attr:`draft_name`."""
        name = self.draft_name
        return [name] if name else [str(path) for path in self.draft_dirs]

    def build_named_draft(self, name: str) -> ItemDraft | TargetPrior:
        """The draft a ``--draft`` name stands for (:func:`named_draft`), built for this target."""
        return self.item_draft() if name == ITEM_DRAFT else uniform_prior(self.trie)

    def item_draft(self, decay: float = DECAY, smoothing: float = SMOOTHING) -> ItemDraft:
        """The draft of ``--draft items``: an item-transition prior fitted on the training part
        of this recommender's data (:mod:`recspec.decoding.item_prior`), read through its trie.
        Loaded from its folder alone, it reads the data set the model was trained on (a folder
        keeps no training data)."""
        dataset = self.dataset if self.dataset is not None else recorded_dataset(
            self.info, self.index, "--draft items is fitted on its training users: pass --dataset where the "
                                   "command takes one, or choose another draft")
        prior = TransitionPrior.fit(training_sequences(dataset, self.info, self.index), len(self.index.item_keys),
                                    decay, smoothing)
        return ItemDraft(prior, self.trie)

    def examples(self, part: str = "test", users: int | None = None) -> Examples:
        """The evaluation examples of ``part`` under the trained split (the first ``users`` of them).
        Loaded from its folder alone (no data set), the histories its folder keeps of the first
        validation and test users instead (:class:`~recspec.models.run_data.ServingData`, no
        targets): prompts for ``auto`` and calibration to measure on, not users to evaluate."""
        if self.dataset is None and self.saved is not None:
            return first_users(evaluation_part(self.saved, part), users)
        return trained_examples(users_of(self.dataset), self.info, part, users)

    def recommend(self, examples: Examples, k: int, decoder: str = TREE_BEAM, batch_size: int | None = 16,
                  options: DecodeOptions = DecodeOptions(), progress: bool = False) -> Decoded:
        """Top-``k`` items (index rows) of every example by ``decoder``; with ``progress``, the users
        go through in chunks of whole batches (:func:`user_chunks`) under a progress bar, chunk ``i``
        of a sampling decoder seeded with ``seed + i`` (so chunks draw independent streams)."""
        if decoder == AUTO:  # the fastest exact decoder for this pair, K and batch size
            from recspec.auto import choose

            if self.folder is None:
                raise RecspecError("decoder auto keeps its measurements in the model folder; import the model "
                                   "first (`recspec import`) or name a decoder")
            key = (k, batch_size or len(examples))
            choice = self.auto_choices[key] = self.auto_choices.get(key) or choose(self, *key)
            decoded = self.recommend(examples, k, choice.decoder, batch_size, choice.options, progress)
            return replace(decoded, choice=choice.reason)
        prompts = self.encoder.prompts(examples)
        if not progress:
            return run_decoder(decoder, self.model, self.draft, prompts, self.trie, k, self.encoder.pad_id, options,
                               batch_size)
        from tqdm.auto import tqdm

        parts = []
        with tqdm(total=len(prompts), unit="user", desc=decoder, dynamic_ncols=True) as bar:
            for i, rows in enumerate(user_chunks(len(prompts), batch_size)):
                parts.append(run_decoder(decoder, self.model, self.draft, prompts[rows.start:rows.stop], self.trie, k,
                                         self.encoder.pad_id, replace(options, seed=options.seed + i), batch_size))
                bar.update(len(rows))
        return Decoded.joined(parts)


def trained_examples(dataset: Dataset, info: dict[str, Any], part: str = "test", users: int | None = None
                     ) -> Examples:
    """The evaluation examples of ``part`` of ``dataset`` under the split a model was trained
    with (its run ``info``), the first ``users`` of them; no model is needed."""
    return first_users(evaluation_part(run_split(dataset, info), part), users)


def first_users(examples: Examples, users: int | None) -> Examples:
    """The first ``users`` of ``examples`` (None: all of them); fewer than one is an error."""
    if users is not None and users < 1:
        raise RecspecError(f"users must be at least 1, got {users}")
    return examples if users is None else examples.subset(np.arange(min(users, len(examples))))


def users_dataset(info: dict[str, Any], index: ItemIndex, dataset: Dataset | None = None) -> Dataset:
    """The data set whose users a model of run ``info`` recommends for: ``dataset``, else the one it
    was trained on (:func:`~recspec.models.run_data.run_dataset`); one that cannot be read here is
    a one-line error saying to pass one."""
    if dataset is not None:
        return run_dataset(info, index, dataset)
    return recorded_dataset(info, index, "pass the data set whose users to recommend for (--dataset), or load the "
                                         "folder alone to answer raw histories (recspec.load)")


def users_of(dataset: Dataset | None) -> Dataset:
    """``dataset``, the data set whose users a recommender answers for; None (a recommender loaded
    from its model folder alone, for raw histories) is a one-line error saying how to give one."""
    if dataset is None:
        raise RecspecError("this recommender answers raw histories from its model folder alone; load it with the "
                           "data set whose users to recommend for (`recspec recommend`: the trained one or --dataset)")
    return dataset


def training_sequences(dataset: Dataset, info: dict[str, Any], index: ItemIndex) -> list[np.ndarray]:
    """Each user's items in the training part of the split a model was trained with (its run
    ``info``), as rows of ``index``, in time order (items the index lacks left out): what the
    item prior of ``--draft items`` is fitted on."""
    labels = run_split(dataset, info).labels
    inter = dataset.interactions
    rows = item_rows(index.item_keys, dataset.item_ids)[inter.items]
    train = np.flatnonzero((labels == 0) & (rows >= 0))
    train = train[np.lexsort((inter.timestamps[train], inter.users[train]))]
    starts = np.flatnonzero(np.diff(inter.users[train], prepend=-1))
    return np.split(rows[train], starts[1:])


def user_chunks(users: int, batch_size: int | None) -> list[range]:
    """The chunks of whole batches (about :data:`PROGRESS_CHUNK` users each) that
    :meth:`Recommender.recommend` decodes one after another, chunk ``i`` of a sampling decoder
    seeded with ``seed + i``; a job spread over workers decodes the same chunks with the same
    seeds, so its results equal the single-process ones."""
    size = batch_size or users
    chunk = size * max(1, PROGRESS_CHUNK // size)
    return [range(start, min(start + chunk, users)) for start in range(0, users, chunk)]


def check_folders(model_dir: str | Path, draft_dir: str | Path | Sequence[str | Path] | None = None
                  ) -> tuple[Path, dict[str, Any], list[Path], list[Path]]:
    """What :meth:`Recommender.load` checks before loading any weights: the target's trained
    folder and run info, then the drafts (:func:`check_drafts`), so that a damaged draft is
    named first. The named drafts (``--draft items``, ``--draft root``) have no folders."""
    folder, info = run_info(Path(model_dir))
    models, heads = ([], []) if named_draft(draft_dir) else check_drafts(draft_dir)
    return folder, info, models, heads


def folder_precisions(dtype: str, draft_dtype: str | None, device: str, folder: Path, models: Sequence[Path],
                      heads: Sequence[Path], draft_dir: str | Path | Sequence[str | Path] | None) -> Precisions:
    """The dtypes of a target ``folder`` and the drafts :func:`check_folders` found for ``draft_dir``
    on ``device`` (:func:`~recspec.precision.resolve_pair`: only a draft model takes its own), a
    saved dtype read from the model folders once checked (:func:`trained_model_dir`)."""
    tied = "a head or prior" if heads else named_draft(draft_dir)
    return resolve_pair(dtype, draft_dtype, device, folder, models[0] if models else None, tied, trained_model_dir)


def named_draft(draft_dir: str | Path | Sequence[str | Path] | None) -> str | None:
    """The draft a ``--draft`` value names instead of a folder, if it does: ``items`` (the item
    prior, :data:`~recspec.decoding.item_prior.ITEM_DRAFT`) or ``root`` (the unfitted target
    prior, :data:`~recspec.decoding.target_prior.ROOT_DRAFT`); else None."""
    name = str(draft_dir) if isinstance(draft_dir, (str, Path)) else None
    return name if name in (ITEM_DRAFT, ROOT_DRAFT) else None


def check_drafts(draft_dir: str | Path | Sequence[str | Path] | None) -> tuple[list[Path], list[Path]]:
    """The draft models and heads of ``draft_dir`` (:func:`draft_kinds`): at most one of each,
    each folder readable; a target prior (:mod:`recspec.decoding.target_prior`) comes alone, in the
    heads' place (it is tied to its target's folder as a head is)."""
    kinds = draft_kinds(draft_dir)
    priors = [path for kind, path in kinds if kind == PRIOR_KIND]
    heads = [path for kind, path in kinds if kind == HEAD_KIND]
    models = [path for kind, path in kinds if kind == MODEL_KIND]
    if priors and len(kinds) > 1:
        raise RecspecError("a target prior (`recspec align prior`) drafts alone; give --draft that folder only")
    if len(heads) > 1 or len(models) > 1:
        raise RecspecError(f"--draft takes a draft model, a head, or a model and a head joined by '+' "
                           f"(got {len(models)} models and {len(heads)} heads)")
    for path in priors:
        read_prior_config(path)
    for path in heads:
        read_head_config(head_dir(path))
    for path in models:
        trained_model_dir(path)
    return models, [*priors, *heads]


def check_k(k: int | None, index: ItemIndex, source: str | Path) -> None:
    """Refuse ``k`` (the items to be asked for; None: not known yet) outside ``[1, items of index]``."""
    if k is not None and not 1 <= k <= len(index.item_keys):
        raise RecspecError(f"k={k} is outside [1, {len(index.item_keys)}]: the item index of {source} has "
                           f"{len(index.item_keys)} items")


def draft_kinds(draft_dir: str | Path | Sequence[str | Path] | None, infer: bool = True
                ) -> list[tuple[str | None, Path]]:
    """(kind, folder) of each part of a ``--draft`` value: ``model:PATH``, ``head:PATH`` or
    ``prior:PATH`` (:data:`DRAFT_KINDS`), ``model:PATH+head:PATH``; a part without a kind has
    the one its folder's files say (:func:`inferred_kind`; None unless ``infer``)."""
    if draft_dir is None:
        return []
    parts = str(draft_dir).split("+") if isinstance(draft_dir, (str, Path)) else [str(part) for part in draft_dir]
    out: list[tuple[str | None, Path]] = []
    for part in parts:
        kind, sep, path = part.partition(":")
        if sep and kind in DRAFT_KINDS:
            out.append((kind, Path(path)))
        else:
            out.append((inferred_kind(Path(part)) if infer else None, Path(part)))
    return out


def inferred_kind(path: Path) -> str:
    """The draft kind of a folder given without one: a target prior, a head, else a draft model."""
    return PRIOR_KIND if is_prior_dir(path) else HEAD_KIND if is_head_dir(path) else MODEL_KIND


def draft_spelling(draft_dir: str | Path | Sequence[str | Path] | None) -> str | None:
    """The ``--draft`` value with every part's kind written out (None: it names one already, or
    names a draft of :func:`named_draft`)."""
    if draft_dir is None or named_draft(draft_dir) or all(kind for kind, _ in draft_kinds(draft_dir, infer=False)):
        return None
    return "+".join(f"{kind}:{path}" for kind, path in draft_kinds(draft_dir))


def check_finite_scores(topk: TopK, user_ids: Sequence[str]) -> None:
    """Refuse results whose real items (index >= 0) carry a NaN or infinite score: a damaged or
    diverged model, whose items are garbage. ``user_ids``: the raw user id of each row."""
    bad = ((topk.items >= 0) & ~topk.scores.isfinite()).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise RecspecError(f"user {user_ids[bad[0]]} (and {len(bad) - 1} more): the model gave non-finite scores "
                           f"(NaN or inf); its weights are damaged or diverged, so nothing was written")


def recs_text(recommender: Recommender, examples: Examples, topk: TopK) -> str:
    """One JSON line per example (user, items as raw ids best first, scores); non-finite scores
    are refused (see :func:`check_finite_scores`), so every line is valid JSON."""
    keys = recommender.index.item_keys
    users = [users_of(recommender.dataset).user_ids[user] for user in examples.users.tolist()]
    check_finite_scores(topk, users)
    rows, scores = topk.items.cpu().tolist(), topk.scores.cpu().tolist()
    return "".join(dumps_strict({"user": user, "items": [keys[i] for i in items if i >= 0],
                                 "scores": [round(v, 6) for v, i in zip(values, items) if i >= 0]}) + "\n"
                   for user, items, values in zip(users, rows, scores))


def write_recs(path: Path, recommender: Recommender, examples: Examples, topk: TopK) -> None:
    """The lines of :func:`recs_text`, written atomically."""
    write_text_atomic(Path(path), recs_text(recommender, examples, topk))


def read_recs(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a recommendations file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise RecspecError(f"{path}: file not found")
    rows = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise RecspecError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None
            if not isinstance(row, dict) or "user" not in row or not isinstance(row.get("items"), list):
                raise RecspecError(f"{path}:{lineno}: expected an object with 'user' and a list 'items'")
            rows.append(row)
    if not rows:
        raise RecspecError(f"{path}: no recommendations")
    return rows


def evaluate_recs(rows: Sequence[dict[str, Any]], dataset: Dataset, examples: Examples,
                  ks: Sequence[int] = (5, 10)) -> dict[str, float]:
    """Recall@k / NDCG@k of recommendation rows against the targets of ``examples`` (matched by user)."""
    by_user = {dataset.user_ids[u]: i for i, u in enumerate(examples.users.tolist())}
    missing = [str(row["user"]) for row in rows if str(row["user"]) not in by_user]
    if missing:
        raise RecspecError(f"user(s) {', '.join(missing[:5])} have no targets in this split; "
                           f"evaluate with the data set and split the recommendations were made for")
    width = max(ks)
    ranked = np.full((len(rows), width), -1, dtype=np.int64)
    for r, row in enumerate(rows):  # once per user, outside any decoding loop
        items = item_rows(dataset.item_ids, row["items"][:width])
        ranked[r, :len(items)] = items
    targets = [examples.targets(by_user[str(row["user"])]) for row in rows]
    metrics = recall_ndcg(ranked, targets, ks)
    return {"users": len(rows), **metrics}
