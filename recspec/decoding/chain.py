"""A chain of text per row: one model's KV cache over ``B`` rows of text of different lengths,
as the chain decoders (speculative sampling, TopK-ImpSpecDec) keep it.

What a row has accepted so far is tracked as the cached positions it may attend to; after every
round the rejected tail that no row keeps is cut off without a copy (the whole rejection for a
single row), the rest compacted away, and rows leave the batch when they finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from recspec.decoding.cache import compact, drop_tail, select_rows
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import forward_features, forward_visible, next_log_probs, prefill, prefill_features
from recspec.decoding.tree import tree_rows


@dataclass
class Chain:
    """One model's KV cache over ``B`` rows of text of different lengths (a causal LM's, or a text
    head's: :class:`~recspec.decoding.chain_drafts.HeadChainDraft`).

    ``visible``: bool ``[B, T]``, the cached positions that hold the row's text (what the row's
    next tokens attend to), including the tokens fed since the last :meth:`keep`; ``count``: int64
    ``[B]``, the row's tokens in the cache as of the last keep (the position id of the first token
    fed after it); ``fed``: tokens fed to every row since then.
    """

    cache: Any
    visible: torch.Tensor
    count: torch.Tensor
    fed: int = 0

    @staticmethod
    def start(model, prompts: Prompts, lag: int, features: bool = False, layers: Sequence[int] = ()
              ) -> tuple[Chain, torch.Tensor | None]:
        """Prefill every prompt but its last ``lag`` tokens (every prompt must be longer); with
        ``features``, also return the model's features at the prefilled columns ``[B, P - lag, H]``
        (``(len(layers) + 1) * H`` wide with the outputs of ``layers``:
        :func:`~recspec.decoding.scorer.prefill_features`), else None."""
        width = prompts.input_ids.shape[1] - lag
        head = Prompts(input_ids=prompts.input_ids[:, :width], attention_mask=prompts.attention_mask[:, :width],
                       position_ids=prompts.position_ids[:, :width], lengths=prompts.lengths - lag,
                       pad_token_id=prompts.pad_token_id)
        if features:
            _, cache, hidden = prefill_features(model, head, layers)
        else:
            _, cache = prefill(model, head)
            hidden = None
        return Chain(cache=cache, visible=head.attention_mask.bool(), count=head.lengths.clone()), hidden

    def extend(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``n`` inputs fed to every row after its text (a chain: each sees the row's text,
        the ones fed before it and itself): returns what they attend to, bool ``[B, n, T + n]``
        (``T`` cached positions), and their position ids, int64 ``[B, n]``."""
        batch, device = self.visible.shape[0], self.visible.device
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # a chain's ancestors
        positions = (self.count + self.fed)[:, None] + torch.arange(n, device=device)
        rows = tree_rows(self.visible, causal.expand(batch, n, n))
        self.visible = torch.cat((self.visible, self.visible.new_ones(batch, n)), dim=1)
        self.fed += n
        return rows, positions

    def feed(self, model, tokens: torch.Tensor, features: bool = False, layers: Sequence[int] = ()
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``n`` tokens per row (int64 ``[B, n]``) after its text: float32 log-probs
        ``[B, n, V]`` after each, and with ``features`` the model's features at them ``[B, n, H]``
        (wider with ``layers``: :func:`~recspec.decoding.scorer.forward_features`), else None."""
        rows, positions = self.extend(tokens.shape[1])
        if features:
            logits, hidden = forward_features(model, self.cache, tokens, rows, positions, layers=layers)
            return next_log_probs(logits), hidden
        return next_log_probs(forward_visible(model, self.cache, tokens, rows, positions)), None

    def keep(self, kept: torch.Tensor) -> None:
        """Of the tokens fed since the last keep, keep the first ``kept[b]`` (int64 ``[B]``) in row
        ``b``; the others leave the cache: the tail no row keeps is cut off without a copy (all a
        single row ever needs), and only rows that keep fewer than the longest are compacted."""
        width, longest = self.visible.shape[1], int(kept.max()) if len(kept) else 0
        if self.fed > longest:
            drop_tail(self.cache, self.fed - longest)
        fresh = torch.arange(longest, device=kept.device)[None, :] < kept[:, None]
        self.visible = torch.cat((self.visible[:, :width - self.fed], fresh), dim=1)
        self.count, self.fed = self.count + kept, 0
        if not bool(fresh.all()):
            _, self.visible = compact([self.cache], self.visible)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (int64 index)."""
        select_rows(self.cache, rows)
        self.visible, self.count = self.visible[rows], self.count[rows]
