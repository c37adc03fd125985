"""What drafts the chain decoders' tokens (speculative sampling, TopK-ImpSpecDec): a draft causal LM
with a chain of its own (:class:`ModelChainDraft`), or a text head over the target's features
(:class:`HeadChainDraft`, EAGLE). The chain loop (:func:`~recspec.decoding.rounds.run_chain`) and
its drafter (:class:`~recspec.decoding.drafters.ChainDrafter`) talk to either through
:class:`ChainDraft`:

* ``start(prompts, features)``: before the first round; ``features`` are the target's at every
  prompt column but the last ``[B, P - 1, H]`` (None unless ``wants_features``);
* ``log_q_first(tail)``: the draft's log-probs ``[B, V]`` of a round's first drafted token, each
  row's text ending with ``tail`` (int64 ``[B, 2]``, its last two tokens);
* ``log_q_after(tokens)``: the log-probs ``[B, V]`` of the next drafted token after the drafted
  ``tokens`` (int64 ``[B, 1]``);
* ``keep(accepted, emitted, features)``: the round's verdict: ``accepted`` (int64 ``[B]``)
  drafted tokens kept, then the emitted text ``emitted`` (int64 ``[B, gamma + 1]``: the accepted
  drafts and the token after them, meaningless after it) and the target's features at the
  ``gamma + 1`` positions it fed this round ``[B, gamma + 1, H]`` (its pending token, then the
  drafts; None unless ``wants_features``);
* ``select(rows)``: keep the rows ``rows`` (int64 index).

**A head's chain.** Input ``t`` of a text head (:mod:`recspec.models.text_head`) is the target's
feature ``f_t`` with the next token ``x_{t+1}``, at position ``t``; its output guesses ``f_{t+1}``,
whose log-probs over the draft vocabulary give ``x_{t+2}``. With a row's text ``x_0 .. x_{L-1}``
the target's chain holds all but ``x_{L-1}``, so its features ``f_0 .. f_{L-2}`` are known, and
the head's cache (a :class:`~recspec.decoding.chain.Chain` over a one-layer ``DynamicCache``)
holds exactly the inputs ``0 .. L - 2`` with those true features; ``guessed`` is its output at the
last one (the guess of ``f_{L-1}``), whose log-probs are the draft's ``q`` of ``x_L``. A round:

* drafts ``x_L`` from ``guessed``, then each further token from the head fed its own guess and the
  token just drafted at the next position (EAGLE's drafting in feature space): ``gamma - 1`` head
  calls over one input per row;
* at the verdict, drops those drafted inputs and feeds the target's features at the positions it
  fed this round, each with the text token after it (the accepted drafts, then the emitted
  token), in one head call, keeping the first ``accepted + 1`` per row: the cache again holds the
  true inputs only, and ``guessed`` is the output at the last of them.

So a round costs ``gamma`` head calls, as a draft LM's costs ``gamma`` calls. ``q`` is the head's
distribution over its draft vocabulary, zero (log-probability ``-inf``) on every other token of
the target's vocabulary, which Leviathan's residual ``max(0, p - q)`` covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from recspec.decoding.chain import Chain
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import prompt_rows
from recspec.models.text_head import TextHeadDraft


class ChainDraft(Protocol):
    """The draft side of the chain loop (see the module doc)."""

    wants_features: bool
    feature_layers: tuple[int, ...]  # the target's layers read beside its top feature (layer_features)

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None: ...

    def log_q_first(self, tail: torch.Tensor) -> torch.Tensor: ...

    def log_q_after(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def keep(self, accepted: torch.Tensor, emitted: torch.Tensor, features: torch.Tensor | None) -> None: ...

    def select(self, rows: torch.Tensor) -> None: ...


@dataclass
class ModelChainDraft:
    """A draft causal LM over the target's vocabulary: its chain holds each row's text but its last
    two tokens (a round feeds them first), so every round feeds every row alike."""

    model: object
    chain: Chain = field(init=False)
    wants_features = False
    feature_layers = ()

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        self.chain, _ = Chain.start(self.model, prompts, 2)

    def log_q_first(self, tail: torch.Tensor) -> torch.Tensor:
        return self.log_q_after(tail)

    def log_q_after(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.chain.feed(self.model, tokens)[0][:, -1]

    def keep(self, accepted: torch.Tensor, emitted: torch.Tensor, features: torch.Tensor | None) -> None:
        self.chain.keep(accepted + 1)

    def select(self, rows: torch.Tensor) -> None:
        self.chain.select(rows)


@dataclass
class HeadChainDraft:
    """A text head bound to the target (see the module doc): its chain over the true inputs and
    ``guessed`` ``[B, H]``, its output at each row's newest input."""

    head: TextHeadDraft
    chain: Chain = field(init=False)
    guessed: torch.Tensor = field(init=False)
    wants_features = True

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.fused_layers

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        """Read every prompt's inputs: the target's features at its columns but the last, each with
        the prompt's next token, in one head call."""
        assert features is not None, "a head drafts from the target's features"
        columns = features.shape[1]
        real = prompts.attention_mask[:, :columns]
        guessed, keys, values = self.head.step(self.head.read(features), prompts.input_ids[:, 1:],
                                               prompts.position_ids[:, :columns], prompt_rows(real))
        self.chain = Chain(cache=DynamicCache(ddp_cache_data=[(keys, values)]), visible=real.bool(),
                           count=prompts.lengths - 1)
        self.guessed = guessed[:, -1]

    def log_q_first(self, tail: torch.Tensor) -> torch.Tensor:
        return self.log_q()

    def log_q_after(self, tokens: torch.Tensor) -> torch.Tensor:
        self.guessed = self.feed(self.guessed[:, None], tokens)[:, -1]
        return self.log_q()

    def keep(self, accepted: torch.Tensor, emitted: torch.Tensor, features: torch.Tensor | None) -> None:
        assert features is not None, "a head drafts from the target's features"
        self.chain.keep(torch.zeros_like(accepted))  # the drafted inputs leave
        guessed = self.feed(self.head.read(features), emitted)
        self.chain.keep(accepted + 1)
        self.guessed = guessed.gather(1, accepted[:, None, None].expand(-1, 1, guessed.shape[2]))[:, 0]

    def select(self, rows: torch.Tensor) -> None:
        self.chain.select(rows)
        self.guessed = self.guessed[rows]

    def feed(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``n`` inputs per row after its cached ones: ``features`` ``[B, n, H]`` with the next
        ``tokens`` (int64 ``[B, n]``); returns the head's guesses ``[B, n, H]``."""
        visible, positions = self.chain.extend(tokens.shape[1])
        layer = self.chain.cache.layers[0]
        guessed, keys, values = self.head.step(features, tokens, positions, visible, (layer.keys, layer.values))
        layer.update(keys, values)
        return guessed

    def log_q(self) -> torch.Tensor:
        """The draft's log-probs at ``guessed`` over the target's vocabulary, float32 ``[B, V]``:
        ``-inf`` outside the head's draft vocabulary."""
        return self.head.vocabulary_log_probs(self.guessed)


def chain_draft(draft) -> ModelChainDraft | HeadChainDraft:
    """The draft side for ``draft``: a :class:`~recspec.models.text_head.TextHeadDraft` or a causal
    LM."""
    return HeadChainDraft(draft) if isinstance(draft, TextHeadDraft) else ModelChainDraft(draft)
