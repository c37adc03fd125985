"""TopK-ImpSpecDec drafting (topk_impspecdec.txt Alg. 1, sections 3.1-3.3).

At drafted position ``i`` the draft's ``K`` most probable tokens ``T_K`` (of its warped
distribution ``q_i``) are reweighted by the importance weights ``w(y) = p_i(y) / q_i(y)`` and one
token is drawn from ``r_i(y) = w(y) / sum_{T_K} w`` (Eq. 2-3); verification is Leviathan's, with
the ratio ``p / q`` and the residual ``norm(max(0, p - q))`` (Alg. 1 lines 19-29, from
:func:`~recspec.decoding.specsample.verify_chain`).

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

import torch


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
