"""Draft alignment losses (atspeed.txt sections 3.1-3.2, 4.1): AtSpeed-S, AtSpeed-R and the
SFT / WordKD / SeqKD / TVDKD baselines.

Every loss works on *nodes*: identifier prefixes (of the ground-truth answer or of the target's
top-K sequences) with the log-probabilities both models give their *valid* next tokens, the
trie children of the prefix. Per node, padded to the largest fan-out ``C``:

* ``p``, ``q``: float ``[N, C]``, the target's and the draft's log-probabilities of each child,
  each normalised over the *full* vocabulary (so ``sum exp(p) <= 1``; the rest is the mass on
  tokens that lead to no item); ``-inf`` on padding;
* ``real``: bool ``[N, C]``.

Alignment data stores the target's values at valid tokens only (as the issue asks: not the whole
vocabulary per position), so where a loss is defined over the whole vocabulary (WordKD, TVDKD)
the invalid tokens enter as one lumped token holding their total mass; lumping can only lower a
divergence (data processing inequality) and leaves it exact when either model puts no mass there.
AtSpeed-S and -R are defined over valid tokens only (constrained alignment), so invalid tokens are
really excluded there.
"""

from __future__ import annotations

import torch

_TINY = 1e-12


def _probs(log_probs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Probabilities of the valid tokens, exactly 0 on padding (no NaN, no gradient there)."""
    return log_probs.masked_fill(~real, 0.0).exp() * real


def _clean(log_probs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Log-probabilities with padding set to 0, so that products with zero weights stay finite
    (``where`` / ``masked_fill`` would still route NaN gradients through ``-inf - -inf``)."""
    return log_probs.masked_fill(~real, 0.0)


def _rest(probs: torch.Tensor) -> torch.Tensor:
    """``[N]``: the mass outside the valid tokens, ``1 - sum(probs)``."""
    return (1.0 - probs.sum(dim=-1)).clamp(min=0.0)


def rec_loss(q_at_answer: torch.Tensor) -> torch.Tensor:
    """L_Rec: next-token cross-entropy of the ground-truth answer (the second term of Eq. 5 and
    Eq. 9; SFT alone). ``q_at_answer``: ``[M]``, the draft's log-probability of each answer token.
    Returns the mean over tokens."""
    return -q_at_answer.mean()


def word_kd(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """WordKD (Hinton; Sanh): forward KL(p || q) over the vocabulary at each node, invalid tokens
    lumped (module doc). ``[N]``."""
    p_prob, q_prob = _probs(p, real), _probs(q, real)
    valid = (p_prob * (_clean(p, real) - _clean(q, real))).sum(dim=-1)
    p_rest, q_rest = _rest(p_prob), _rest(q_prob)
    return valid + p_rest * (torch.log(p_rest + _TINY) - torch.log(q_rest + _TINY))


def tvd_kd(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """TVDKD (Wen et al.): total variation distance ``0.5 * sum |p - q|`` over the vocabulary at
    each node, invalid tokens lumped (module doc). ``[N]``."""
    p_prob, q_prob = _probs(p, real), _probs(q, real)
    return 0.5 * ((p_prob - q_prob).abs().sum(dim=-1) + (_rest(p_prob) - _rest(q_prob)).abs())


def seq_kd(q_at_sequences: torch.Tensor) -> torch.Tensor:
    """SeqKD (Kim & Rush): cross-entropy of the target's top-K sequences. ``q_at_sequences``:
    ``[S, L]``, the draft's log-probability of each token of each sequence. Mean over sequences
    and positions."""
    return -q_at_sequences.mean()


def constrained_top_k(scores: torch.Tensor, real: torch.Tensor, k: int) -> torch.Tensor:
    """bool ``[N, C]``: the ``k`` valid tokens of highest ``scores`` at each node (all valid tokens
    where there are fewer): ``ConstrainedTopK`` of Eq. 4 and the top-K valid tokens of Eq. 7-8."""
    width = min(k, scores.shape[-1])
    ranked = scores.masked_fill(~real, -torch.inf).topk(width, dim=-1).indices
    return torch.zeros_like(real).scatter_(-1, ranked, True) & real


def atspeed_s_terms(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor, p_kth: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two terms of AtSpeed-S (Eq. 4) at each node, over ``V_c = ConstrainedTopK(q)``:

    * RKLD: ``sum_{v in V_c} q(v) log(q(v) / p(v))``, the reverse KL restricted to V_c;
    * density regularisation: ``- sum_{v in V_c} q(v) log(q(v) / p(y_K))``, where ``p_kth``
      ``[N]`` is the log of ``p(y_K) = p(y_{K,t} | y_{K,<t})``, the target's probability of the
      token of its K-th sequence at the node's position. Minimising it moves the draft's mass
      onto V_c.

    Their sum equals ``sum_{v in V_c} q(v) log(p(y_K) / p(v))``: maximising the expected
    ``log p(y) / p(y_K)`` of Eq. 2 token by token. Returns ``(rkld, density)``, each ``[N]``.
    """
    chosen = constrained_top_k(q.detach(), real, k)
    q_prob, q_log = _probs(q, chosen), _clean(q, chosen)
    rkld = (q_prob * (q_log - _clean(p, chosen))).sum(dim=-1)
    density = -(q_prob * (q_log - p_kth[:, None])).sum(dim=-1)
    return rkld, density


def atspeed_r(p: torch.Tensor, q: torch.Tensor, real: torch.Tensor, k: int) -> torch.Tensor:
    """AtSpeed-R (Eq. 7-8) at each node: ``TVD(p', q')`` where ``p'`` and ``q'`` are the two
    models' distributions truncated to the target's top-``k`` valid tokens and renormalised (the
    support is the target's so that it does not move with the draft being trained). Every node
    needs at least one valid token. ``[N]``."""
    support = constrained_top_k(p, real, k)
    p_norm = torch.softmax(p.masked_fill(~support, -torch.inf), dim=-1)
    q_norm = torch.softmax(q.masked_fill(~support, -torch.inf), dim=-1)
    return 0.5 * (p_norm - q_norm).abs().sum(dim=-1)
