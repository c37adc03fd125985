"""One model's KV cache over ``B`` rows of text of different lengths: the text round loop's target
cache (:mod:`recspec.decoding.text_rounds`), and a chain drafter's draft-model cache
(:mod:`recspec.decoding.chains`).

A row's text is tracked as the cached positions it may attend to (``visible``) and its token count
(the position id of the next token). A round feeds nodes after every row's text, in one call (a
token tree, or a chain: one child per node) or several (a drafter that scores one token at a time);
:meth:`TextCache.keep` then keeps each row's accepted path. The tail that no row keeps is cut off
without a copy (all a single row ever needs), and only when some row keeps less than what is left
are the rows compacted (:func:`~recspec.decoding.cache.compact`). By default the columns cached
before the round stay where they are, so only the round's kept nodes after the first one some row
drops are copied, and a row's left padding and the fill of rows that kept fewer stay, hidden (the
cheaper copy for trees of many nodes). With ``drop_hidden`` a compaction drops every position no
row sees instead, the padding and the fill included: the chain decoders' layout, on which their
seeded outputs depend to the last bit (through the rounding of attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from recspec.decoding.cache import compact, drop_tail, require_full_attention, select_rows
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import forward_features, forward_visible
from recspec.decoding.tree import node_depths, tree_rows
from recspec.hub import keep_logits_at, returned_cache
from recspec.models.text_head import layer_features


@dataclass
class TextCache:
    """One model's KV cache over ``B`` rows of text (see the module doc).

    ``visible``: bool ``[B, T]``, the cached positions that hold the row's text (what its next
    tokens attend to), including the nodes fed since the last :meth:`keep`; ``count``: int64
    ``[B]``, the row's tokens in the cache as of the last keep (the position id of the first node
    fed after it); ``fed``: nodes fed to every row since then; ``drop_hidden``: compaction drops
    every position no row sees (module doc).
    """

    cache: Any
    visible: torch.Tensor
    count: torch.Tensor
    fed: int = 0
    drop_hidden: bool = False

    @staticmethod
    def start(model, prompts: Prompts, lag: int, features: bool = False, layers: Sequence[int] = (),
              drop_hidden: bool = False) -> tuple[TextCache, torch.Tensor, torch.Tensor | None]:
        """Prefill every prompt but its last ``lag`` tokens (every prompt must be longer): the cache,
        the logits after the last prefilled column ``[B, V]`` (the output layer runs there only)
        and, with ``features``, the model's features at the prefilled columns ``[B, P - lag, H]``
        (``(len(layers) + 1) * H`` wide with the outputs of ``layers``:
        :func:`~recspec.models.text_head.layer_features`), else None; ``drop_hidden`` as the class
        doc. An unpadded batch is fed without a mask (the model's own causal attention)."""
        width = prompts.input_ids.shape[1] - lag
        ids, mask, positions = (part[:, :width] for part in (prompts.input_ids, prompts.attention_mask,
                                                               prompts.position_ids))
        padded = not bool(mask.all())
        out = model(input_ids=ids, attention_mask=mask if padded else None, position_ids=positions if padded else None,
                    use_cache=True, output_hidden_states=features, **keep_logits_at(model, 1))
        cache = returned_cache(out)
        require_full_attention(cache)
        read = layer_features(model, out.hidden_states, layers) if features else None
        text = TextCache(cache, mask.bool(), prompts.lengths - lag, drop_hidden=drop_hidden)
        return text, out.logits[:, -1], read

    def extend(self, n: int, ancestors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``n`` nodes fed to every row (``ancestors`` as :meth:`feed`): returns what they
        attend to, bool ``[B, n, T + n]`` (``T`` cached positions), and their position ids, int64
        ``[B, n]``."""
        batch = self.visible.shape[0]
        if ancestors is None:
            ancestors = torch.ones(n, n, dtype=torch.bool, device=self.visible.device).tril().expand(batch, n, n)
        rows = tree_rows(self.visible, ancestors)
        positions = (self.count + self.fed)[:, None] + node_depths(ancestors)
        self.visible = torch.cat((self.visible, self.visible.new_ones(batch, n)), dim=1)
        self.fed += n
        return rows, positions

    def feed(self, model, tokens: torch.Tensor, ancestors: torch.Tensor | None = None, features: bool = False,
             layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``n`` nodes per row (int64 ``[B, n]``) after its text and the nodes fed since the
        last :meth:`keep`: the logits after each ``[B, n, V]`` and, with ``features``, the model's
        features at them ``[B, n, H]`` (wider with ``layers``:
        :func:`~recspec.decoding.scorer.forward_features`), else None. ``ancestors``: bool
        ``[B, n, n]`` (:func:`~recspec.decoding.tree.ancestor_matrix`) of a tree among the nodes,
        each at position ``count + fed + depth``; None: a chain (each node sees the ones before it)."""
        rows, positions = self.extend(tokens.shape[1], ancestors)
        if features:
            return forward_features(model, self.cache, tokens, rows, positions, layers=layers)
        return forward_visible(model, self.cache, tokens, rows, positions), None

    def keep(self, path: torch.Tensor) -> None:
        """Of the nodes fed since the last keep, keep in row ``b`` those where ``path[b]`` (bool
        ``[B, fed]``: a root path, in cache order) is True; the others leave (see the module doc)."""
        cached = self.visible.shape[1] - self.fed
        columns = torch.arange(1, self.fed + 1, device=path.device)
        longest = int((path * columns).max()) if path.numel() else 0  # the last column any row keeps
        if self.fed > longest:
            drop_tail(self.cache, self.fed - longest)
        visible = torch.cat((self.visible[:, :cached], path[:, :longest]), dim=1)
        self.count, self.fed = self.count + path.sum(dim=1), 0
        if not bool(path[:, :longest].all()):
            if self.drop_hidden:
                _, visible = compact([self.cache], visible)
            else:
                kept = torch.cat((torch.ones_like(visible[:, :cached]), path[:, :longest]), dim=1)
                positions, filled = compact([self.cache], kept)
                visible = visible.gather(1, positions) & filled
        self.visible = visible

    def keep_first(self, kept: torch.Tensor) -> None:
        """:meth:`keep` the first ``kept[b]`` (int64 ``[B]``) nodes fed to row ``b`` (a chain's)."""
        self.keep(torch.arange(self.fed, device=kept.device)[None, :] < kept[:, None])

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (int64 index)."""
        select_rows(self.cache, rows)
        self.visible, self.count = self.visible[rows], self.count[rows]
