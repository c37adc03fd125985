"""A chain of text per row: one model's KV cache over ``B`` rows of text of different lengths,
as the chain decoders (speculative sampling, TopK-ImpSpecDec) keep it.

What a row has accepted so far is tracked as the cached positions it may attend to; rejected
positions are compacted away after every round, and rows leave the batch when they finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from recspec.decoding.cache import compact, select_rows
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import forward_visible, next_log_probs, prefill
from recspec.decoding.tree import tree_rows


@dataclass
class Chain:
    """One model's KV cache over ``B`` rows of text of different lengths.

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
    def start(model, prompts: Prompts, lag: int) -> Chain:
        """Prefill every prompt but its last ``lag`` tokens (every prompt must be longer)."""
        width = prompts.input_ids.shape[1] - lag
        head = Prompts(input_ids=prompts.input_ids[:, :width], attention_mask=prompts.attention_mask[:, :width],
                       position_ids=prompts.position_ids[:, :width], lengths=prompts.lengths - lag,
                       pad_token_id=prompts.pad_token_id)
        _, cache = prefill(model, head)
        return Chain(cache=cache, visible=head.attention_mask.bool(), count=head.lengths.clone())

    def feed(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``n`` tokens per row after its text: float32 log-probs ``[B, n, V]`` after each."""
        batch, n = tokens.shape
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()  # a chain's ancestors
        positions = (self.count + self.fed)[:, None] + torch.arange(n, device=tokens.device)
        log_probs = next_log_probs(forward_visible(model, self.cache, tokens,
                                                   tree_rows(self.visible, causal.expand(batch, n, n)), positions))
        self.visible = torch.cat((self.visible, self.visible.new_ones(batch, n)), dim=1)
        self.fed += n
        return log_probs

    def keep(self, kept: torch.Tensor) -> None:
        """Of the tokens fed since the last keep, keep the first ``kept[b]`` (int64 ``[B]``) in row
        ``b``; the others leave the cache."""
        width = self.visible.shape[1]
        fresh = torch.arange(self.fed, device=kept.device)[None, :] < kept[:, None]
        self.visible = torch.cat((self.visible[:, :width - self.fed], fresh), dim=1)
        self.count, self.fed = self.count + kept, 0
        if not bool(fresh.all()):
            _, self.visible = compact([self.cache], self.visible)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (int64 index)."""
        select_rows(self.cache, rows)
        self.visible, self.count = self.visible[rows], self.count[rows]
