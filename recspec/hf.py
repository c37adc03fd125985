"""recspec inside transformers' ``generate``: a drop-in for constrained beam search over items.

A generative recommender trained elsewhere (LC-Rec, MiniOneRec style: a causal LM whose tokenizer
holds the identifier tokens, an index file mapping each item to its tokens) is usually decoded with
``model.generate(num_beams=K, num_return_sequences=K, prefix_allowed_tokens_fn=...)``. Three ways
to keep that call:

* :func:`trie_beam_search` returns a callable for transformers 5's ``custom_generate``:
  ``model.generate(**inputs, custom_generate=trie_beam_search(index, tokenizer), num_beams=10,
  num_return_sequences=10)`` returns what the constrained ``generate`` returns (the same
  sequences in the same order; with ``return_dict_in_generate`` a ``GenerateBeamDecoderOnlyOutput``
  whose ``sequences_scores``, with ``output_scores``, are the items' log-probabilities divided by
  the generated length to the power ``length_penalty``, as transformers computes them; the
  per-step ``scores`` are not kept and stay None), decoded by recspec's ``tree-beam`` (one target call per
  identifier level, no cache copies), or by strict speculative beam search with a ``draft``
  (a causal LM with the same tokenizer). ``decoder="auto"`` (the default) runs ``tree-beam``
  without a draft; with one, the first call for a K and batch size times both on its first
  batch and keeps the faster (logged on the ``recspec.hf`` logger, kept in ``.choices``). A bare
  model has no folder to keep measurements in, so the choice lives as long as the callable. A
  model the lean forward serves (:mod:`recspec.accel.lean_forward`: a float32 Llama with
  multi-head attention, on the CPU) is called through it by recspec's decoders, bit for bit what
  its own forward computes; ``generate`` itself, and every other model, keep transformers' forward
  (the models are the caller's: :func:`~recspec.accel.accelerate` with ``borrowed``).
  ``generate``'s arguments and the checkpoint's ``generation_config.json`` hold: the logits
  processors they make (``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``, a
  caller's ``logits_processor``, ...) apply to the trie-masked scores as transformers applies
  them, the stopping criteria are asked as transformers asks them, and what cannot be honoured
  (sampling, group or constrained beam search, ``max_time``, per-step outputs, a criterion that
  cuts an identifier) is refused in one line (:mod:`recspec.dropin_contract`). Processors and
  criteria that can act run ``tree-beam`` (or ``beam``) with all of a call's prompts in one batch.
* :func:`custom_generate_path` is the same decoder as a transformers Hub ``custom_generate``
  folder: ``model.generate(**inputs, custom_generate=str(custom_generate_path()),
  trust_remote_code=True, item_index="item_index.json", tokenizer=tokenizer, num_beams=10, ...)``.
* :class:`TrieConstraint` is a ``LogitsProcessor`` for users who keep transformers' own beam
  search: the trie's allowed tokens as one vectorized mask per step instead of a Python callback
  per beam.

The index is a path to an ``item_index.json`` (``{"item": ["<a_1>", "<b_2>", ...]}``, LC-Rec's
layout) or an :class:`~recspec.itemids.index.ItemIndex`; ``end_with_eos`` appends the tokenizer's
end-of-sequence token to every identifier, for models trained (and constrained) to close an item
with it.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from recspec.accel import accelerate
from recspec.decoding.beam_search import PerBeamCache, TreeCache, beam_decode
from recspec.decoding.beams import TopK
from recspec.decoding.prompts import decode_in_batches
from recspec.dropin_contract import (ProcessedSelect, check_items, check_length, mask_outside, needs_checking,
                                     pad_token_id, refuse_unsupported)
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.itemids.trie import ItemTrie
from recspec.models.tokenizer import check_same_vocabulary, identifier_token_ids
from recspec.decoding.registry import ITEMS, decoder as registered
from recspec.recommend import AUTO, BEAM, SPEC_STRICT, TREE_BEAM, DecodeOptions, run_decoder

#: Decoders the drop-in runs: ``auto`` and the exact ones (the same items as transformers' beam search).
DROP_IN_DECODERS = (AUTO, TREE_BEAM, BEAM, SPEC_STRICT)
#: How much faster ``spec-strict`` must be timed than ``tree-beam`` for ``auto`` to choose it.
PROBE_MARGIN = 0.03
logger = logging.getLogger(__name__)


def item_trie(index: str | Path | ItemIndex, tokenizer, end_with_eos: bool = False) -> ItemTrie:
    """The trie of ``index``'s identifiers as ``tokenizer``'s token ids (each identifier token
    must be one token of its vocabulary: missing ones are named), closed by the end-of-sequence
    token with ``end_with_eos``."""
    if not isinstance(index, ItemIndex):
        index = ItemIndex.load(Path(index))
    if end_with_eos and tokenizer.eos_token_id is None:
        raise RecspecError("end_with_eos: the tokenizer has no end-of-sequence token")
    return index.trie(identifier_token_ids(tokenizer, index), len(tokenizer),
                      end_token=tokenizer.eos_token_id if end_with_eos else None)


def check_vocabulary(model, trie: ItemTrie, name: str = "model") -> None:
    """Refuse a model whose output layer is smaller than the trie's token ids need."""
    size = model.get_output_embeddings().weight.shape[0]
    if trie.vocab_size > size:
        raise RecspecError(f"the {name} scores {size} tokens, but the index's tokenizer has {trie.vocab_size}: "
                           f"resize its embeddings to the tokenizer (model.resize_token_embeddings) or use its own "
                           f"tokenizer")


class TrieConstraint(LogitsProcessor):
    """Allow only tokens that continue the generated suffix towards an item of the trie (and
    ``-inf`` everywhere else), for transformers' own ``generate``; ``prompt_length``: the width of
    the (left-padded) prompt, after which generation starts."""

    def __init__(self, trie: ItemTrie, prompt_length: int) -> None:
        self.trie, self.prompt_length = trie, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``[N, prompt + t]``, ``scores`` float ``[N, V]``: the masked scores."""
        if self.trie.device != input_ids.device:
            self.trie = self.trie.to(input_ids.device)
        return mask_outside(self.trie, self.trie.walk(input_ids[:, self.prompt_length:]), scores)


@dataclass(frozen=True)
class DropInChoice:
    """What ``decoder="auto"`` runs for one (device, K, batch size): ``decoder``; ``ms_per_user``:
    per candidate timed, ms per prompt on the probe; ``reason``: one line saying why."""

    decoder: str
    ms_per_user: dict[str, float]
    reason: str


class TrieBeamSearch:
    """The ``custom_generate`` callable of :func:`trie_beam_search`; ``choices`` holds what
    ``auto`` chose so far, per ``(device, K, batch size)``."""

    def __init__(self, trie: ItemTrie, tokenizer, draft, decoder: str, options: DecodeOptions,
                 batch_size: int | None) -> None:
        self.trie, self.tokenizer, self.draft, self.decoder = trie, tokenizer, draft, decoder
        self.options, self.batch_size = options, batch_size
        self.tries: dict[torch.device, ItemTrie] = {}
        self.choices: dict[tuple[str, int, int], DropInChoice] = {}

    def __call__(self, model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList | None = None,
                 stopping_criteria: StoppingCriteriaList | None = None,
                 generation_config: GenerationConfig | None = None,
                 **model_kwargs) -> torch.Tensor | GenerateBeamDecoderOnlyOutput | GenerateDecoderOnlyOutput:
        """``input_ids`` ``[B * max(num_beams, num_return_sequences), W]`` as ``generate`` expands
        them; the best ``num_return_sequences`` items of each prompt, best first, as transformers'
        constrained beam search (greedy search for ``num_beams=1``) returns them, under the
        call's processors and stopping criteria (:mod:`recspec.dropin_contract`)."""
        config, trie = generation_config, self.trie
        refuse_unsupported(config)
        k, n = config.num_beams, config.num_return_sequences
        expand, width = max(k, n), input_ids.shape[1]
        check_length(config, width, trie)
        check_vocabulary(model, trie)
        for decoder in (model, self.draft):  # checked once per model; recspec's calls only, never generate's
            if decoder is not None:
                accelerate(decoder, borrowed=True)
        device = input_ids.device
        if device not in self.tries:
            self.tries[device] = trie.to(device)
        rows = input_ids[::expand]  # [B, W]: one copy of each prompt
        mask = model_kwargs.get("attention_mask")
        keep = torch.ones_like(rows, dtype=torch.bool) if mask is None else mask[::expand].bool()
        prompts = [row[kept] for row, kept in zip(rows, keep)]  # one per user, left padding dropped
        pad_id = pad_token_id(config, self.tokenizer)
        processors = logits_processor if logits_processor is not None else LogitsProcessorList()
        criteria = stopping_criteria if stopping_criteria is not None and needs_checking(
            stopping_criteria, config, trie) else None
        if processors or criteria is not None:
            topk = self.decode_processed(model, input_ids, prompts, self.tries[device], config, pad_id, processors,
                                         criteria)
        else:
            topk = self.decode(model, prompts, self.tries[device], k, pad_id)
        tokens = topk.tokens[:, :n].reshape(len(prompts) * n, trie.depth)
        sequences = torch.cat((rows.repeat_interleave(n, dim=0), tokens.to(rows.dtype)), dim=1)
        if not config.return_dict_in_generate:
            return sequences
        if k == 1:  # greedy search's output: no sequence scores
            return GenerateDecoderOnlyOutput(sequences=sequences)
        scores = topk.scores[:, :n].reshape(-1) / trie.depth ** config.length_penalty
        return GenerateBeamDecoderOnlyOutput(sequences=sequences,
                                             sequences_scores=scores if config.output_scores else None)

    def decode_processed(self, model, input_ids: torch.Tensor, prompts: list[torch.Tensor], trie: ItemTrie,
                         config: GenerationConfig, pad_id: int, processors: LogitsProcessorList,
                         criteria: StoppingCriteriaList | None) -> TopK:
        """Top-``num_beams`` of every prompt under ``generate``'s ``processors`` and ``criteria``
        (:class:`~recspec.dropin_contract.ProcessedSelect`), by ``tree-beam`` (``beam`` if asked):
        speculation checks drafts against the model's own log-probs, and all the call's prompts
        go in one batch, since a processor sees all of ``generate``'s rows (``input_ids``
        ``[B * K, W]``) at once."""
        k = config.num_beams
        names = ", ".join(type(each).__name__ for each in [*processors, *(criteria or [])])
        if k == 1 and processors:
            raise RecspecError(f"num_beams=1: greedy search applies the logits processors ({names}) to raw logits, "
                               f"the drop-in to log-probs as beam search does; use num_beams > 1")
        if self.decoder == SPEC_STRICT:
            raise RecspecError(f"decoder={SPEC_STRICT!r} does not apply generate's logits processors or stopping "
                               f"criteria ({names}); use {TREE_BEAM!r} or {AUTO!r}")
        if self.batch_size is not None and self.batch_size < len(prompts):
            raise RecspecError(f"batch_size={self.batch_size} with generate's logits processors or stopping criteria "
                               f"({names}): they see all {len(prompts)} prompts of a call at once; drop batch_size or "
                               f"call generate per batch")
        select = ProcessedSelect(input_ids, processors, criteria,
                                 keep_scores=bool(config.output_scores and config.return_dict_in_generate))
        state = partial(PerBeamCache, depth=trie.depth) if self.decoder == BEAM else TreeCache
        topk = decode_in_batches(partial(beam_decode, state, select=select, root=self.options.expand_root), model,
                                 prompts, trie, k, pad_id, None)
        check_items(topk, config.num_return_sequences, processors)
        return topk

    def decode(self, model, prompts: list[torch.Tensor], trie: ItemTrie, k: int, pad_id: int) -> TopK:
        """Top-``k`` of every prompt by the chosen decoder; under ``auto`` with a draft, the first
        call for a (device, K, batch size) decodes its first batch with both candidates, timed
        (:meth:`probe`), and keeps the faster for the rest (the answers are the same either way)."""
        if self.decoder != AUTO:
            return run_decoder(self.decoder, model, self.draft, prompts, trie, k, pad_id, self.options,
                               self.batch_size).topk
        rows = min(len(prompts), self.batch_size or len(prompts))
        key = (str(trie.device), k, rows)
        if key in self.choices:
            return run_decoder(self.choices[key].decoder, model, self.draft, prompts, trie, k, pad_id,
                               self.options, self.batch_size).topk
        if self.draft is None:
            self.choices[key] = DropInChoice(TREE_BEAM, {}, f"auto: {TREE_BEAM} (no draft given)")
            logger.info(self.choices[key].reason)
            return self.decode(model, prompts, trie, k, pad_id)
        first, self.choices[key] = self.probe(model, prompts[:rows], trie, k, pad_id)
        logger.info(self.choices[key].reason)
        if rows == len(prompts):
            return first
        rest = run_decoder(self.choices[key].decoder, model, self.draft, prompts[rows:], trie, k, pad_id,
                           self.options, self.batch_size).topk
        return TopK.cat([first, rest])

    def probe(self, model, prompts: list[torch.Tensor], trie: ItemTrie, k: int,
              pad_id: int) -> tuple[TopK, DropInChoice]:
        """Decode ``prompts`` (one batch) by ``tree-beam``, ``spec-strict`` and ``tree-beam`` again
        (its best time counts, so the first call's warm-up does not favour speculation): their top-K
        and the choice, ``spec-strict`` only where it was at least :data:`PROBE_MARGIN` faster."""
        seconds: dict[str, float] = {TREE_BEAM: math.inf}
        for name in (TREE_BEAM, SPEC_STRICT, TREE_BEAM):
            started = time.perf_counter()
            topk = run_decoder(name, model, self.draft if name == SPEC_STRICT else None, prompts, trie, k, pad_id,
                               self.options).topk
            seconds[name] = min(seconds.get(name, math.inf), time.perf_counter() - started)
        ms = {name: round(1e3 * value / len(prompts), 3) for name, value in seconds.items()}
        faster = seconds[SPEC_STRICT] < (1.0 - PROBE_MARGIN) * seconds[TREE_BEAM]
        chosen = SPEC_STRICT if faster else TREE_BEAM
        reason = (f"auto: {chosen} (timed on the first {len(prompts)} prompt(s) at K={k}: {TREE_BEAM} "
                  f"{ms[TREE_BEAM]:.1f}, {SPEC_STRICT} {ms[SPEC_STRICT]:.1f} ms per prompt; speculation runs only "
                  f"when {PROBE_MARGIN:.0%} faster)")
        return topk, DropInChoice(chosen, ms, reason)


def trie_beam_search(index: str | Path | ItemIndex, tokenizer, draft=None, decoder: str = AUTO,
                     end_with_eos: bool = False, draft_beams: int = 40, batch_size: int | None = None,
                     draft_tokenizer=None, expand_root: bool = False) -> TrieBeamSearch:
    """A ``custom_generate`` for transformers 5 (module doc). ``decoder``: ``auto`` (default:
    ``tree-beam`` without a draft; with one, whichever of ``tree-beam`` and ``spec-strict`` the
    first call measures faster, :meth:`TrieBeamSearch.decode`), ``tree-beam``, ``beam``, or
    ``spec-strict`` (needs ``draft``, drafting ``draft_beams`` sequences per level;
    ``draft_tokenizer``, when given, must map every token as ``tokenizer`` does);
    ``batch_size``: users decoded together (all if None); ``expand_root`` (``tree-beam`` only):
    the prompt's call also scores the first identifier level whole, one call fewer, the same
    answers (:class:`~recspec.decoding.beam_search.RootTreeCache`)."""
    if draft_tokenizer is not None:
        check_same_vocabulary(draft_tokenizer, tokenizer)
    trie = item_trie(index, tokenizer, end_with_eos)
    if decoder not in DROP_IN_DECODERS:
        raise RecspecError(f"the drop-in runs auto or the exact decoders {', '.join(DROP_IN_DECODERS[1:])}; "
                           f"got {decoder!r}")
    drafted = registered(decoder, ITEMS).drafted
    if drafted and draft is None:
        raise RecspecError(f"{decoder} needs a draft")
    if draft is not None and not drafted and decoder != AUTO:
        raise RecspecError(f"a draft is used by {AUTO} and {SPEC_STRICT} only, not by {decoder}")
    if expand_root and decoder != TREE_BEAM:
        raise RecspecError(f"expand_root is an option of decoder={TREE_BEAM!r}, not of {decoder!r}")
    if draft is not None:
        check_vocabulary(draft, trie, "draft")
    if batch_size is not None and batch_size < 1:
        raise RecspecError(f"batch_size must be at least 1, got {batch_size}")
    return TrieBeamSearch(trie, tokenizer, draft, decoder, DecodeOptions(draft_beams=draft_beams, expand_root=expand_root),
                          batch_size)


#: :func:`trie_beam_search`'s options after the index and the tokenizer, which the
#: ``custom_generate`` folder (:func:`custom_generate_path`) takes as ``generate`` keywords.
DROP_IN_OPTIONS = tuple(inspect.signature(trie_beam_search).parameters)[2:]


def custom_generate_path() -> Path:
    """The folder to pass as ``generate(custom_generate=..., trust_remote_code=True)``: a
    transformers Hub ``custom_generate`` repository (``README.md``, ``custom_generate/generate.py``
    and its ``requirements.txt``) whose ``generate`` builds :func:`trie_beam_search` from the
    call's ``item_index=`` and ``tokenizer=`` (and :data:`DROP_IN_OPTIONS`) and runs it; copy it
    to publish it beside a model on the Hub."""
    return Path(__file__).resolve().parent / "custom_generate_repo"


def refuse_streamer(streamer) -> None:
    """Refuse a ``generate`` streamer, as transformers refuses one with beam search: the drop-in
    decodes whole items and has no token to stream as it goes. (With the callable,
    ``generate`` itself consumes the streamer, and puts the prompt, before any
    ``custom_generate`` callable runs; only the folder sees it.)"""
    if streamer is not None:
        raise ValueError("`streamer` cannot be used with recspec's trie beam search, as transformers refuses it with "
                         "beam search: the items are decoded whole, with no tokens to stream")
