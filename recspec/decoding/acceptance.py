"""Acceptance rules of every speculative decoder: pure functions from what was drafted and what
the target computed to what is accepted (the round-level verifiers that apply them to a scored
tree are in :mod:`recspec.decoding.verifiers`; over text, :class:`~recspec.decoding.text_rounds.TreeVerifier`
and :class:`~recspec.decoding.chains.ChainVerifier`).

**Trees of beams.** Strict top-K verification (atspeed.txt Alg. 1) needs only
:func:`match_drafted`: the target's own beam-search step is computed from the scored tree, and the
step is accepted when each of its ``K`` new beams is a drafted node. Relaxed sampling verification
(Alg. 2) is :class:`RelaxedSampler`. Exact sampling over a top-``N`` tree is strict's rule with
the target's own sampling step in place of its beam-search step (see
:class:`~recspec.decoding.verifiers.StepVerifier`). DSBD's layer verification (dsbd.txt Alg. 1,
lines 13-31) is :func:`verify_layer`, with the residual chain (Eq. 4), the distribution of the number of
acceptances (Eq. 2-3) and the dynamic width (Eq. 5-7) it rests on.

**Trees of text tokens.** :class:`TreeAcceptance`: the target's own token at every node and which
drafted nodes pass (greedy, LASER's relaxed rule, exact sampling by inverse transform; the reasons
are in :mod:`recspec.knowledge.verify`), and :func:`accepted_path`, the deepest fully accepted path.

**Chains of tokens.** Speculative sampling (speculative_decoding.txt Alg. 1, sections 3.1-3.5,
A.1, A.5): the verification of a drafted chain, :func:`verify_chain`, one vectorised function
over a batch.

A draft model proposes ``gamma`` tokens ``x_1 .. x_gamma``; the target scores the prefix and every
drafted prefix in one call, giving ``p_1 .. p_{gamma+1}``. Token ``x_i`` is accepted with
probability ``min(1, p_i(x_i) / (l * q_i(x_i)))``; the first rejected position ``n + 1`` is
redrawn from ``norm(max(0, p_{n+1} - l * q_{n+1}))``; when all ``gamma`` are accepted a bonus
token is drawn from ``p_{gamma+1}``. ``p`` and ``q`` are the *warped* distributions
(:class:`~recspec.decoding.warp.Warp`, the same temperature / top-k / top-p for both).

**Lenience** ``l`` in (0, 1] (section A.5: ``q`` multiplied by ``l`` before the comparison, in the
acceptance test and in the residual alike). With ``l = 1`` every emitted token is distributed
exactly as ``p`` (Theorem A.1). With ``l < 1`` a drafted position emits ``x`` with probability

    P_l(x) = min(q(x), p(x) / l) + (1 - a_l) * max(0, p(x) - l q(x)) / (1 - l a_l),
    a_l = sum_x min(q(x), p(x) / l)                              (the A.5 acceptance rate)

(accepted draws give the first term; a rejection, of probability ``1 - a_l``, redraws from the
residual, whose mass is ``1 - l a_l``). Since ``(1 - a_l) / (1 - l a_l) <= 1``, ``P_l(x) <= p(x) / l``
for every token: where ``l q <= p`` the bound reduces to ``(1 - l) q <= (1 - l) p / l``, elsewhere
``P_l = p / l``. That is A.5's guarantee that no token is sampled with more than ``1 / l`` times its
probability; bonus tokens are exact draws from ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from recspec.decoding.beams import Beams, candidates, draw
from recspec.decoding.categorical import categorical, inverse_transform, or_uniform
from recspec.decoding.draft_tree import Level
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie


def match_drafted(parent_fed: torch.Tensor, tokens: torch.Tensor, level: Level,
                  parent_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sequences are drafted nodes of ``level``, and which.

    ``parent_fed``: int64 ``[B, K]``, the fed index (position in the scored tree) of each
    sequence's parent; ``tokens``: int64 ``[B, K]``, its last token; ``level``: the drafted level
    at the sequences' depth, whose ``parents`` index the previous level, fed from
    ``parent_offset`` on. Returns ``found`` bool ``[B, K]`` and ``index`` int64 ``[B, K]``, the
    matching node's index within the level (0 where not found).
    """
    same_parent = (parent_offset + level.parents)[:, None, :] == parent_fed[:, :, None]
    same_token = level.tokens[:, None, :] == tokens[:, :, None]
    match = same_parent & same_token & level.real[:, None, :]  # [B, K, n]
    return match.any(dim=2), match.int().argmax(dim=2)


def strict_accepted(new: Beams, where: torch.Tensor, drafted: Level | None, parent_offset: int,
                    level_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict top-K verification of one step (atspeed.txt Alg. 1). ``new``: the target's ``K``
    new beams, continuing the beams fed at ``where`` (int64 ``[B, S]``). Returns accepted, bool
    ``[B]``: each new beam (dead fillers aside) is a node of the drafted level; and the fed index
    of each new beam's node (``[B, K]``, meaningful where accepted). Nothing drafted (the bonus
    step): never accepted."""
    if drafted is None:
        return torch.zeros(where.shape[0], dtype=torch.bool, device=where.device), where
    found, index = match_drafted(where.gather(1, new.parents), new.tokens[:, :, -1], drafted, parent_offset)
    return (found | new.scores.isneginf()).all(dim=1), level_offset + index


@dataclass(frozen=True)
class RelaxedSampler:
    """Relaxed sampling verification (atspeed.txt Alg. 2, section 3.2).

    The draft draws ``K`` sequences per level from its own beam-sampling distribution ``q_beam``
    (:class:`~recspec.decoding.drafters.SampledDrafter`, scored from the target's exact beam
    scores at level 0 and the draft's log-probabilities after it). At step ``j``, with the target's beams equal to the
    drafted level ``j - 1`` (both distributions are then over the same candidates), each drafted
    sequence ``y`` is accepted with probability ``min(1, p_beam(y) / q_beam(y))``; the step is
    accepted when all ``K`` are. Otherwise every rejected slot is redrawn from the residual
    ``norm(max(0, p_beam - q_beam))`` and the round ends there.

    * ``replacement=True``: slots are independent; each output slot is then exactly one draw from
      ``p_beam`` (Leviathan et al., Theorem 1, per slot), so the search samples exactly the target's
      with-replacement beam sampling (:func:`~recspec.decoding.beam_search.sampling_beam_search` with
      ``replacement=True``).
    * ``replacement=False`` (default: ``K`` distinct items): drafts are drawn without replacement,
      verified as if independent, and the residual excludes the sequences already kept (Alg. 2
      line 17), redrawn slots distinct; if the residual's support runs out, the remaining slots
      are drawn from ``p_beam`` without the kept sequences. This is the paper's approximation of
      the target's without-replacement beam sampling: it departs from it by the dependence that
      sampling without replacement introduces, small when ``K`` is small against the spread of
      ``p_beam`` and growing as ``p_beam`` concentrates on few candidates (measured in the tests).
    """

    warp: Warp
    generator: torch.Generator
    replacement: bool = False

    def verify(self, current: Beams, where: torch.Tensor, step_log_p: torch.Tensor, drafted: Level | None,
               level_offset: int, trie: ItemTrie, k: int) -> tuple[Beams, torch.Tensor, torch.Tensor]:
        """One step of the target from its beams ``current`` (fed at ``where``, log-probs
        ``step_log_p`` ``[B, S, V]``) against the drafted level (None: nothing drafted, a plain
        sampling step). Returns the new beams, whether the step was accepted ``[B]``, and the fed
        index of each new beam when it was (the drafted nodes, from ``level_offset``)."""
        # as many candidates as draws: the target's k, and the drafted ones (so that both layouts
        # pad a narrow trie level alike, :func:`_in_layout`)
        step = candidates(current, step_log_p, trie, self.warp, max(k, 0 if drafted is None else drafted.choice.shape[1]))
        batch = where.shape[0]
        if drafted is None:
            chosen = draw(step.log_beam, k, self.generator, self.replacement)
            return step.extend(current, chosen, trie), torch.zeros(batch, dtype=torch.bool, device=where.device), where
        proposal, choice = _in_layout(drafted.proposal, drafted.choice, current.nodes.shape[1], step.fanout)
        log_p = step.log_beam.gather(1, choice)
        log_q = proposal.gather(1, choice)
        uniform = torch.rand(log_p.shape, generator=self.generator, device=log_p.device)
        dead = log_q.isneginf()  # fewer candidates than k: the target's draw has the same dead slots
        accept = dead | (torch.log(uniform) + log_q <= log_p)
        residual = (step.log_beam.exp() - proposal.exp()).clamp_(min=0)
        if self.replacement:
            redrawn = draw(_safe_log(residual, step.log_beam), k, self.generator, replacement=True)
        else:
            redrawn = self._redraw_distinct(residual, step.log_beam, choice, accept, k)
        chosen = torch.where(accept, choice, redrawn)
        fed = level_offset + torch.arange(k, device=where.device).expand(batch, k)
        return step.extend(current, chosen, trie), accept.all(dim=1), fed

    def _redraw_distinct(self, residual: torch.Tensor, log_beam: torch.Tensor, choice: torch.Tensor,
                         accept: torch.Tensor, k: int) -> torch.Tensor:
        """For each rejected slot, in slot order, a distinct redraw: without replacement from the
        residual with the kept sequences zeroed, then (support exhausted) from ``p_beam`` without
        them. int64 ``[B, k]`` (entries at accepted slots are unused)."""
        kept = torch.zeros_like(residual, dtype=torch.bool).scatter_(1, choice, accept)
        residual = residual.masked_fill(kept, 0.0)
        uniform = torch.rand(residual.shape, generator=self.generator, device=residual.device)
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(uniform.dtype).tiny)))
        from_residual = torch.log(residual) + gumbel
        from_target = log_beam.masked_fill(kept, -torch.inf) + gumbel - _RESIDUAL_FIRST
        keys = torch.where(residual > 0, from_residual, from_target)
        picks = keys.topk(k, dim=1).indices  # residual draws first, in order, then the fallback
        rank = ((~accept).long().cumsum(dim=1) - 1).clamp_(min=0)  # i-th rejected slot takes pick i
        return picks.gather(1, rank)


def _in_layout(proposal: torch.Tensor, choice: torch.Tensor, beams: int,
               fanout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafted proposal (``[B, beams * C_q]``) and choices (``[B, k]``) in the layout of the
    target's candidates, ``[B, beams * fanout]``.

    Both layouts are beam-major with the batch's largest fan-out as the row width, so they differ
    when users that left the round earlier (their beams no longer the drafted ones) sit on wider
    trie nodes than any drafted beam, or the reverse. A user still in the round has the same
    beams in both, with at most ``min(C_q, fanout)`` children each, so re-padding moves nothing
    real; the rows of the other users are not used.
    """
    batch, drafted_fanout = proposal.shape[0], proposal.shape[1] // beams
    if drafted_fanout == fanout:
        return proposal, choice
    grid = proposal.view(batch, beams, drafted_fanout)[:, :, :fanout]
    grid = torch.nn.functional.pad(grid, (0, fanout - grid.shape[2]), value=-torch.inf)
    column = (choice % drafted_fanout).clamp_(max=fanout - 1)
    return grid.reshape(batch, beams * fanout), choice // drafted_fanout * fanout + column


#: Offset that ranks every residual draw before every fallback draw (log weights and Gumbel
#: noise stay far inside it).
_RESIDUAL_FIRST = 1e6


def _safe_log(residual: torch.Tensor, log_beam: torch.Tensor) -> torch.Tensor:
    """log of the residual; rows where it is all zero (p_beam == q_beam: nothing is ever
    rejected there) fall back to ``log_beam`` so that a draw is defined."""
    empty = ~(residual > 0).any(dim=1, keepdim=True)
    return torch.where(empty, log_beam, torch.log(residual))


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
    target = or_uniform(p)  # rows already out of the round draw anything
    redraw = categorical(torch.where(residual.sum(1, keepdim=True) > 0, residual, target), 1, generator)
    fresh = categorical(target, out_width, generator)
    columns = torch.arange(out_width, device=p.device)[None, :]
    slot = slot[:, :out_width].masked_fill(columns >= accepted[:, None], -1)
    from_drafts = choice.gather(1, slot.clamp(min=0)) if slots else torch.zeros_like(slot)
    chosen = torch.where(slot >= 0, from_drafts, torch.where(columns == accepted[:, None], redraw, fresh))
    return LayerVerdict(chosen=chosen, slot=slot, accepted=accepted, alpha=alpha)


@dataclass(frozen=True)
class ChainVerdict:
    """Per row, for ``B`` rows: ``accepted`` int64 ``[B]``, ``n`` drafted tokens kept;
    ``token`` int64 ``[B]``, the token emitted after them (the redraw at position ``n + 1``, or the
    bonus token when ``n = gamma``); ``alpha`` float32 ``[B, gamma]``, the acceptance rate
    ``a_l = sum_x min(q_i(x), p_i(x) / l)`` at each drafted position (Leviathan's ``beta``, whose
    mean over the tried positions estimates ``alpha``)."""

    accepted: torch.Tensor
    token: torch.Tensor
    alpha: torch.Tensor


def check_lenience(lenience: float) -> None:
    if not 0 < lenience <= 1:
        raise RecspecError(f"lenience must lie in (0, 1] (1: exact), got {lenience!r}")


def verify_chain(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator,
                 lenience: float = 1.0, lengths: torch.Tensor | None = None) -> ChainVerdict:
    """Leviathan et al.'s Alg. 1 from the draft onwards, for ``B`` rows at once.

    ``drafts``: int64 ``[B, gamma]``; ``q``: float32 ``[B, gamma, V]``, the distribution each
    ratio and residual use (the warped draft distribution); ``p``: float32 ``[B, gamma + 1, V]``,
    the warped target distributions after the prefix and after each drafted prefix; ``lengths``:
    int64 ``[B]`` (1..gamma, None: all ``gamma``), the drafted chain of each row: its drafts from
    there on are not its own (drafted for other rows of the batch), so at most that many are
    accepted, and a row that accepts all of its own draws the next token from ``p``, as Alg. 1
    with that row's ``gamma``. One uniform per drafted token and one categorical draw per row; no
    loop.
    """
    batch, gamma = drafts.shape
    own = gamma if lengths is None else lengths
    p_drafted = p[:, :gamma].gather(2, drafts[:, :, None])[:, :, 0]
    q_drafted = q.gather(2, drafts[:, :, None])[:, :, 0]
    uniform = torch.rand(batch, gamma, generator=generator, device=drafts.device)
    ok = uniform * lenience * q_drafted < p_drafted  # probability min(1, p / (l q)); q > 0 where drafted
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    if lengths is not None:
        accepted = torch.minimum(accepted, lengths)
    at = accepted.clamp(max=gamma - 1)[:, None, None].expand(-1, 1, p.shape[2])
    residual = (p.gather(1, at) - lenience * q.gather(1, at)).clamp_(min=0)[:, 0]
    residual_mass = residual.sum(dim=1, keepdim=True)
    target_next = p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[2]))[:, 0]
    # rows whose residual is empty (p == l q up to rounding: a rejection there has probability 0,
    # rounding aside) redraw from p itself
    redraw = torch.where(((accepted < own) & (residual_mass[:, 0] > 0))[:, None], residual, target_next)
    token = categorical(redraw, 1, generator)[:, 0]
    alpha = torch.minimum(q, p[:, :gamma] / lenience).sum(dim=2)
    return ChainVerdict(accepted=accepted, token=token, alpha=alpha)


def expected_tokens_per_call(alpha: float, gamma: int) -> float:
    """speculative_decoding.txt Eq. 1: ``(1 - alpha^(gamma+1)) / (1 - alpha)`` tokens per target
    call when the per-token acceptance rates are i.i.d. with mean ``alpha``."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, cost: float, verify_ratio: float = 1.0) -> float:
    """Theorem 3.8: the expected walltime improvement ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))``
    of ``gamma`` drafted tokens per round with a draft costing ``c`` target calls per call.
    ``verify_ratio``: the target's call over ``gamma + 1`` tokens in one-token calls, which the
    theorem takes as 1 (a call's cost independent of the tokens fed; on this project's CPU a
    4-token call of SmolLM2 costs 1.4 one-token calls): the denominator becomes ``gamma c + ratio``."""
    return expected_tokens_per_call(alpha, gamma) / (gamma * cost + verify_ratio)


class TreeAcceptance(Protocol):
    """The acceptance rule of a text token tree scored by the target (the text round loop,
    :class:`~recspec.decoding.text_rounds.TreeVerifier`): pure, vectorised over ``B`` rows of
    ``N`` nodes (node 0 the root, the last committed token; ``parents`` int64 ``[B, N]``, ``-1`` at
    the root, else a smaller index; ``logits`` ``[B, N, V]`` the target's after each node).

    ``draws``: whether :meth:`choices` needs one uniform per node (its text position's);
    :meth:`choices`: int64 ``[B, N]``, the target's own token after each node; :meth:`accept`: bool
    ``[B, N]``, which nodes pass the rule given their parent's distribution and the target's
    choices there (the root always passes). A node counts only with its whole root path
    (:func:`accepted_path`). Implementations: :class:`GreedyAcceptance`, :class:`RelaxedAcceptance`
    (LASER's Eq. 4 and Eq. 8) and :class:`SampledAcceptance` (exact sampling over a tree)."""

    draws: bool

    def choices(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor: ...

    def accept(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
               choices: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class GreedyAcceptance:
    """A node passes when its token is the target's argmax at its parent (``torch.argmax``: the
    first maximal id, greedy ``generate``'s tie rule): the text is the greedy decoding's."""

    draws = False

    def choices(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def accept(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
               choices: torch.Tensor) -> torch.Tensor:
        return chosen_accept(tokens, parents, choices)


@dataclass(frozen=True)
class RelaxedAcceptance(GreedyAcceptance):
    """:func:`relaxed_accept` with ``top_k`` and ``min_prob``; the target's own token is its argmax."""

    top_k: int = 2
    min_prob: float = 0.1

    def accept(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
               choices: torch.Tensor) -> torch.Tensor:
        return relaxed_accept(tokens, parents, logits, self.top_k, self.min_prob)


@dataclass(frozen=True)
class SampledAcceptance:
    """A node passes when its token is the target's own draw at its parent: the inverse transform
    of the parent's distribution warped by ``warp`` at the uniform of the text position the token
    fills (``uniforms`` float64 ``[B, N]`` in ``[0, 1)``)."""

    warp: Warp = Warp()
    draws = True

    def choices(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
        if uniforms is None:
            raise ValueError("sampling verification needs the uniforms of the nodes' text positions")
        weights = self.warp(logits).exp()  # [B, N, V]
        return inverse_transform(weights.flatten(0, 1), uniforms.reshape(-1, 1)).view(uniforms.shape)

    def accept(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
               choices: torch.Tensor) -> torch.Tensor:
        return chosen_accept(tokens, parents, choices)


def chosen_accept(tokens: torch.Tensor, parents: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """bool ``[B, N]``: ``tokens[b, n] == choices[b, parents[b, n]]`` (the target's own token at the
    parent, int64 ``[B, N]``); root True."""
    return (tokens == choices.gather(1, parents.clamp_min(0))) | (parents < 0)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """bool ``[B, N]``: ``tokens[b, n] == argmax logits[b, parents[b, n]]`` (LASER's Eq. 4); root True."""
    return chosen_accept(tokens, parents, logits.argmax(dim=-1))


def relaxed_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, top_k: int,
                   min_prob: float) -> torch.Tensor:
    """bool ``[B, N]``: LASER's Eq. 8 as a relaxation of greedy (:mod:`recspec.knowledge.verify`):
    ``tokens[b, n]`` is the greedy token of ``q = softmax(logits[b, parent])``, or it is in the top
    ``top_k`` of ``q`` (probability >= the ``top_k``-th largest) with ``q(token) > min_prob``; root
    True."""
    probs = torch.softmax(logits.float(), dim=-1)  # [B, N, V]
    kth = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values[..., -1]  # [B, N]
    parent = parents.clamp_min(0)
    token_prob = probs.flatten(1).gather(1, parent * probs.shape[-1] + tokens)  # [B, N]: q_parent(token)
    ok = (token_prob >= kth.gather(1, parent)) & (token_prob > min_prob)
    return ok | greedy_accept(tokens, parents, logits)


def accepted_path(accept: torch.Tensor, ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deepest node whose root path is all accepted: ``(last [B], path [B, N])`` from ``accept``
    bool ``[B, N]`` and ``ancestors`` bool ``[B, N, N]``
    (:func:`~recspec.decoding.tree.ancestor_matrix`).

    ``path[b, n]`` is True for the nodes on that path (root included), so ``path.sum(1) - 1``
    draft tokens were accepted. Among equally deep candidates the smallest node index wins.
    """
    alive = ~(ancestors & ~accept[:, None, :]).any(dim=-1)  # [B, N]: every ancestor accepted
    depth = ancestors.sum(dim=-1)  # [B, N], 1 for the root
    last = torch.where(alive, depth, 0).argmax(dim=1)  # first maximum
    path = ancestors.gather(1, last[:, None, None].expand(-1, 1, ancestors.shape[2]))[:, 0]
    return last, path
