"""Dynamic-width speculative beam decoding (DSBD, dsbd.txt): beam *sampling* with a draft model,
the output following the target's beam sampling exactly (Theorem 3.1).

**Beam sampling** (Eq. 1): from the beams ``I`` (target joint log-probs ``s(b)``), ``W`` new beams
are drawn *independently* from ``p_beam(b, v) = T o exp(s(b) + log p(v | b)) / Z`` over every
candidate ``(b, v)``, the warping ``T`` (temperature, top-k, top-p) applied to the joint
(:func:`~recspec.decoding.sampling.candidates`). The target does this alone with
:func:`~recspec.decoding.sampling.sampling_beam_search` (``replacement=True``) over an item trie,
or over the free vocabulary for text (:mod:`recspec.decoding.text_sampling`).

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

Python loops run over rounds, layers and the ``W_S`` draft slots of a layer (the verification is
sequential by definition: each decision depends on the residual the previous ones left); every
operation inside is vectorised over the batch and the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from recspec.decoding.beam import Beams, Prompts, left_pad, prefill, validate_request
from recspec.decoding.cache import require_full_attention
from recspec.decoding.draft_tree import Level, child_level, feed
from recspec.decoding.sampling import best_first, candidates, draw
from recspec.decoding.speculative import (SpecStats, _advance, _Clock, _compact, _Frontier, _level_zero, _root,
                                          _score, _select_users, check_draft_vocabulary, drafted_per_row)
from recspec.decoding.topk import TopK
from recspec.decoding.warp import Warp
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
    """:class:`~recspec.decoding.speculative.SpecStats` (``accepted_steps``: drafted layers
    accepted, ``drafted_steps``: layers drafted) and, per row: ``steps`` (layers generated),
    ``verified_layers`` (drafted layers verified), ``beta_sum`` (sum over them of
    ``beta_{W_min}``, the probability that at least ``W_min`` drafts are accepted: Theorem 3.2's
    ``beta``), ``width_sum`` (sum of the widths of the generated layers)."""

    steps: torch.Tensor
    verified_layers: torch.Tensor
    beta_sum: torch.Tensor
    width_sum: torch.Tensor


class Ends(Protocol):
    """What text generation adds to a candidate space: finished prefixes continue with the end
    token at probability 1 (``absorb``), and a row is done when all its beams are finished."""

    def absorb(self, nodes: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor: ...

    def complete(self, nodes: torch.Tensor) -> torch.Tensor: ...


# ------------------------------------------------------------------------- the verification


def residual_chain(p: torch.Tensor, q: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residuals ``p_1 = p``, ``p_{k+1} = norm(max(0, p_k - q))`` of the layer verification, in
    closed form ``p_k = max(0, p - shift_k q) / mass_k`` (``shift_1 = 0``, ``shift_{k+1} = shift_k +
    mass_k``), and ``alpha_k = sum min(q, p_k)`` (Eq. 4), for ``k = 1 .. steps``.

    ``p``, ``q``: float32 ``[B, M]`` distributions over the same candidates (``q`` may be all zero:
    no drafts). Returns ``alpha``, ``shift``, ``mass``: float32 ``[B, steps]``. A residual of mass 0
    (reached only after an acceptance probability of 1) gets ``alpha = 1``.
    """
    batch = p.shape[0]
    shift = torch.zeros(batch, device=p.device)
    alphas, shifts, masses = [], [], []
    for _ in range(steps):
        residual = (p - shift[:, None] * q).clamp_(min=0)
        mass = residual.sum(dim=1)
        safe = mass.clamp(min=torch.finfo(mass.dtype).tiny)
        alpha = torch.where(mass > 0, torch.minimum(q, residual / safe[:, None]).sum(dim=1), 1.0)
        alphas.append(alpha)
        shifts.append(shift)
        masses.append(mass)
        shift = shift + mass
    return torch.stack(alphas, dim=1), torch.stack(shifts, dim=1), torch.stack(masses, dim=1)


def acceptance_counts(alpha: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Eq. 2-3: the distribution of the number of accepted drafts among each row's ``drafts``
    (int64 ``[B]``, at most ``A``), from ``alpha`` (float32 ``[B, A]``: ``alpha[:, j]`` is the
    acceptance probability after ``j`` rejections since the last acceptance). float32
    ``[B, A + 1]``, entry ``k``: probability of exactly ``k`` acceptances. The recursion runs as a
    chain over (rejections since the last acceptance, acceptances), one draft at a time."""
    batch = alpha.shape[0]
    size = alpha.shape[1]
    states = torch.zeros(batch, size + 1, size + 1, device=alpha.device)
    states[:, 0, 0] = 1.0
    rate = torch.nn.functional.pad(alpha, (0, 1), value=1.0)[:, :, None]  # [B, A + 1, 1]
    for i in range(int(drafts.max()) if len(drafts) else 0):
        accepted = (states * rate).sum(dim=1)  # [B, S + 1]: by count, before the increment
        moved = torch.zeros_like(states)
        moved[:, 0, 1:] = accepted[:, :-1]
        moved[:, 1:, :] = (states * (1 - rate))[:, :-1, :]
        states = torch.where((i < drafts)[:, None, None], moved, states)
    return states.sum(dim=1)


def layer_widths(counts: torch.Tensor, drafts: torch.Tensor, threshold: float | None, min_width: int) -> torch.Tensor:
    """Eq. 5-7: ``W_L = max(W_min, max{K <= drafts : P(at least K accepted) >= t})`` per row (int64
    ``[B]``) from :func:`acceptance_counts`; ``W_min`` when ``threshold`` is None (fixed width)."""
    if threshold is None:
        return torch.full_like(drafts, min_width)
    at_least = counts.flip(1).cumsum(dim=1).flip(1)  # P(at least K accepted), K = 0, 1, ...
    sizes = torch.arange(counts.shape[1], device=counts.device)
    reachable = (at_least >= threshold) & (sizes >= 1) & (sizes <= drafts[:, None])
    return reachable.sum(dim=1).clamp(min=min_width)


@dataclass(frozen=True)
class LayerVerdict:
    """``chosen``: int64 ``[B, W]``, candidate index of each output beam (accepted drafts in
    acceptance order, then the redraw from the residual, then draws from ``p_beam``; slots past a
    row's width are unused); ``slot``: int64 ``[B, W]``, the draft slot of each accepted beam
    (``-1`` elsewhere); ``accepted``: int64 ``[B]``; ``alpha``: float32 ``[B, S + 1]`` (Eq. 4)."""

    chosen: torch.Tensor
    slot: torch.Tensor
    accepted: torch.Tensor
    alpha: torch.Tensor


def verify_layer(p: torch.Tensor, q: torch.Tensor, choice: torch.Tensor, survive: torch.Tensor, width: torch.Tensor,
                 out_width: int, generator: torch.Generator,
                 chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> LayerVerdict:
    """Alg. 1, lines 13-31, for one layer of ``B`` rows.

    ``p``: float32 ``[B, M]``, ``p_beam`` over the candidates of the accepted beams; ``q``: float32
    ``[B, M]``, the proposal ``q~`` of the surviving drafts (zero outside them); ``choice``: int64
    ``[B, S]``, each draft's candidate index, in draw order; ``survive``: bool ``[B, S]``; ``width``:
    int64 ``[B]``, ``W_L``; ``out_width``: columns of the result (at least every width); ``chain``:
    :func:`residual_chain` of ``p`` and ``q`` over ``S + 1`` steps, if already computed.
    """
    batch, slots = choice.shape
    alpha, shift, mass = chain if chain is not None else residual_chain(p, q, slots + 1)
    p_drafted, q_drafted = p.gather(1, choice), q.gather(1, choice)
    uniform = torch.rand(batch, slots, generator=generator, device=p.device)
    state = torch.zeros(batch, dtype=torch.int64, device=p.device)  # rejections since the last acceptance
    accepted = torch.zeros_like(state)
    slot = torch.full((batch, max(out_width, slots)), -1, dtype=torch.int64, device=p.device)
    for i in range(slots):  # sequential by definition (see the module doc)
        live = survive[:, i] & (accepted < width)
        at = state[:, None]
        ok = live & (uniform[:, i] * mass.gather(1, at)[:, 0] * q_drafted[:, i]
                     < p_drafted[:, i] - shift.gather(1, at)[:, 0] * q_drafted[:, i])
        slot.scatter_(1, accepted[:, None], torch.where(ok, i, slot.gather(1, accepted[:, None])[:, 0])[:, None])
        accepted = accepted + ok.long()
        state = torch.where(ok, 0, torch.where(live, state + 1, state))
    residual = (p - shift.gather(1, state[:, None]) * q).clamp_(min=0)
    target = torch.where(p.sum(1, keepdim=True) > 0, p, 1.0)  # rows already out of the round draw anything
    redraw = torch.multinomial(torch.where(residual.sum(1, keepdim=True) > 0, residual, target), 1,
                               generator=generator)
    fresh = torch.multinomial(target, out_width, replacement=True, generator=generator)
    columns = torch.arange(out_width, device=p.device)[None, :]
    slot = slot[:, :out_width].masked_fill(columns >= accepted[:, None], -1)
    from_drafts = choice.gather(1, slot.clamp(min=0)) if slots else torch.zeros_like(slot)
    chosen = torch.where(slot >= 0, from_drafts, torch.where(columns == accepted[:, None], redraw, fresh))
    return LayerVerdict(chosen=chosen, slot=slot, accepted=accepted, alpha=alpha)


# ---------------------------------------------------------------------------------- the rounds


def _draft_forest(draft, cache, level0: Level, root_log_q: torch.Tensor | None, depth: torch.Tensor, space,
                  ends: Ends | None, config: DSBDConfig, drafted: int, feed_last: bool,
                  generator: torch.Generator) -> list[Level]:
    """Levels ``0 .. drafted``: ``W_S`` i.i.d. draws per level from the draft's ``q_beam`` over the
    previous level's candidates (each level keeps its proposal and draws). The draft is fed each
    level it drafts from (not level 0 in the first round: ``root_log_q`` are its prefill's) and,
    if ``feed_last``, the last one, so that its cache holds what the target's will."""
    levels = [level0]
    warp = config.warp
    for j in range(1, drafted + 1):
        parent = levels[-1]
        log_q = root_log_q if j == 1 and root_log_q is not None else feed(draft, cache, [parent])
        if ends is not None:
            log_q = ends.absorb(parent.nodes, log_q)
        start = Beams(scores=parent.scores, nodes=parent.nodes, tokens=parent.tokens[:, :, None],
                      parents=parent.parents, margin=torch.zeros_like(depth, dtype=torch.float32))
        step = candidates(start, log_q, space, warp.temperature, warp.top_k, warp.top_p)
        choice = draw(step.log_beam, config.draft_width, generator, replacement=True)
        chosen = step.extend(start, choice, space)
        levels.append(child_level(parent, chosen.parents, chosen.tokens[:, :, -1], chosen.nodes, chosen.scores,
                                  depth + j, step.log_beam, choice))
    if feed_last:
        feed(draft, cache, levels[-1:])
    return levels


@dataclass
class _Outcome:
    """Where each row's round ended: the output layer's beams ``[B, W]`` (dead past the row's
    width), the fed index of each beam's parent ``[B, W]``, the layers generated ``[B]``, and the
    per-row counters of the round."""

    beams: Beams
    parent_at: torch.Tensor
    steps: torch.Tensor
    accepted_layers: torch.Tensor
    verified_layers: torch.Tensor
    beta_sum: torch.Tensor
    width_sum: torch.Tensor


def _verify_forest(front: _Frontier, levels: list[Level], log_p: torch.Tensor, space, ends: Ends | None,
                   config: DSBDConfig, k: int, out_width: int, generator: torch.Generator) -> _Outcome:
    """Layers ``1, 2, ...`` of the round (see the module doc, step 3): ``log_p`` float32 ``[B, N, V]``
    are the target's log-probs at the fed nodes (levels in order)."""
    batch = front.depth.shape[0]
    device = front.depth.device
    warp = config.warp
    offsets = [0]
    for level in levels:
        offsets.append(offsets[-1] + level.width)
    alive = front.beams.scores.isfinite()  # [B, n]: the accepted beams of the previous layer
    score = front.beams.scores  # their target scores
    width = alive.sum(dim=1)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    zeros = torch.zeros(batch, device=device)
    out = None
    counters = {name: zeros.clone() for name in ("accepted", "verified", "beta", "widths")}
    for j in range(1, len(levels) + 1):
        parent = levels[j - 1]
        step_log_p = log_p[:, offsets[j - 1]:offsets[j]]
        if ends is not None:
            step_log_p = ends.absorb(parent.nodes, step_log_p)
        previous = Beams(scores=score.masked_fill(~alive, -torch.inf), nodes=parent.nodes,
                         tokens=parent.tokens[:, :, None], parents=parent.parents, margin=front.beams.margin)
        step = candidates(previous, step_log_p, space, warp.temperature, warp.top_k, warp.top_p)
        p = step.log_beam.exp()
        last = front.depth + j >= space.depth
        drafted = levels[j] if j < len(levels) else None
        if drafted is None:  # the bonus layer: straight from p_beam
            width = torch.where(last, k, width if config.threshold is not None else config.min_width)
            verdict = verify_layer(p, torch.zeros_like(p), torch.zeros(batch, 0, dtype=torch.int64, device=device),
                                   torch.zeros(batch, 0, dtype=torch.bool, device=device), width, out_width, generator)
            ok = torch.zeros_like(active)
        else:
            parent_alive = alive[:, torch.arange(p.shape[1], device=device) // step.fanout]
            restricted = drafted.proposal.masked_fill(~parent_alive, -torch.inf)
            some = restricted.isfinite().any(dim=1, keepdim=True)
            q = torch.where(some, torch.softmax(torch.where(some, restricted, 0.0), dim=1), 0.0)
            survive = alive.gather(1, drafted.parents) & drafted.real
            count = survive.sum(dim=1)
            chain = residual_chain(p, q, config.draft_width + 1)
            outcomes = acceptance_counts(chain[0], count)
            width = torch.where(last, k, layer_widths(outcomes, count, config.threshold, config.min_width))
            verdict = verify_layer(p, q, drafted.choice, survive, width, out_width, generator, chain)
            ok = verdict.accepted >= width
            at_least = outcomes.flip(1).cumsum(dim=1).flip(1)
            counters["verified"] += active.float()
            counters["beta"] += torch.where(active, at_least[:, config.min_width], 0.0)
        new = step.extend(previous, verdict.chosen, space)
        dead = torch.arange(out_width, device=device)[None, :] >= width[:, None]
        new = Beams(scores=new.scores.masked_fill(dead, -torch.inf), nodes=new.nodes.masked_fill(dead, -1),
                    tokens=new.tokens, parents=new.parents, margin=new.margin)
        counters["accepted"] += (active & ok).float()
        counters["widths"] += torch.where(active, width.float(), 0.0)
        if ends is not None:  # text ends where every beam has ended, as beam sampling does
            last = last | ends.complete(new.nodes)
        go_on = active & ok & ~last
        stop = active & ~go_on
        parent_at = offsets[j - 1] + new.parents
        steps = torch.full((batch,), j, dtype=torch.int64, device=device)
        if out is None:
            out = _Outcome(new, parent_at, steps, *(zeros for _ in range(4)))
        else:
            rows = stop[:, None]
            out.beams = Beams(scores=torch.where(rows, new.scores, out.beams.scores),
                              nodes=torch.where(rows, new.nodes, out.beams.nodes),
                              tokens=torch.where(rows[:, :, None], new.tokens[:, :, -1:], out.beams.tokens[:, :, -1:]),
                              parents=torch.where(rows, new.parents, out.beams.parents), margin=out.beams.margin)
            out.parent_at = torch.where(rows, parent_at, out.parent_at)
            out.steps = torch.where(stop, j, out.steps)
        if not bool(go_on.any()):
            break
        into = verdict.slot.masked_fill(verdict.slot < 0, drafted.width)  # unused slots land in a spare column
        score = torch.full((batch, drafted.width + 1), -torch.inf, device=device).scatter_(1, into, new.scores)
        score = score[:, :-1]
        alive = score.isfinite()
        active = go_on
    out.accepted_layers, out.verified_layers = counters["accepted"], counters["verified"]
    out.beta_sum, out.width_sum = counters["beta"], counters["widths"]
    return out


def _narrow(front: _Frontier, one_cache: bool) -> _Frontier:
    """The frontier with its live beams first and no column that is dead in every row; only the
    best beam per row in the one-KV-cache mode. Dead beams see nothing (their cache rows go)."""
    live = front.beams.scores.isfinite()
    if one_cache:
        order = front.beams.scores.argmax(dim=1, keepdim=True)
    else:
        order = (~live).to(torch.int8).argsort(dim=1, stable=True)[:, :max(int(live.sum(dim=1).max()), 1)]
    def pick(t: torch.Tensor) -> torch.Tensor:  # [B, K, ...] -> the chosen beams
        return t.gather(1, order.view(*order.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))

    b = front.beams
    beams = Beams(scores=pick(b.scores), nodes=pick(b.nodes), tokens=pick(b.tokens), parents=pick(b.parents),
                  margin=b.margin)
    visible = pick(front.visible) & beams.scores.isfinite()[:, :, None]
    paths = pick(front.paths)
    return _Frontier(beams=beams, paths=paths, depth=front.depth, visible=visible, lengths=front.lengths,
                     users=front.users)


@dataclass
class DSBDResult:
    """Per row, the output beams ``[B, W]`` (dead past each row's last width: score ``-inf``):
    ``scores`` (the target's joint log-probabilities, untempered), ``tokens`` int64 ``[B, W, L]``
    (zeros past a beam's depth), ``nodes`` (of the candidate space), and the statistics."""

    scores: torch.Tensor
    tokens: torch.Tensor
    nodes: torch.Tensor
    stats: DSBDStats


def dsbd_batch(target, draft, prompts: Prompts, space, k: int, config: DSBDConfig, generator: torch.Generator,
               ends: Ends | None = None) -> DSBDResult:
    """DSBD for one left-padded batch over ``space`` (an :class:`~recspec.itemids.trie.ItemTrie`, or
    the free text vocabulary with ``ends``), ``k`` beams in the last layer of a trie."""
    device = prompts.input_ids.device
    clock = _Clock(device)
    batch = len(prompts.lengths)
    stats = DSBDStats.zeros(batch)
    out_width = max(config.draft_width, config.min_width, k)
    scores = torch.full((batch, out_width), -torch.inf, device=device)
    tokens = torch.zeros(batch, out_width, space.depth, dtype=torch.int64, device=device)
    nodes = torch.full((batch, out_width), -1, dtype=torch.int64, device=device)
    started = clock.now()
    root_log_q, draft_cache = prefill(draft, prompts)
    target_cache = DynamicCache(config=target.config)
    caches = (target_cache, draft_cache)
    clock.add("prefill", started)
    front = _root(prompts, space)
    stats.draft_calls += 1
    first = True
    while True:
        remaining = space.depth - int(front.depth.min())
        drafted = min(config.gamma or remaining, remaining - 1)
        feed_last = drafted < remaining - 1
        users = front.users.cpu()
        own_drafted = drafted_per_row(front.depth, space.depth, drafted)
        mark = clock.now()
        levels = _draft_forest(draft, draft_cache, _level_zero(front, prompts if first else None),
                               root_log_q if first else None, front.depth, space, ends, config, drafted, feed_last,
                               generator)
        mark = clock.add("draft", mark)
        log_p = _score(target, target_cache, levels, prompts if first else None)
        if first:
            require_full_attention(target_cache)
            require_full_attention(draft_cache)
        outcome = _verify_forest(front, levels, log_p, space, ends, config, k, out_width, generator)
        clock.add("verify", mark)
        front, _ = _advance(front, levels, outcome.beams, outcome.parent_at, outcome.steps)
        for name, value in (("accepted_steps", outcome.accepted_layers), ("verified_layers", outcome.verified_layers),
                            ("beta_sum", outcome.beta_sum), ("width_sum", outcome.width_sum),
                            ("steps", outcome.steps.float())):
            getattr(stats, name)[users] += value.cpu()
        stats.add_round(users, own_drafted, drafted - first + feed_last, sum(level.width for level in levels[first:]))
        first = False
        finished = front.depth >= space.depth
        if ends is not None:
            finished |= ends.complete(front.beams.nodes)
        if bool(finished.any()):
            rows, width = front.users[finished], front.beams.scores.shape[1]
            scores[rows, :width] = front.beams.scores[finished]
            tokens[rows, :width] = front.paths[finished]
            nodes[rows, :width] = front.beams.nodes[finished]
            if bool(finished.all()):
                break
            front = _select_users(front, (~finished).nonzero()[:, 0], caches)
        front = _compact(_narrow(front, config.one_cache), caches)
    total = clock.now() - started
    for phase in ("prefill", "draft", "verify"):
        getattr(stats, f"{phase}_s")[:] += clock.seconds[phase] / batch
    stats.overhead_s += (total - sum(clock.seconds.values())) / batch
    return DSBDResult(scores=scores, tokens=tokens, nodes=nodes, stats=stats)


def dsbd_beam_search(target, draft, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
                     config: DSBDConfig | None = None, batch_size: int | None = None) -> tuple[TopK, DSBDStats]:
    """``k`` items per prompt by DSBD over the item trie: with ``threshold=None`` and ``min_width=k``
    (fixed width ``k``), exactly the target's beam sampling with replacement
    (:func:`~recspec.decoding.sampling.sampling_beam_search`, ``replacement=True``) at the same
    warping; the ``k`` beams are independent draws, so an item may come out more than once.
    Results best first (by the target's score)."""
    config = config or DSBDConfig(min_width=k, draft_width=2 * k)
    validate_request(target, prompts, trie, k, pad_token_id, batch_size)
    if trie.depth < 2:
        raise RecspecError("DSBD needs identifiers of at least 2 tokens: with 1 there is nothing to draft")
    config.check(trie.depth - 1)
    check_draft_vocabulary(target, draft)
    device = target.device
    trie = trie if trie.device == device else trie.to(device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    size = batch_size or len(prompts)
    parts, stats = [], []
    with torch.inference_mode():
        for start in range(0, len(prompts), size):
            result = dsbd_batch(target, draft, left_pad(prompts[start:start + size], pad_token_id, device), trie, k,
                                config, generator)
            parts.append(best_first(TopK(items=trie.items(result.nodes[:, :k].reshape(-1)).view(-1, k),
                                         scores=result.scores[:, :k], tokens=result.tokens[:, :k])))
            stats.append(result.stats)
    return TopK.cat(parts), DSBDStats.cat(stats)
