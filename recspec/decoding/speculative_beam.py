"""Speculative beam search for top-K items (AtSpeed): a draft model drafts beams, the target
verifies them in one tree-attention call per round.

One round, for every user of the batch at once (users may be at different depths):

1. **Draft**: level 0 is the target's ``K`` current beams, whose last tokens are pending (in the
   first round: the prompt's last token, one "beam" per user); the draft model feeds a level and
   selects the next one from the trie children of its nodes: the top ``N`` (strict and exact
   sampling, :class:`~recspec.decoding.drafters.TopNDrafter`) or ``K`` samples (relaxed,
   :class:`~recspec.decoding.drafters.SampledDrafter`), for ``gamma`` levels, at most up to the
   last depth that has children (the final step is computed from that depth's distributions
   whatever the draft guesses, so drafting leaves would only cost) (atspeed.txt Eq. 1).
2. **Score**: the target is fed every level in one call; in the first round
   the prompt goes in the same call (atspeed.txt Alg. 1 runs the target on the prefix and the
   drafted steps together), so with a perfect draft the whole search costs the target one call.
   The draft has been fed the same levels (less the last one when the round's bonus step always
   completes the identifiers), so both caches hold the same nodes.
3. **Verify** (:class:`~recspec.decoding.verifiers.StepVerifier`), step by step from level 0:
   the target's own beam-search step (strict) or sampling step (relaxed, exact sampling) over the
   children of its current beams; the step is accepted when all ``K`` new beams are drafted nodes
   (atspeed.txt Alg. 1; Alg. 2 accepts each drafted sequence with ``min(1, p / q)``); a user's
   round ends at its first rejected step (the correction), after the bonus step, or when its
   identifiers are complete.
4. **Compact**: both caches keep the prompt and the ancestors of the new beams, nothing else
   (one gather per layer); users whose beams are complete leave the batch.

The loop is :func:`~recspec.decoding.rounds.run_rounds`, shared with DSBD; this module wires it.

With strict verification the result equals :func:`~recspec.decoding.beam_search.beam_search` (same
items, order and scores, up to float noise in near-ties: :attr:`TopK.margin`). With exact sampling
verification (``verify="sample"``, the decoder ``spec-beam-sample``) it follows the distribution of
:func:`~recspec.decoding.beam_search.sampling_beam_search` exactly, with and without replacement
(:class:`~recspec.decoding.verifiers.StepVerifier` with the sampling step); relaxed verification
(Alg. 2) is exact with replacement and approximate without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recspec.decoding.acceptance import RelaxedSampler
from recspec.decoding.beams import TopK, best_first, sampling_select
from recspec.decoding.draft_sources import ModelHeadPair
from recspec.decoding.drafters import SampledDrafter, TopNDrafter
from recspec.decoding.frontier import Frontier
from recspec.decoding.item_prior import ItemDraft
from recspec.decoding.prompts import Prompts, check_draft_vocabulary, decode_batches
from recspec.decoding.rounds import SpecStats, run_rounds
from recspec.decoding.target_prior import TargetPrior
from recspec.decoding.tree_plan import CostPlanner
from recspec.decoding.verifiers import StepVerifier
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie
from recspec.models.head import HeadDraft

VERIFICATIONS = ("strict", "relaxed", "sample")


@dataclass(frozen=True)
class SpecConfig:
    """``draft_beams``: N, drafted sequences per level (strict); ``gamma``: drafted levels per
    round (None: the rest of the identifier); ``verify``: ``"strict"``, ``"relaxed"`` or
    ``"sample"``; ``temperature``, ``seed`` and ``replacement``: of the sampling verifications, see
    :class:`~recspec.decoding.acceptance.RelaxedSampler` (relaxed drafts K sequences per level, as
    atspeed.txt Alg. 2; ``draft_beams`` is strict's and exact sampling's) and
    :class:`~recspec.decoding.verifiers.StepVerifier`; ``planner``: strict rounds sized by cost
    (:class:`~recspec.decoding.tree_plan.CostPlanner`: levels and widths per round) instead of
    ``draft_beams`` and ``gamma``."""

    draft_beams: int = 40
    gamma: int | None = None
    verify: str = "strict"
    temperature: float = 1.0
    seed: int = 0
    replacement: bool = False
    planner: CostPlanner | None = None

    def check(self, k: int, trie: ItemTrie) -> None:
        """Raise :class:`RecspecError` for settings no speculative search of ``k`` items over
        ``trie`` can serve (called once, by :func:`speculative_beam_search`, before any work)."""
        if self.verify not in VERIFICATIONS:
            raise RecspecError(f"unknown verification {self.verify!r}; choose one of {', '.join(VERIFICATIONS)}")
        if self.verify != "relaxed" and self.draft_beams < k:
            raise RecspecError(f"draft beams N={self.draft_beams} must be at least k={k}: {self.verify} verification "
                               f"accepts a step only when all k target beams were drafted")
        if self.gamma is not None and not 1 <= self.gamma <= trie.depth - 1:
            raise RecspecError(f"gamma={self.gamma} is outside [1, {trie.depth - 1}]: an identifier of length "
                               f"{trie.depth} leaves at most {trie.depth - 1} steps to draft after the first")
        if self.verify != "strict":
            Warp(self.temperature).check()


@dataclass
class SpecResult:
    topk: TopK
    stats: SpecStats


def atspeed_batch(target, draft, prompts: Prompts, trie: ItemTrie, k: int, config: SpecConfig,
                  generator: torch.Generator) -> SpecResult:
    """Speculative beam search for one batch of users: AtSpeed's drafter and verifier in the
    shared round loop."""
    batch, device = len(prompts.lengths), prompts.input_ids.device
    warp = Warp(config.temperature)
    if config.verify == "strict":
        drafter, verifier = TopNDrafter(trie, config.draft_beams, config.planner), StepVerifier(trie, k)
    elif config.verify == "sample":  # the top N, the target's own draws accepted where drafted
        drafter = TopNDrafter(trie, config.draft_beams, config.planner)
        verifier = StepVerifier(trie, k, select=sampling_select(warp, generator, config.replacement))
    else:  # relaxed: K sequences per level from the draft's q_beam, verified by Alg. 2
        drafter = SampledDrafter(trie, warp, k, generator, config.replacement)
        verifier = StepVerifier(trie, k, RelaxedSampler(warp, generator, config.replacement))
    out = TopK(items=torch.full((batch, k), -1, dtype=torch.int64, device=device),
               scores=torch.full((batch, k), -torch.inf, device=device),
               tokens=torch.zeros(batch, k, trie.depth, dtype=torch.int64, device=device),
               margin=torch.full((batch,), torch.inf, device=device))

    def finish(rows: torch.Tensor, front: Frontier) -> None:
        out.items[rows] = trie.items(front.beams.nodes.reshape(-1)).view(-1, k)
        out.scores[rows], out.tokens[rows], out.margin[rows] = front.beams.scores, front.paths, front.beams.margin

    stats = SpecStats.zeros(batch)
    run_rounds(target, draft, prompts, trie, config.gamma, drafter, verifier, stats, finish)
    return SpecResult(out if config.verify == "strict" else best_first(out), stats)  # draws come in draw order


def speculative_beam_search(
    target, draft, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    config: SpecConfig | None = None, batch_size: int | None = None,
) -> SpecResult:
    """Top-``k`` items per prompt by speculative beam search (see the module doc).

    ``target``, ``draft``: HF causal LMs over the same vocabulary (full-attention caches, custom
    4D masks), or ``draft`` a head bound to the target (:class:`~recspec.models.head.HeadDraft`)
    or a draft model and a head (:class:`~recspec.decoding.draft_sources.ModelHeadPair`); ``prompts``: one 1-D int tensor per user; batches of ``batch_size`` users (all if
    None) are left-padded with ``pad_token_id``. Strict verification returns what
    :func:`~recspec.decoding.beam_search.beam_search` returns; relaxed verification samples.
    """
    config = config or SpecConfig()

    def check() -> None:
        nonlocal draft  # a table drafts through the decode's trie, which may hold fewer items than its own
        config.check(k, trie)
        model = draft.model if isinstance(draft, ModelHeadPair) else draft
        if isinstance(model, (ItemDraft, TargetPrior)):
            draft = model.for_trie(trie)
        elif not isinstance(model, HeadDraft):  # a head drafts over its target's own output layer
            check_draft_vocabulary(target, model)

    generator = torch.Generator(device=target.device).manual_seed(config.seed)
    parts = decode_batches(target, prompts, trie, k, pad_token_id, batch_size,
                           lambda batch, on_device: atspeed_batch(target, draft, batch, on_device, k, config, generator),
                           check)
    return SpecResult(TopK.cat([part.topk for part in parts]), SpecStats.cat([part.stats for part in parts]))
