"""Dynamic-width speculative beam decoding (DSBD, dsbd.txt): beam *sampling* with a draft model,
the output following the target's beam sampling exactly (Theorem 3.1).

**Beam sampling** (Eq. 1): from the beams ``I`` (target joint log-probs ``s(b)``), ``W`` new beams
are drawn *independently* from ``p_beam(b, v) = T o exp(s(b) + log p(v | b)) / Z`` over every
candidate ``(b, v)``, the warping ``T`` (temperature, top-k, top-p) applied to the joint
(:func:`~recspec.decoding.beams.candidates`). The target does this alone with
:func:`~recspec.decoding.beam_search.sampling_beam_search` (``replacement=True``) over an item trie,
or over the free vocabulary for text (:mod:`recspec.decoding.text`).

**One round** (an *iteration* of the paper), for every row of the batch at once:

1. *Draft forest* (section 3.1): from the ``W_L`` input beams the draft runs beam sampling with
   width ``W_S`` for ``gamma`` steps: each layer holds ``W_S`` i.i.d. draws from the draft's
   ``q_beam`` over the previous layer's candidates, scored by the target's exact score of the
   input beam plus the draft's log-probabilities after it (any proposal keeps Theorem 3.1; this
   one uses what the target already knows).
2. *Forest verification in one target call* (section 3.3): every layer goes into the target as a
   token tree (tree attention over the cached prompt and each node's ancestors; in the first
   round the prompt itself goes in the same call), giving ``p`` at every node.
3. *Layer-by-layer verification* (Alg. 1), layer ``l`` over the candidates of the accepted beams
   ``A`` of layer ``l - 1``: drafts whose parent was rejected are dropped; the others are i.i.d.
   draws from ``q~``, the draft's ``q_beam`` *restricted to the children of* ``A`` *and
   renormalised* (the dropped drafts are exactly those outside it, so what remains is an i.i.d.
   sample of the restriction). With ``p' = p_beam``, each surviving draft ``y`` in draw order is
   accepted with probability ``min(1, p'(y) / q~(y))``; a rejection sets ``p' = norm(max(0, p' -
   q~))``, an acceptance resets ``p' = p_beam`` (recursive rejection sampling with i.i.d. drafts,
   so every accepted beam is one exact draw from ``p_beam``, independent of the others). After
   ``W_L`` acceptances the rest is rejected and the next layer is verified; with fewer the round
   ends at this layer: one beam is drawn from the current ``p'`` and the remaining ones from
   ``p_beam``. When every drafted layer is accepted, one more layer is drawn from ``p_beam`` (the
   bonus). Either way the output layer is ``W_L`` i.i.d. draws from ``p_beam``: Theorem 3.1.
   (The paper writes the acceptance ratio as ``q / p'``; Theorem 3.1 needs ``p' / q``, as above.
   Its released code approximates where this does not: no argmax for unlikely draws, no draws
   without replacement verified as independent, and ``q`` renormalised after beams die.)
4. *Dynamic width* (section 3.2): with ``alpha_j`` the acceptance probability of a fresh draft
   after ``j - 1`` rejections (Eq. 4, from the residual chain of ``p_beam`` and ``q~``) and ``m``
   surviving drafts, the distribution of the number of acceptances follows Eq. 2-3; layer ``l``
   keeps ``W_L = max(W_min, max{K : P(at least K accepted) >= t})`` (Eq. 5-7, with ``K <= m``).
   With ``threshold=None`` the width is fixed at ``W_min`` (section 3.1). A width is chosen
   before the layer's uniforms are drawn, so Theorem 3.1 holds per layer. A bonus layer (no
   drafts) keeps the width of the layer before it; over an item trie the last layer always has
   the ``K`` beams asked for.
5. *KV compaction*: both caches keep the prompt and the ancestors of the output beams only
   (:func:`~recspec.decoding.cache.compact`); in the *one-KV-cache* mode (section 3.4) only the
   output beam with the best target score (lowest perplexity: all beams have the same length)
   goes on, so the caches hold one sequence. That mode no longer samples ``p_beam``'s
   distribution: it is the paper's memory trade-off, measured by the benchmark.
6. *A draft's support* (text, a head with a reduced vocabulary ``D``): the draft samples its
   forest over ``D`` and the end token only (:func:`drafted_space`), and each layer is verified
   over those candidates plus one column for all the others, which the draft never proposes
   (:mod:`recspec.decoding.support`: the same decisions and draws, over ``W |D| + 1`` columns
   instead of ``W V``).

The verification rules are :func:`~recspec.decoding.acceptance.verify_layer` and its helpers, the
layer loop :class:`~recspec.decoding.verifiers.ForestVerifier`, the draft forest
:class:`~recspec.decoding.drafters.SampledDrafter`, the rounds
:func:`~recspec.decoding.rounds.run_rounds` (shared with AtSpeed); this module wires them.
Python loops run over rounds, layers and the ``W_S`` draft slots of a layer (the verification is
sequential by definition: each decision depends on the residual the previous ones left); every
operation inside is vectorised over the batch and the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recspec.decoding.beams import Ends, TopK, best_first
from recspec.decoding.drafters import SampledDrafter
from recspec.decoding.frontier import Frontier
from recspec.decoding.item_prior import ItemDraft
from recspec.decoding.target_prior import TargetPrior
from recspec.decoding.prompts import Prompts, check_draft_vocabulary, decode_batches
from recspec.decoding.rounds import SpecStats, run_rounds
from recspec.decoding.verifiers import ForestVerifier
from recspec.decoding.warp import Warp
from recspec.decoding.draft_sources import ModelHeadPair
from recspec.models.head import HeadDraft
from recspec.models.text_head import TextHeadDraft
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie


@dataclass(frozen=True)
class DSBDConfig:
    """``gamma``: drafted layers per round (None: up to the last depth that has children);
    ``draft_width``: ``W_S``, draft beams per layer; ``min_width``: ``W_min``, and the fixed width
    ``W_L`` when ``threshold`` is None; ``threshold``: ``t`` in [0, 1] of the dynamic width (Eq.
    7); ``one_cache``: section 3.4's memory mode; ``warp``: the sampling warping of both models'
    joint distributions; ``seed``: of every draw."""

    gamma: int | None = None
    draft_width: int = 4
    min_width: int = 2
    threshold: float | None = None
    one_cache: bool = False
    warp: Warp = Warp()
    seed: int = 0

    def check(self, max_gamma: int) -> None:
        """Raise :class:`RecspecError` for settings DSBD cannot run with (before any work)."""
        self.warp.check()
        if self.gamma is not None and not 1 <= self.gamma <= max_gamma:
            raise RecspecError(f"gamma={self.gamma} is outside [1, {max_gamma}]: draft at least one layer and at "
                               f"most {max_gamma}")
        if isinstance(self.min_width, bool) or not isinstance(self.min_width, int) or self.min_width < 1:
            raise RecspecError(f"the minimum width W_min must be a positive integer, got {self.min_width!r}")
        if not isinstance(self.draft_width, int) or self.draft_width < self.min_width:
            raise RecspecError(f"the draft width W_S={self.draft_width} is below W_min={self.min_width}: draft at "
                               f"least as many beams per layer as the narrowest layer keeps")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            raise RecspecError(f"the width threshold t must lie in [0, 1], got {self.threshold!r}")


@dataclass
class DSBDStats(SpecStats):
    """:class:`~recspec.decoding.rounds.SpecStats` (``accepted_steps``: drafted layers
    accepted, ``drafted_steps``: layers drafted) and, per row: ``steps`` (layers generated),
    ``verified_layers`` (drafted layers verified), ``beta_sum`` (sum over them of
    ``beta_{W_min}``, the probability that at least ``W_min`` drafts are accepted: Theorem 3.2's
    ``beta``), ``width_sum`` (sum of the widths of the generated layers)."""

    steps: torch.Tensor
    verified_layers: torch.Tensor
    beta_sum: torch.Tensor
    width_sum: torch.Tensor


@dataclass
class DSBDResult:
    """Per row, the output beams ``[B, W]`` (dead past each row's last width: score ``-inf``):
    ``scores`` (the target's joint log-probabilities, untempered), ``tokens`` int64 ``[B, W, L]``
    (zeros past a beam's depth), ``nodes`` (of the candidate space), and the statistics."""

    scores: torch.Tensor
    tokens: torch.Tensor
    nodes: torch.Tensor
    stats: DSBDStats


def drafted_space(draft, space, ends: Ends | None):
    """The candidate space ``draft`` drafts over: over free text (``ends`` given), a text head with a
    reduced vocabulary drafts over it (:meth:`~recspec.decoding.space.FreeText.restricted`, verified
    over its :class:`~recspec.decoding.support.DraftSupport`); else ``space`` itself."""
    if ends is None or not isinstance(draft, TextHeadDraft) or len(draft.ids) == space.vocab_size:
        return space
    return space.restricted(draft.ids)


def dsbd_batch(target, draft, prompts: Prompts, space, k: int, config: DSBDConfig, generator: torch.Generator,
               ends: Ends | None = None) -> DSBDResult:
    """DSBD for one left-padded batch over ``space`` (an :class:`~recspec.itemids.trie.ItemTrie`, or
    the free text vocabulary with ``ends``), ``k`` beams in the last layer of a trie: a beam-
    sampled draft forest and DSBD's layer verification in the shared round loop."""
    batch, device = len(prompts.lengths), prompts.input_ids.device
    out_width = max(config.draft_width, config.min_width, k)
    scores = torch.full((batch, out_width), -torch.inf, device=device)
    tokens = torch.zeros(batch, out_width, space.depth, dtype=torch.int64, device=device)
    nodes = torch.full((batch, out_width), -1, dtype=torch.int64, device=device)

    def finish(rows: torch.Tensor, front: Frontier) -> None:
        width = front.beams.scores.shape[1]
        scores[rows, :width], tokens[rows, :width], nodes[rows, :width] = front.beams.scores, front.paths, \
            front.beams.nodes

    draft_space = drafted_space(draft, space, ends)
    drafter = SampledDrafter(draft_space, config.warp, config.draft_width, generator, replacement=True, ends=ends)
    verifier = ForestVerifier(space, ends, config.warp, k, config.min_width, config.draft_width, config.threshold,
                              config.one_cache, out_width, generator,
                              None if draft_space is space else draft_space.tokens)
    stats = DSBDStats.zeros(batch)
    run_rounds(target, draft, prompts, space, config.gamma, drafter, verifier, stats, finish)
    return DSBDResult(scores=scores, tokens=tokens, nodes=nodes, stats=stats)


def dsbd_beam_search(target, draft, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
                     config: DSBDConfig | None = None, batch_size: int | None = None) -> tuple[TopK, DSBDStats]:
    """``k`` items per prompt by DSBD over the item trie: with ``threshold=None`` and ``min_width=k``
    (fixed width ``k``), exactly the target's beam sampling with replacement
    (:func:`~recspec.decoding.beam_search.sampling_beam_search`, ``replacement=True``) at the same
    warping; the ``k`` beams are independent draws, so an item may come out more than once.
    Results best first (by the target's score)."""
    config = config or DSBDConfig(min_width=k, draft_width=2 * k)

    def check() -> None:
        if trie.depth < 2:
            raise RecspecError("DSBD needs identifiers of at least 2 tokens: with 1 there is nothing to draft")
        config.check(trie.depth - 1)
        if isinstance(draft, (HeadDraft, ModelHeadPair, ItemDraft, TargetPrior)):
            raise RecspecError("dsbd drafts with a draft model; a draft head, the item draft and a target prior "
                               "serve the spec- decoders")
        check_draft_vocabulary(target, draft)

    generator = torch.Generator(device=target.device).manual_seed(config.seed)

    def decode(batch: Prompts, on_device: ItemTrie) -> tuple[TopK, DSBDStats]:
        result = dsbd_batch(target, draft, batch, on_device, k, config, generator)
        return best_first(TopK(items=on_device.items(result.nodes[:, :k].reshape(-1)).view(-1, k),
                               scores=result.scores[:, :k], tokens=result.tokens[:, :k])), result.stats

    parts = decode_batches(target, prompts, trie, k, pad_token_id, batch_size, decode, check)
    return TopK.cat([topk for topk, _ in parts]), DSBDStats.cat([stats for _, stats in parts])
