"""The peer every item decoder is tested against: transformers' own constrained beam search.

``model.generate(num_beams=k, num_return_sequences=k, prefix_allowed_tokens_fn=...)`` over the item
trie, the way LC-Rec and AtSpeed run inference (see :mod:`recspec.decoding.beam_search` for how its
scores are computed and why recspec's decoders return the same items).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import partial

import torch
from transformers import GenerationConfig

from recspec.decoding.beams import TopK
from recspec.decoding.prompts import Prompts, decode_in_batches
from recspec.decoding.scorer import next_log_probs
from recspec.itemids.trie import ItemTrie


def _hf_decode(
    allowed: dict[tuple[int, ...], list[int]], model, prompts: Prompts, trie: ItemTrie, k: int
) -> TopK:
    """``model.generate`` beam search for one batch, constrained by the ``allowed`` table."""
    batch, width = prompts.input_ids.shape
    depth = trie.depth

    def prefix_allowed_tokens(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        return allowed[tuple(input_ids[width:].tolist())]

    settings = dict(max_new_tokens=depth, do_sample=False, pad_token_id=prompts.pad_token_id,
                    repetition_penalty=1.0, no_repeat_ngram_size=0, return_dict_in_generate=True)
    if k == 1:  # generate runs greedy search, which returns raw logits instead of beam scores
        config = GenerationConfig(num_beams=1, output_logits=True, **settings)
    else:
        config = GenerationConfig(num_beams=k, num_return_sequences=k, length_penalty=0.0,
                                  early_stopping=True, output_scores=True, **settings)
    out = model.generate(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        generation_config=config,
        prefix_allowed_tokens_fn=prefix_allowed_tokens,
    )
    tokens = out.sequences[:, width:]  # [B*K, L]
    if k == 1:
        scores = torch.zeros(batch, dtype=torch.float32, device=tokens.device)
        for step, logits in enumerate(out.logits):
            scores = scores + next_log_probs(logits).gather(1, tokens[:, step : step + 1])[:, 0]
    else:
        scores = out.sequences_scores.float()
    return TopK(
        items=trie.items(trie.walk(tokens)).view(batch, k),
        scores=scores.view(batch, k),
        tokens=tokens.reshape(batch, k, depth),
    )


_ALLOWED_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def allowed_tokens_table(trie: ItemTrie) -> dict[tuple[int, ...], list[int]]:
    """Every non-leaf prefix of the trie -> its allowed next tokens (sorted), built once per trie
    (as LC-Rec precomputes its prefix table), so HF's constraint is a dict lookup per beam."""
    if trie not in _ALLOWED_TABLES:
        table = {}
        nodes, prefixes = torch.tensor([trie.root], device=trie.device), [()]
        for _ in range(trie.depth):
            tokens, real = trie.children(nodes)
            for prefix, row, keep in zip(prefixes, tokens.tolist(), real.tolist()):
                table[prefix] = [token for token, ok in zip(row, keep) if ok]
            parent, slot = real.nonzero(as_tuple=True)
            child_tokens = tokens[parent, slot]
            nodes = trie.step(nodes[parent], child_tokens)
            prefixes = [prefixes[p] + (t,) for p, t in zip(parent.tolist(), child_tokens.tolist())]
        _ALLOWED_TABLES[trie] = table
    return _ALLOWED_TABLES[trie]


def hf_beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None = None,
) -> TopK:
    """Top-``k`` items per prompt by transformers' ``model.generate`` beam search (the peer).

    ``num_beams=k, num_return_sequences=k, max_new_tokens=L, do_sample=False,
    length_penalty=0.0, early_stopping=True`` and a ``prefix_allowed_tokens_fn`` that maps the
    generated suffix to the trie's allowed tokens (a precomputed dict, as in LC-Rec); ``k = 1`` is
    generate's greedy search, scored from its raw logits. Other settings of the model's
    ``generation_config`` still apply (e.g. its ``eos_token_id``, harmless unless it is an
    identifier token); ``repetition_penalty`` and ``no_repeat_ngram_size`` are neutralised.

    ``prompts``: one 1-D int tensor per user (lengths may differ); batches of ``batch_size`` users
    (all if None) are left-padded with ``pad_token_id``.
    """
    decode = partial(_hf_decode, allowed_tokens_table(trie))
    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)
