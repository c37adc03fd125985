"""Speculative sampling (speculative_decoding.txt Alg. 1, sections 3.1-3.5, A.1, A.5): the
verification of a drafted chain, as one vectorised function over a batch.

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

import torch

from recspec.errors import RecspecError


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
                 lenience: float = 1.0) -> ChainVerdict:
    """Leviathan et al.'s Alg. 1 from the draft onwards, for ``B`` rows at once.

    ``drafts``: int64 ``[B, gamma]``; ``q``: float32 ``[B, gamma, V]``, the distribution each
    ratio and residual use (the warped draft distribution); ``p``: float32 ``[B, gamma + 1, V]``,
    the warped target distributions after the prefix and after each drafted prefix. One uniform
    per drafted token and one categorical draw per row; no loop.
    """
    batch, gamma = drafts.shape
    p_drafted = p[:, :gamma].gather(2, drafts[:, :, None])[:, :, 0]
    q_drafted = q.gather(2, drafts[:, :, None])[:, :, 0]
    uniform = torch.rand(batch, gamma, generator=generator, device=drafts.device)
    ok = uniform * lenience * q_drafted < p_drafted  # probability min(1, p / (l q)); q > 0 where drafted
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    at = accepted.clamp(max=gamma - 1)[:, None, None].expand(-1, 1, p.shape[2])
    residual = (p.gather(1, at) - lenience * q.gather(1, at)).clamp_(min=0)[:, 0]
    residual_mass = residual.sum(dim=1, keepdim=True)
    target_next = p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[2]))[:, 0]
    # rows whose residual is empty (p == l q up to rounding: a rejection there has probability 0,
    # rounding aside) redraw from p itself
    redraw = torch.where((accepted < gamma)[:, None] & (residual_mass > 0), residual, target_next)
    token = torch.multinomial(redraw, 1, generator=generator)[:, 0]
    alpha = torch.minimum(q, p[:, :gamma] / lenience).sum(dim=2)
    return ChainVerdict(accepted=accepted, token=token, alpha=alpha)


def expected_tokens_per_call(alpha: float, gamma: int) -> float:
    """speculative_decoding.txt Eq. 1: ``(1 - alpha^(gamma+1)) / (1 - alpha)`` tokens per target
    call when the per-token acceptance rates are i.i.d. with mean ``alpha``."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, cost: float) -> float:
    """Theorem 3.8: the expected walltime improvement ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))``
    of ``gamma`` drafted tokens per round with a draft costing ``c`` target calls per call."""
    return expected_tokens_per_call(alpha, gamma) / (gamma * cost + 1)
