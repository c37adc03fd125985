"""recspec inside transformers' ``generate``: a drop-in for constrained beam search over items.

A generative recommender trained elsewhere (LC-Rec, MiniOneRec style: a causal LM whose tokenizer
holds the identifier tokens, an index file mapping each item to its tokens) is usually decoded with
``model.generate(num_beams=K, num_return_sequences=K, prefix_allowed_tokens_fn=...)``. Two ways
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
* :class:`TrieConstraint` is a ``LogitsProcessor`` for users who keep transformers' own beam
  search: the trie's allowed tokens as one vectorized mask per step instead of a Python callback
  per beam.

The index is a path to an ``item_index.json`` (``{"item": ["<a_1>", "<b_2>", ...]}``, LC-Rec's
layout) or an :class:`~recspec.itemids.index.ItemIndex`; ``end_with_eos`` appends the tokenizer's
end-of-sequence token to every identifier, for models trained (and constrained) to close an item
with it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LogitsProcessor
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from recspec.accel import accelerate
from recspec.decoding.beams import TopK
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
#: Generation settings the drop-in cannot honour (it returns no per-step tensors, and samples nothing).
UNSUPPORTED = ("do_sample", "output_logits", "output_attentions", "output_hidden_states")
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
        trie = self.trie
        nodes = trie.walk(input_ids[:, self.prompt_length:])
        allowed = trie.allowed_mask(nodes)
        if allowed.shape[1] < scores.shape[1]:
            allowed = torch.nn.functional.pad(allowed, (0, scores.shape[1] - allowed.shape[1]))
        return scores.masked_fill(~allowed[:, :scores.shape[1]], -torch.inf)


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

    def __call__(self, model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, **model_kwargs) -> torch.Tensor | GenerateBeamDecoderOnlyOutput:
        """``input_ids`` ``[B * max(num_beams, num_return_sequences), W]`` as ``generate`` expands
        them; the best ``num_return_sequences`` items of each prompt, best first."""
        config, trie = generation_config, self.trie
        asked = [name for name in UNSUPPORTED if getattr(config, name, False)]
        if asked:
            raise RecspecError(f"trie_beam_search returns items and their scores only; it does not support "
                               f"{', '.join(asked)}")
        k, n = config.num_beams, config.num_return_sequences
        expand, width = max(k, n), input_ids.shape[1]
        if config.max_length - width < trie.depth:
            raise RecspecError(f"identifiers take {trie.depth} new tokens; generate allows "
                               f"{config.max_length - width} (raise max_new_tokens)")
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
        pad = config._pad_token_tensor
        pad_id = int(pad) if pad is not None else int(self.tokenizer.pad_token_id or 0)
        topk = self.decode(model, prompts, self.tries[device], k, pad_id)
        tokens = topk.tokens[:, :n].reshape(len(prompts) * n, trie.depth)
        sequences = torch.cat((rows.repeat_interleave(n, dim=0), tokens.to(rows.dtype)), dim=1)
        if not config.return_dict_in_generate:
            return sequences
        scores = topk.scores[:, :n].reshape(-1) / trie.depth ** config.length_penalty
        return GenerateBeamDecoderOnlyOutput(sequences=sequences,
                                             sequences_scores=scores if config.output_scores else None)

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
