"""In-place selection and compaction of a transformers 5.x KV cache.

A ``transformers.DynamicCache`` holds one layer object per decoder layer in ``cache.layers``;
each initialised layer keeps ``keys`` and ``values`` tensors of shape ``[rows, kv_heads, seq,
head_dim]`` and grows them by ``torch.cat`` along ``seq`` when the model appends tokens. The
helpers here rewrite those tensors directly (one ``index_select`` / ``gather`` per tensor) instead
of relying on ``DynamicCache.reorder_cache`` / ``crop``, whose semantics have changed between
transformers versions (``crop`` now takes a negative count of tokens to drop).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from recspec.errors import RecspecError


def _kv_layers(cache) -> list:
    """The initialised layers of ``cache`` (layers that hold no tensors, e.g. ones that share
    another layer's cache, are skipped)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RecspecError(
            f"the model returned a {type(cache).__name__} as its KV cache; recspec's decoders need "
            f"a transformers 5 Cache with per-layer keys/values (e.g. DynamicCache)"
        )
    return [layer for layer in layers if layer.is_initialized]


def require_full_attention(cache) -> None:
    """Raise :class:`RecspecError` unless every layer of ``cache`` is a plain ``DynamicLayer``:
    full attention over every cached position, so an explicit mask over all of them is exact
    (sliding-window, linear-attention or quantised layers keep something else)."""
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise RecspecError(
                f"tree attention needs full-attention DynamicCache layers, but the model's cache "
                f"has a {type(layer).__name__}; use beam_search for this model"
            )


def cache_width(cache) -> int:
    """The positions ``cache`` holds per row (every initialised layer holds as many)."""
    return _kv_layers(cache)[0].keys.shape[2]


def select_rows(cache, rows: torch.Tensor) -> None:
    """Make row ``r`` of every layer's keys and values a copy of old row ``rows[r]``, in place.

    ``rows``: int64 ``[R]`` (on the cache's device), any old row indices, repeats allowed: expanding
    ``B`` prompt rows to ``B * K`` beam rows and reordering beams by their parents are both this.
    Costs one copy of the selected rows of every layer.
    """
    for layer in _kv_layers(cache):
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def gather_positions(cache, positions: torch.Tensor) -> None:
    """Keep, in row ``b`` of every layer, the cached positions ``positions[b]``, in that order.

    ``positions``: int64 ``[B, S']`` (on the cache's device) with ``B`` the cache's rows; every row
    keeps the same number ``S'`` of positions. Use it to drop dead tree nodes or to keep the
    accepted path of a verified tree; the caller must rebuild masks and keep position ids (which
    are not stored in the cache: keys are rotated when computed) consistent with the new layout.
    """
    for layer in _kv_layers(cache):
        layer.keys = _gather_sequence(layer.keys, positions)
        layer.values = _gather_sequence(layer.values, positions)


def drop_tail(cache, count: int) -> None:
    """Drop the last ``count`` cached positions of every row and layer (``count`` >= 1): each
    layer's keys and values become a view of the rest, nothing is copied."""
    for layer in _kv_layers(cache):
        layer.keys = layer.keys[:, :, :-count]
        layer.values = layer.values[:, :, :-count]


def compact_tail(cache, kept: int, positions: torch.Tensor) -> None:
    """Keep the first ``kept`` cached positions of every row, then the positions ``positions``.

    ``positions``: int64 ``[B, S']`` (on the cache's device), e.g. the accepted path of a tree
    appended after ``kept`` positions (any cached position may be read: the tail is gathered
    before it is written). The same result as :func:`gather_positions` over ``arange(kept)``
    followed by ``positions``, but in place: only the ``S'`` kept tail positions are copied (down
    to ``kept .. kept + S'``) and every layer's keys and values become a view of their first
    ``kept + S'`` positions, so the cost does not grow with the prefix.
    """
    for layer in _kv_layers(cache):
        for name in ("keys", "values"):
            states = getattr(layer, name)
            states[:, :, kept:kept + positions.shape[1]] = _gather_sequence(states, positions)
            setattr(layer, name, states[:, :, :kept + positions.shape[1]])


def compact(caches, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep, in row ``b`` of every cache of ``caches`` (all laid out alike), the cached positions
    where ``keep[b]`` (bool ``[B, W]``, ``W`` at most the cache width) is True, in order; drop the
    rest. Rows with fewer kept positions than the most are filled up with position 0.

    The leading positions that every row keeps (the prompt, and what no later round dropped) stay
    where they are: only the positions after them are copied (:func:`compact_tail`), so a round's
    compaction costs what its tail holds, not the whole cache.

    Returns ``positions`` int64 ``[B, W']``, the old position now at each new one, and ``filled``
    bool ``[B, W']``, False on the fill (which the caller must hide from every later token).
    """
    counts = keep.sum(dim=1)
    count = int(counts.max())
    positions = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :count]
    filled = torch.arange(count, device=positions.device)[None, :] < counts[:, None]
    positions = positions.masked_fill_(~filled, 0)
    lead = int(keep.all(dim=0).cumprod(dim=0).sum())  # kept by every row, up to the first drop
    if lead < keep.shape[1]:
        for cache in caches:
            compact_tail(cache, lead, positions[:, lead:])
    return positions, filled


def _gather_sequence(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``states[b, :, positions[b, s], :]``: ``[B, heads, S', dim]`` from ``[B, heads, S, dim]``."""
    index = positions[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
    return states.gather(2, index)
