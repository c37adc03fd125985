"""Sampling decoders for free text (knowledge generation): plain sampling, speculative sampling,
TopK-ImpSpecDec, beam sampling and DSBD, over a causal LM and a draft with the same tokenizer.

* ``sample``: ancestral sampling from the warped target distribution: beam sampling with one beam
  (:func:`beam_sample`, the same code as ``beam-sample``).
* ``spec-sample`` (:mod:`recspec.decoding.specsample`): the draft samples ``gamma`` tokens, the
  target scores the pending token and all of them in one call, Leviathan's test keeps a prefix.
* ``topk-imp`` (:mod:`recspec.decoding.topk_imp`): as ``spec-sample``, each drafted token drawn
  from the draft's top-K reweighted by ``p / q``; the target is run once per drafted token.
* ``beam-sample``: the target's beam sampling with ``W`` independent draws per step from the
  warped joint distribution (dsbd.txt Eq. 1); the output is the best beam by target score.
* ``dsbd`` (:mod:`recspec.decoding.dsbd`): DSBD over the free vocabulary, the same output
  distribution as ``beam-sample`` with a fixed width.

**Text as a candidate space.** :class:`FreeText` gives the beam machinery of the item decoders a
vocabulary instead of a trie: every live prefix may continue with any token; a prefix that ends
with the end token is *finished* and continues with it at probability 1 (so finished beams keep
their score and keep competing); generation stops at ``max_new_tokens`` or when every beam of a
row is finished. Outputs are cut after their first end token.

**Rows of different lengths** (``spec-sample``, ``topk-imp``): each model keeps one KV-cache row per
prompt; what a row has accepted so far is tracked as the cached positions it may attend to
(:class:`Chain`), rejected positions are compacted away after every round, and rows leave the
batch when they finish. The target's cache always holds a row's text except its last token and
the draft's except its last two, so a round feeds the same number of tokens to every row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from recspec.decoding.beam import Beams, Prompts, TreeCache, left_pad, prefill, prompt_batches
from recspec.decoding.cache import compact, select_rows
from recspec.decoding.dsbd import DSBDConfig, DSBDStats, dsbd_batch
from recspec.decoding.sampling import candidates, draw
from recspec.decoding.scorer import forward_visible, next_log_probs
from recspec.decoding.specsample import check_lenience, verify_chain
from recspec.decoding.rounds import SpecStats
from recspec.decoding.speculative import check_draft_vocabulary
from recspec.decoding.topk_imp import importance_proposal
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.hub import keep_last_logits

METHODS = ("sample", "spec-sample", "topk-imp", "beam-sample", "dsbd")
#: Methods that need a draft model.
DRAFTED = ("spec-sample", "topk-imp", "dsbd")


class FreeText:
    """The candidate space of text generation (the interface of
    :class:`~recspec.itemids.trie.ItemTrie` that beam sampling and DSBD use): node ``0`` is a live
    prefix, ``1`` a finished one (it ended with ``eos``), ``-1`` a dead beam; ``depth`` is the
    number of tokens to generate."""

    root = 0

    def __init__(self, vocab_size: int, depth: int, eos: int | None, device: torch.device | str = "cpu") -> None:
        self.vocab_size, self.depth, self.eos = vocab_size, depth, eos
        self._tokens = torch.arange(vocab_size, device=device)

    @property
    def device(self) -> torch.device:
        return self._tokens.device

    def children(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token for every node: int64 and bool ``[N, V]`` (nothing for a dead node)."""
        tokens = self._tokens.repeat(len(nodes), 1)
        return tokens, (nodes >= 0)[:, None].expand_as(tokens)

    def step(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The node after appending ``tokens`` ``[N]`` to ``nodes`` ``[N]``."""
        finished = (nodes == 1) | (tokens == (-1 if self.eos is None else self.eos))
        return torch.where(nodes < 0, -1, finished.long())

    def absorb(self, nodes: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """``log_probs`` ``[B, n, V]`` with each finished node's row replaced by the end token at
        probability 1."""
        if self.eos is None:
            return log_probs
        only_eos = torch.full_like(log_probs[:1, :1], -torch.inf)
        only_eos[..., self.eos] = 0.0
        return torch.where((nodes == 1)[:, :, None], only_eos, log_probs)

    def complete(self, nodes: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: every beam of the row (``nodes`` ``[B, K]``) is finished or dead."""
        return (nodes != 0).all(dim=1)


@dataclass(frozen=True)
class TextOptions:
    """Settings of the text decoders: ``max_new_tokens``; ``warp`` (temperature, top-k, top-p of
    every method); ``gamma`` (drafted tokens or layers per round); ``lenience`` (``spec-sample``,
    speculative_decoding.txt A.5); ``candidates`` (TopK-ImpSpecDec's K); ``beams`` (``W`` of
    ``beam-sample``, and ``W_min`` of ``dsbd``); ``draft_width``, ``threshold``, ``one_cache``
    (``dsbd``); ``seed``."""

    max_new_tokens: int = 64
    warp: Warp = Warp()
    gamma: int = 4
    lenience: float = 1.0
    candidates: int = 10
    beams: int = 2
    draft_width: int = 4
    threshold: float | None = None
    one_cache: bool = False
    seed: int = 0

    def dsbd(self) -> DSBDConfig:
        return DSBDConfig(gamma=self.gamma, draft_width=self.draft_width, min_width=self.beams,
                          threshold=self.threshold, one_cache=self.one_cache, warp=self.warp, seed=self.seed)


@dataclass
class ChainStats(SpecStats):
    """:class:`~recspec.decoding.rounds.SpecStats` of the chain methods per prompt
    (``accepted_steps``: drafted tokens accepted, ``drafted_steps``: tokens drafted,
    ``tree_nodes``: tokens fed to the target) and ``tried`` (drafted positions whose test ran:
    up to the first rejection), ``alpha_sum`` (sum over them of the acceptance rate
    ``sum_x min(q, p / l)``: ``alpha_sum / tried`` estimates Leviathan's ``alpha``), ``tokens``
    (generated)."""

    tried: torch.Tensor
    alpha_sum: torch.Tensor
    tokens: torch.Tensor

    def add_chain_round(self, at: torch.Tensor, accepted: torch.Tensor, alpha: torch.Tensor, taken: torch.Tensor,
                        gamma: int, target_calls: int) -> None:
        """Count one round of the rows ``at`` (int64 index, CPU): ``accepted`` drafts ``[B]``, the
        per-position acceptance rates ``alpha`` ``[B, gamma]``, the tokens ``taken`` ``[B]``."""
        tried = torch.minimum(accepted + 1, torch.full_like(accepted, gamma))
        positions = torch.arange(gamma, device=alpha.device)
        self.accepted_steps[at] += accepted.float().cpu()
        self.drafted_steps[at] += gamma
        self.tried[at] += tried.float().cpu()
        self.alpha_sum[at] += (alpha * (positions[None, :] < tried[:, None])).sum(dim=1).cpu()
        self.target_calls[at] += target_calls
        self.draft_calls[at] += gamma
        self.tree_nodes[at] += gamma + 1
        self.rounds[at] += 1
        self.tokens[at] += taken.float().cpu()


@dataclass
class Generated:
    """Per prompt, the generated token ids (through the first end token) and, for the drafted
    methods, their statistics."""

    tokens: list[list[int]]
    stats: SpecStats | None = None
    seconds: float = 0.0


def check_request(method: str, options: TextOptions, has_draft: bool) -> None:
    """Raise :class:`RecspecError` for settings no text decoder can serve (before any work)."""
    if method not in METHODS:
        raise RecspecError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method in DRAFTED and not has_draft:
        raise RecspecError(f"method {method} needs a draft model: pass --draft or --draft-layers")
    options.warp.check()
    if isinstance(options.max_new_tokens, bool) or not isinstance(options.max_new_tokens, int) \
            or options.max_new_tokens < 2:
        raise RecspecError(f"max_new_tokens must be an integer of at least 2, got {options.max_new_tokens!r}")
    if method in DRAFTED and (not isinstance(options.gamma, int) or options.gamma < 1):
        raise RecspecError(f"gamma must be a positive integer (tokens drafted per round), got {options.gamma!r}")
    check_lenience(options.lenience)
    if method == "topk-imp" and options.candidates < 1:
        raise RecspecError(f"the number of top-K candidates must be positive, got {options.candidates!r}")
    if method in ("beam-sample", "dsbd") and options.beams < 1:
        raise RecspecError(f"the number of beams must be positive, got {options.beams!r}")
    if method == "dsbd":
        options.dsbd().check(options.max_new_tokens - 1)


# ------------------------------------------------------------------------------- chain decoding


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
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        visible = torch.cat((self.visible[:, None, :].expand(batch, n, -1), causal.expand(batch, n, n)), dim=2)
        positions = (self.count + self.fed)[:, None] + torch.arange(n, device=tokens.device)
        log_probs = next_log_probs(forward_visible(model, self.cache, tokens, visible, positions))
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


def draft_chain_round(target, draft, target_chain: Chain, draft_chain: Chain, tail: torch.Tensor,
                      options: TextOptions, importance: bool,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round's chain of ``gamma`` drafted tokens after each row's pending ``tail`` (int64
    ``[B, 2]``, its last two tokens: the draft's cache lags one behind the target's) and the warped
    distributions to verify them with: the drafts int64 ``[B, gamma]``, the draft's ``q`` and the
    target's ``p`` float32 ``[B, gamma, V]`` / ``[B, gamma + 1, V]``. ``topk-imp`` (``importance``)
    draws each token from the draft's top-K reweighted by ``p / q``, so the target is called per
    drafted token; speculative sampling draws from ``q`` and scores the whole chain in one call."""
    warp = options.warp
    log_q = draft_chain.feed(draft, tail)[:, -1]
    drafts, q, p = [], [], []
    previous = tail[:, -1:]
    for i in range(options.gamma):
        if i:
            log_q = draft_chain.feed(draft, previous)[:, -1]
        q.append(warp(log_q).exp())
        if importance:
            p.append(warp(target_chain.feed(target, previous)[:, -1]).exp())
            proposal = importance_proposal(q[-1], p[-1], options.candidates)
        else:
            proposal = q[-1]
        drafts.append(torch.multinomial(proposal, 1, generator=generator))
        previous = drafts[-1]
    drafted = torch.cat(drafts, dim=1)
    if importance:
        p.append(warp(target_chain.feed(target, previous)[:, -1]).exp())
        return drafted, torch.stack(q, dim=1), torch.stack(p, dim=1)
    p_all = warp(target_chain.feed(target, torch.cat((tail[:, -1:], drafted), dim=1))).exp()
    return drafted, torch.stack(q, dim=1), p_all


def speculative_sampling(target, draft, prompts: Prompts, options: TextOptions, importance: bool, eos: int | None,
                         generator: torch.Generator) -> tuple[list[list[int]], ChainStats]:
    """``spec-sample`` (``importance=False``) or ``topk-imp`` for one batch (see the module doc)."""
    batch = len(prompts.lengths)
    device = prompts.input_ids.device
    gamma, limit = options.gamma, options.max_new_tokens
    stats = ChainStats.zeros(batch)
    target_chain, draft_chain = Chain.start(target, prompts, 1), Chain.start(draft, prompts, 2)
    stats.target_calls += 1
    stats.draft_calls += 1
    tail = prompts.input_ids[:, -2:]  # each row's last two tokens
    out = torch.zeros(batch, limit + gamma + 1, dtype=torch.int64, device=device)
    length = torch.zeros(batch, dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)
    results: list[list[int]] = [[] for _ in range(batch)]
    steps = torch.arange(gamma + 1, device=device)
    while len(rows):
        drafted, q, p_all = draft_chain_round(target, draft, target_chain, draft_chain, tail, options, importance,
                                              generator)
        verdict = verify_chain(drafted, q, p_all, generator, options.lenience)
        n = verdict.accepted
        emitted = torch.cat((drafted, drafted[:, :1]), dim=1).scatter_(1, n[:, None], verdict.token[:, None])
        take = torch.minimum(n + 1, limit - length)
        ends = (emitted == eos) & (steps[None, :] < take[:, None]) if eos is not None else torch.zeros_like(
            emitted, dtype=torch.bool)
        take = torch.where(ends.any(dim=1), ends.int().argmax(dim=1) + 1, take)
        out.scatter_(1, length[:, None] + steps[None, :], emitted)
        length = length + take
        stats.add_chain_round(rows.cpu(), n, verdict.alpha, take, gamma, gamma + 1 if importance else 1)
        done = (length >= limit) | ends.any(dim=1)
        target_chain.keep(n + 1)
        draft_chain.keep(n + 1)
        tail = torch.cat((tail, emitted), dim=1).gather(1, torch.stack((n + 1, n + 2), dim=1))
        if bool(done.any()):
            for row, tokens, size in zip(rows[done].tolist(), out[done].tolist(), length[done].tolist()):
                results[row] = tokens[:size]
            keep = (~done).nonzero()[:, 0]
            for chain in (target_chain, draft_chain):
                chain.select(keep)
            tail, out, length, rows = tail[keep], out[keep], length[keep], rows[keep]
    return results, stats


# ------------------------------------------------------------------------------- beam decoding


def beam_sample(model, prompts: Prompts, space: FreeText, width: int, warp: Warp,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's beam sampling with ``width`` independent draws per step (``width=1``: plain
    sampling), with tree attention as the item decoders' ``beam-sample``. Returns the scores
    ``[B, W]`` (target joint log-probabilities, untempered) and tokens ``[B, W, d]``."""
    log_probs, cache = prefill(model, prompts)
    state = TreeCache(model, prompts, width, cache)
    beams = Beams.start(len(prompts.lengths), space)
    for depth in range(space.depth):
        step = candidates(beams, space.absorb(beams.nodes, log_probs), space, warp.temperature, warp.top_k,
                          warp.top_p)
        chosen = draw(step.log_beam, width, generator, replacement=True)
        if depth > 0 and space.eos is not None:  # a row whose beams have all ended keeps them, as alone it would
            kept = torch.arange(width, device=chosen.device) * step.fanout + space.eos
            chosen = torch.where(space.complete(beams.nodes)[:, None], kept, chosen)
        beams = step.extend(beams, chosen, space)
        if depth + 1 == space.depth or bool(space.complete(beams.nodes).all()):
            break
        log_probs = state.extend(beams, depth)
    return beams.scores, beams.tokens


def best_texts(scores: torch.Tensor, tokens: torch.Tensor, eos: int | None) -> list[list[int]]:
    """Each row's best beam (highest score), cut after its first end token."""
    best = tokens.gather(1, scores.argmax(dim=1)[:, None, None].expand(-1, 1, tokens.shape[2]))[:, 0]
    texts = []
    for row in best.tolist():  # once per output, after decoding
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        texts.append(row)
    return texts


def generate(method: str, target, draft, prompts: Sequence[torch.Tensor], options: TextOptions, pad_token_id: int,
             eos: int | None, batch_size: int | None = None) -> Generated:
    """Generate from every prompt (1-D token ids, at least 3 tokens) with ``method``."""
    check_request(method, options, draft is not None)
    if draft is not None:
        check_draft_vocabulary(target, draft)
    short = [i for i, prompt in enumerate(prompts) if len(prompt) < 3]
    if short:
        raise RecspecError(f"prompt {short[0]} has fewer than 3 tokens; the text decoders need at least 3")
    device = target.device
    generator = torch.Generator(device=device).manual_seed(options.seed)
    vocab = target.config.get_text_config().vocab_size
    texts: list[list[int]] = []
    stats: list[SpecStats] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in prompt_batches(prompts, pad_token_id, device, batch_size):
            space = FreeText(vocab, options.max_new_tokens, eos, device)
            if method in ("sample", "beam-sample"):
                width = 1 if method == "sample" else options.beams
                texts += best_texts(*beam_sample(target, batch, space, width, options.warp, generator), eos)
            elif method == "dsbd":
                result = dsbd_batch(target, draft, batch, space, options.beams, options.dsbd(), generator, ends=space)
                texts += best_texts(result.scores, result.tokens, eos)
                stats.append(result.stats)
            else:
                part, part_stats = speculative_sampling(target, draft, batch, options, method == "topk-imp", eos,
                                                        generator)
                texts += part
                stats.append(part_stats)
    seconds = time.perf_counter() - started
    merged = None if not stats else (DSBDStats if method == "dsbd" else ChainStats).cat(stats)
    return Generated(tokens=texts, stats=merged, seconds=seconds)


def log_likelihood(model, prompts: Sequence[torch.Tensor], outputs: Sequence[Sequence[int]], pad_token_id: int,
                   batch_size: int = 4) -> torch.Tensor:
    """The model's mean log-probability per generated token of each output after its prompt
    (untempered, full vocabulary): float32 ``[N]`` (NaN for an empty output)."""
    means = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            pairs = list(zip(prompts[start:start + batch_size], outputs[start:start + batch_size]))
            width = max(len(output) for _, output in pairs)
            sequences = [torch.cat((prompt.long(), torch.tensor(output, dtype=torch.int64))) for prompt, output in pairs]
            batch = left_pad(sequences, pad_token_id, model.device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, **keep_last_logits(model, width + 1)).logits
            log_probs = next_log_probs(logits[:, -(width + 1):-1])  # [b, width, V]: predicting the last width tokens
            for row, (_, output) in enumerate(pairs):
                if not output:
                    means.append(float("nan"))
                    continue
                own = log_probs[row, width - len(output):]
                ids = torch.tensor(output, device=own.device)[:, None]
                means.append(float(own.gather(1, ids).mean()))
    return torch.tensor(means)
