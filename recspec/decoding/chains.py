"""The chain decoders (speculative sampling, TopK-ImpSpecDec) on the text round loop
(:mod:`recspec.decoding.text_rounds`): :class:`ChainDrafter` drafts a chain of up to ``gamma``
tokens per row after the prompt's or the text's last token (its root), and :class:`ChainVerifier`
keeps a prefix of it by Leviathan's test (:func:`~recspec.decoding.acceptance.verify_chain`) and
the token after it. A chain is a tree with one child per node, so the loop scores it as any tree,
in one target call (speculative sampling), or the drafter scores it one token at a time as it
drafts (TopK-ImpSpecDec).

What drafts the tokens (:class:`ChainDraft`): a draft causal LM with a cache of its own
(:class:`ModelChainDraft`), or a text head over the target's features (:class:`HeadChainDraft`,
EAGLE):

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

**A head's chain.** A text head's cache (:class:`~recspec.decoding.head_cache.HeadCache`) holds
the true inputs of each row's text but its last token, and its output at the last of them gives
the draft's ``q`` of the round's first token. A round:

* drafts that token, then each further token from the head fed its own guess and the token just
  drafted at the next position (EAGLE's drafting in feature space): ``gamma - 1`` head calls over
  one input per row;
* at the verdict, drops those drafted inputs and reads the target's features at the positions it
  fed this round, each with the text token after it (the accepted drafts, then the emitted
  token), in one head call, keeping the first ``accepted + 1`` per row.

So a round costs ``gamma`` head calls, as a draft LM's costs ``gamma`` calls. ``q`` is the head's
distribution over its draft vocabulary, zero (log-probability ``-inf``) on every other token of
the target's vocabulary, which Leviathan's residual ``max(0, p - q)`` covers.

**TopK-ImpSpecDec drafting** (topk_impspecdec.txt Alg. 1, sections 3.1-3.3). At drafted position
``i`` the draft's ``K`` most probable tokens ``T_K`` (of its warped distribution ``q_i``) are
reweighted by the importance weights ``w(y) = p_i(y) / q_i(y)`` and one token is drawn from
``r_i(y) = w(y) / sum_{T_K} w`` (Eq. 2-3); verification is Leviathan's, with the ratio
``p / q`` and the residual ``norm(max(0, p - q))`` (Alg. 1 lines 19-29, from
:func:`~recspec.decoding.acceptance.verify_chain`).

**What it costs.** ``w`` needs the target's probabilities ``p_i = M_p(prefix + x_1 .. x_{i-1})``
of the candidates *before* ``x_i`` is drawn (Alg. 1 lines 10-11), and ``p_i`` depends on the
tokens drafted before it, so it cannot come from the one parallel verification call: recspec runs
the target incrementally, one cached single-token call per drafted token (``x_{i-1}`` fed to get
``p_i``), and the last call (``x_gamma``) gives ``p_{gamma+1}``. A round therefore costs
``gamma + 1`` sequential target calls and ``gamma`` draft calls for at most ``gamma + 1``
tokens: never fewer target calls than plain sampling, so no speed-up is possible beyond what
batching the target's work would give; the benchmark measures it.

**What it samples.** The draw comes from ``r_i`` but the acceptance test uses ``q_i``, so a drafted
position emits

    P(x) = r(x) min(1, p(x) / q(x)) + (1 - sum_y r(y) min(1, p(y) / q(y))) * norm(max(0, p - q))(x),

which is *not* ``p`` in general (it is when ``r = q``): tokens with a large ``p / q`` inside the
draft's top-K are favoured twice, which is what lifts the acceptance rate. Bonus tokens (after
``gamma`` acceptances) are exact draws from ``p``. recspec tests that the output follows ``P``
and that it departs from the target's distribution. (Verifying against ``r``, i.e. Leviathan's
test with ``r`` as the proposal, would restore exactness, but the paper does not do it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from recspec.decoding.acceptance import verify_chain
from recspec.decoding.categorical import categorical
from recspec.decoding.head_cache import HeadCache
from recspec.decoding.prompts import Prompts
from recspec.decoding.rounds import SpecStats
from recspec.decoding.scorer import next_log_probs
from recspec.decoding.text_cache import TextCache
from recspec.decoding.text_rounds import Draft, Scorer
from recspec.decoding.warp import Warp
from recspec.models.text_head import TextHeadDraft


class ChainDraft(Protocol):
    """What drafts a chain's tokens (see the module doc)."""

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
    chain: TextCache = field(init=False)
    wants_features = False
    feature_layers = ()

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        self.chain, _, _ = TextCache.start(self.model, prompts, 2, drop_hidden=True)

    def log_q_first(self, tail: torch.Tensor) -> torch.Tensor:
        return self.log_q_after(tail)

    def log_q_after(self, tokens: torch.Tensor) -> torch.Tensor:
        return next_log_probs(self.chain.feed(self.model, tokens)[0][:, -1])

    def keep(self, accepted: torch.Tensor, emitted: torch.Tensor, features: torch.Tensor | None) -> None:
        self.chain.keep_first(accepted + 1)

    def select(self, rows: torch.Tensor) -> None:
        self.chain.select(rows)


@dataclass
class HeadChainDraft:
    """A text head bound to the target, drafting from its :class:`~recspec.decoding.head_cache.
    HeadCache` (see the module doc)."""

    head: TextHeadDraft
    cache: HeadCache = field(init=False)
    wants_features = True

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.fused_layers

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        """Read every prompt's inputs: the target's features at its columns but the last, each with
        the prompt's next token, in one head call."""
        assert features is not None, "a head drafts from the target's features"
        self.cache = HeadCache(self.head, drop_hidden=True)
        columns = features.shape[1]
        self.cache.read(features, prompts.input_ids[:, 1:], prompts.attention_mask[:, :columns].bool())

    def log_q_first(self, tail: torch.Tensor) -> torch.Tensor:
        return self.log_q()

    def log_q_after(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.cache.guessed is not None
        self.cache.guessed = self.cache.feed(self.cache.guessed[:, None], tokens)[:, -1]
        return self.log_q()

    def keep(self, accepted: torch.Tensor, emitted: torch.Tensor, features: torch.Tensor | None) -> None:
        assert features is not None, "a head drafts from the target's features"
        self.cache.drop_drafts()
        self.cache.read(features, emitted, torch.arange(emitted.shape[1], device=emitted.device)[None, :]
                        <= accepted[:, None])

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)

    def log_q(self) -> torch.Tensor:
        """The draft's log-probs at the head's newest guess over the target's vocabulary, float32
        ``[B, V]``: ``-inf`` outside the head's draft vocabulary."""
        assert self.cache.guessed is not None
        return self.head.vocabulary_log_probs(self.cache.guessed)


def chain_draft(draft) -> ChainDraft:
    """What drafts with ``draft``: a :class:`~recspec.models.text_head.TextHeadDraft` or a causal
    LM."""
    return HeadChainDraft(draft) if isinstance(draft, TextHeadDraft) else ModelChainDraft(draft)


@dataclass
class ChainDrafter:
    """The chain decoders' :class:`~recspec.decoding.text_rounds.TextDrafter`: ``gamma`` drafted
    tokens per row and round by ``draft`` (:func:`chain_draft`), each with the draft's warped
    distribution ``q`` to verify it with (:class:`ChainVerifier`).

    ``importance`` None: speculative sampling (each token drawn from the draft's ``q``; the loop
    scores the whole chain in one target call); ``importance = K``: TopK-ImpSpecDec (each token
    drawn from the draft's top-K reweighted by ``p / q``, so the drafter calls the target once per
    drafted token and once after the last: see the module doc).

    ``stop`` (speculative sampling only): a dynamic draft length. A row's chain ends before the
    next token once its draft probability (the product of ``q`` over its drafted tokens, the
    draft's guess that all of them are accepted) falls below ``stop``, and at ``gamma`` tokens at
    most; the round drafts until every row's chain has ended (a row's tokens past its own end are
    not verified for it). A row's length reads only its own draft draws, never the target's, so
    each round is Leviathan's verification of a chain of that length and the output distribution
    is unchanged (EAGLE-2's draft confidence as the acceptance estimate).
    """

    draft: ChainDraft
    warp: Warp
    gamma: int
    generator: torch.Generator
    importance: int | None = None
    stop: float | None = None
    lag = 1  # the first round drafts after the prompt's last token
    drop_hidden = True  # the target's cache laid out as the draft's (TextCache)

    def __post_init__(self) -> None:
        assert self.stop is None or self.importance is None, "a dynamic draft length is for speculative sampling"

    @property
    def wants_features(self) -> bool:
        return self.draft.wants_features

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.draft.feature_layers

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        self.draft.start(prompts, features)

    def propose(self, texts: list[list[int]], budgets: list[int], score: Scorer) -> Draft:
        """The chain after each row's root (its last token; the draft reads its last two): the
        root and the drafts, ``g + 1`` nodes (``g = gamma``, or fewer with :attr:`stop`), each
        row's own chain length (1..g) and the draft's ``q`` ``[B, g, V]``; scored by the drafter
        with :attr:`importance`."""
        tail = torch.tensor([text[-2:] for text in texts], device=self.generator.device)  # [B, 2]
        scored: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # the target's calls of the round
        drafts, q, p = [], [], []
        previous = tail[:, -1:]
        chance = torch.ones(tail.shape[0], device=tail.device)  # the draft's probability of each row's chain
        lengths = torch.zeros(tail.shape[0], dtype=torch.int64, device=tail.device)
        for i in range(self.gamma):
            if i and self.stop is not None:
                chance = chance * q[-1].gather(1, previous)[:, 0]
                if bool((chance < self.stop).all()):
                    break
                lengths += (chance >= self.stop).long()  # the chance only falls: a row's chain stays ended
            else:
                lengths += 1
            q.append(self.warp(self.draft.log_q_after(previous) if i else self.draft.log_q_first(tail)).exp())
            if self.importance is not None:
                scored.append(score(previous))
                p.append(self.warp(next_log_probs(scored[-1][0][:, -1])).exp())
                proposal = importance_proposal(q[-1], p[-1], self.importance)
            else:
                proposal = q[-1]
            drafts.append(categorical(proposal, 1, self.generator))
            previous = drafts[-1]
        tokens = torch.cat((tail[:, -1:], *drafts), dim=1)
        parents = torch.arange(-1, len(drafts), device=tokens.device).expand_as(tokens)
        draft = Draft(tokens, parents, lengths, lengths, torch.stack(q, dim=1))
        if self.importance is not None:
            scored.append(score(previous))
            logits = torch.cat([part for part, _ in scored], dim=1)
            seen = torch.cat([hidden for _, hidden in scored], dim=1) if self.wants_features else None
            draft.scored, draft.calls = (logits, seen), len(scored)
        return draft

    def learn(self, draft: Draft, path: torch.Tensor, own: torch.Tensor, features: torch.Tensor | None) -> None:
        accepted, drafted = path.sum(dim=1) - 1, draft.tokens[:, 1:]
        emitted = torch.cat((drafted, drafted[:, :1]), dim=1).scatter_(1, accepted[:, None], own[:, None])
        self.draft.keep(accepted, emitted, features)

    def select(self, rows: torch.Tensor) -> None:
        self.draft.select(rows)


@dataclass
class ChainStats(SpecStats):
    """:class:`~recspec.decoding.rounds.SpecStats` of the chain decoders per prompt
    (``accepted_steps``: drafted tokens accepted, ``drafted_steps``: tokens drafted,
    ``tree_nodes``: tokens fed to the target) and ``tried`` (drafted positions whose test ran:
    up to the first rejection), ``alpha_sum`` (sum over them of the acceptance rate
    ``sum_x min(q, p / l)``: ``alpha_sum / tried`` estimates Leviathan's ``alpha``), ``tokens``
    (generated)."""

    tried: torch.Tensor
    alpha_sum: torch.Tensor
    tokens: torch.Tensor


@dataclass
class ChainVerifier:
    """The chain decoders' :class:`~recspec.decoding.text_rounds.TextVerifier`: Leviathan's test of
    each row's chain (:func:`~recspec.decoding.acceptance.verify_chain`) with the target's
    distributions warped by ``warp``, draws from ``generator`` and ``lenience``; counts each
    request's rounds in ``stats`` (:class:`ChainStats`, ``tokens`` left to the caller)."""

    warp: Warp
    generator: torch.Generator
    lenience: float = 1.0
    stats: ChainStats = field(init=False)
    rows: torch.Tensor = field(init=False)  # int64 [B] on the CPU: each row's request

    def start(self, rows: int, max_new_tokens: int, device: torch.device) -> None:
        self.stats, self.rows = ChainStats.zeros(rows), torch.arange(rows)
        self.stats.target_calls += 1  # the prefills
        self.stats.draft_calls += 1

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a chain's first round drafts after the prompt: its drafter has lag 1")

    def verify(self, draft: Draft, logits: torch.Tensor, generated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert draft.q is not None, "a chain is verified against the draft's distributions"
        verdict = verify_chain(draft.tokens[:, 1:], draft.q, self.warp(next_log_probs(logits)).exp(), self.generator,
                               self.lenience, draft.sizes)
        accepted, width = verdict.accepted, draft.tokens.shape[1] - 1
        tried = torch.minimum(accepted + 1, draft.sizes)
        steps = torch.arange(width + 1, device=accepted.device)
        stats, at = self.stats, self.rows
        stats.accepted_steps[at] += accepted.float().cpu()
        stats.drafted_steps[at] += draft.sizes.float().cpu()
        stats.tried[at] += tried.float().cpu()
        stats.alpha_sum[at] += (verdict.alpha * (steps[None, :width] < tried[:, None])).sum(dim=1).cpu()
        stats.target_calls[at] += draft.calls
        stats.draft_calls[at] += width
        stats.tree_nodes[at] += width + 1
        stats.rounds[at] += 1
        return steps[None, :] <= accepted[:, None], verdict.token

    def select(self, rows: torch.Tensor) -> None:
        self.rows = self.rows[rows.cpu()]


def importance_proposal(q: torch.Tensor, p: torch.Tensor, k: int) -> torch.Tensor:
    """``r``: float32 ``[..., V]`` from the warped draft and target distributions ``q``, ``p``
    (``[..., V]``): ``p / q`` on the draft's top-``k`` tokens (those with ``q > 0``), normalised.
    Where the target gives every candidate probability 0 (possible under top-k / top-p warping),
    ``r`` is the draft's top-``k`` distribution itself, renormalised."""
    top = q.topk(min(k, q.shape[-1]), dim=-1).indices
    candidate = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, top, True) & (q > 0)
    weights = torch.where(candidate, p / q.clamp(min=torch.finfo(q.dtype).tiny), 0.0)
    total = weights.sum(dim=-1, keepdim=True)
    fallback = torch.where(candidate, q, 0.0)
    chosen = torch.where(total > 0, weights, fallback)
    return chosen / chosen.sum(dim=-1, keepdim=True)
