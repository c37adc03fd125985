"""A text head's own KV cache over a batch of texts: what a head's chains
(:class:`~recspec.decoding.chains.HeadChainDraft`) and its trees
(:class:`~recspec.decoding.head_trees.HeadTrees`) draft from.

Input ``t`` of a text head (:mod:`recspec.models.text_head`) is the target's feature ``f_t`` with
the next token ``x_{t+1}``, at position ``t``; its output guesses ``f_{t+1}``, whose log-probs
over the draft vocabulary give ``x_{t+2}``. With a row's text ``x_0 .. x_{L-1}`` the target has
scored all but ``x_{L-1}`` (the round's root), so its features ``f_0 .. f_{L-2}`` are known: once
they are read (:meth:`HeadCache.read`), the cache (a :class:`~recspec.decoding.text_cache.
TextCache` over a one-layer ``DynamicCache``) holds exactly the inputs ``0 .. L - 2``, with the
target's true features only, and :attr:`HeadCache.guessed` is the head's output at the last of
them (the guess of ``f_{L-1}``), whose log-probs are the draft's distribution of ``x_L``. Drafts
feed the head its own guesses; they never stay in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from recspec.decoding.scorer import prompt_rows
from recspec.decoding.text_cache import TextCache
from recspec.models.text_head import TextHeadDraft


@dataclass
class HeadCache:
    """``head``'s inputs over ``B`` rows of text (see the module doc): ``text`` (None before the
    first :meth:`read`), ``guessed`` ``[B, H]`` (the output at each row's newest input) and
    ``drop_hidden`` (the :class:`~recspec.decoding.text_cache.TextCache` layout)."""

    head: TextHeadDraft
    drop_hidden: bool = False
    text: TextCache | None = None
    guessed: torch.Tensor | None = None

    @property
    def past(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values ``[B, kv_heads, T, d]``."""
        assert self.text is not None, "the head has read nothing yet"
        layer = self.text.cache.layers[0]
        return layer.keys, layer.values

    def read(self, features: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor) -> None:
        """Feed the true inputs after each row's cached ones, in one head call: the target's
        ``features`` ``[B, M, F]`` (as it returns them, :meth:`TextHeadDraft.read` applies) with the
        next ``tokens`` (int64 ``[B, M]``), where ``real`` (bool ``[B, M]``); the other columns are
        fill (a prompt's left padding, a row that kept fewer), fed but hidden from every input and
        then dropped."""
        count = features.shape[1]
        ancestors = prompt_rows(real)
        inputs = self.head.read(features)
        if self.text is None:
            guessed, keys, values = self.head.step(inputs, tokens, ancestors.sum(dim=2) - 1, ancestors)
            self.text = TextCache(DynamicCache(ddp_cache_data=[(keys, values)]), real, real.sum(dim=1),
                                  drop_hidden=self.drop_hidden)
        else:
            guessed = self.feed(inputs, tokens, ancestors)
            self.text.keep(real)
        last = count - 1 - real.flip(1).int().argmax(dim=1)  # each row's last real column
        self.guessed = guessed.gather(1, last[:, None, None].expand(-1, 1, guessed.shape[2]))[:, 0]

    def feed(self, features: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Feed each row ``n`` inputs after everything fed so far (the head's inputs ``[B, n, H]``
        with the next ``tokens``, int64 ``[B, n]``), in a chain or among themselves as ``ancestors``
        says (bool ``[B, n, n]``); returns the head's outputs ``[B, n, H]``. Drafted inputs fed
        since the last :meth:`read` are dropped by :meth:`drop_drafts`."""
        assert self.text is not None, "the head has read nothing yet"
        visible, positions = self.text.extend(tokens.shape[1], ancestors)
        guessed, keys, values = self.head.step(features, tokens, positions, visible, self.past)
        self.text.cache.layers[0].update(keys, values)
        return guessed

    def drop_drafts(self) -> None:
        """Drop the inputs :meth:`feed` fed since the last :meth:`read`."""
        if self.text is not None and self.text.fed:
            self.text.keep_first(torch.zeros_like(self.text.count))

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (int64 index)."""
        if self.text is not None:
            self.text.select(rows)
        if self.guessed is not None:
            self.guessed = self.guessed[rows]
