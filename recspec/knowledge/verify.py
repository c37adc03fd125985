"""Verifiers for a token tree scored by the target: pure functions, tensors in, tensors out.

Shapes, for ``B`` rows of ``N`` tree nodes over a vocabulary of ``V``:

* ``tokens``: int64 ``[B, N]``, the node tokens; node 0 of each row is the *root*, the last
  committed token (fed so that the target scores what follows it); nodes ``1..N-1`` are draft
  tokens;
* ``parents``: int64 ``[B, N]``, ``-1`` for the root, else the parent node, always a smaller
  index;
* ``logits``: ``[B, N, V]``, the target's next-token logits after each node (from
  :func:`~recspec.decoding.scorer.score_tree`);
* ``ancestors``: bool ``[B, N, N]`` from :func:`~recspec.decoding.tree.ancestor_matrix`.

A draft node is *accepted* by a rule applied to its token and the target's distribution at its
parent, ``q = softmax(logits[parent])``:

* greedy (laser.txt Eq. 4): ``token == argmax q`` (``torch.argmax``: the first maximal id, the
  same tie rule as greedy ``generate``), so the output is the greedy decoding's;
* relaxed (Eq. 8, as a relaxation of greedy): ``token`` is the greedy token (``argmax q``), **or**
  it is among the ``k`` most probable tokens of ``q`` (its probability is at least the ``k``-th
  largest) **and** ``q(token) > p``.

Why the greedy token always passes: read literally, Eq. 8 rejects the argmax when ``q(argmax) <=
p`` (a flat distribution). The step then emits that very token anyway, as the target's correction,
and only throws the rest of the branch away. Accepting it keeps the same guarantee on every output
token (the greedy token, or a top-``k`` token above ``p``: the threshold exists to stop low-probability
non-greedy tokens, laser.txt 3.4) with fewer target calls, and makes relaxed acceptance a superset
of greedy acceptance, as the paper describes it ("expand the verification criteria from the
highest probability token to the top-k probable tokens"; its top-p variant likewise keeps the
highest-probability token).

* sample (exact speculative sampling over a tree): ``token`` is the target's own *draw* at the
  parent, ``F^-1(u)`` of the parent's warped distribution (inverse transform) at the uniform
  ``u`` of the text position the token fills.

A node counts only if its whole root path is accepted; the decoder keeps the deepest such node
(the first in node order among equally deep ones: the most frequent draft) and appends the
target's own token after it (its greedy token, or its draw), so every step commits at least one
token.

**Why sampling over a tree is exact, and the same text as plain sampling.** Every node's draw uses
the uniform of its text position, one uniform per position for the whole request (drawn before
decoding). Along the accepted path, the token at position ``t`` is ``F^-1(u_t)`` of the target's
warped distribution after the text before it: exactly what plain ancestral sampling by inverse
transform with the same uniforms emits at ``t``, whatever the tree. The text is therefore a draw
from the target's warped distribution (the ``u_t`` are independent), and for a given seed the
same text as plain sampling (:func:`~recspec.knowledge.decode.speculative_generate` without a
drafter), up to the rounding of a tree call against a one-token call, as for greedy. A node whose
siblings are ``c_1 .. c_m`` is accepted with probability ``p(c_i)``, so a level is accepted with
``sum_i p(c_i)``: the point-mass case of Leviathan's test applied to the siblings in turn
(accepting ``c_i`` with probability ``p'(c_i) / 1`` under the residual ``p'`` left by the ones
before), which EAGLE's sampling verification also uses; the draft's own probabilities only choose
the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recspec.decoding.categorical import inverse_transform
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError

VERIFIERS = ("greedy", "relaxed", "sample")


@dataclass(frozen=True)
class Verification:
    """How draft tokens are accepted: ``kind`` greedy, relaxed (with ``top_k`` and ``min_prob``)
    or sample (from the target's distribution warped by ``warp``)."""

    kind: str = "greedy"
    top_k: int = 2
    min_prob: float = 0.1
    warp: Warp = Warp()

    def __post_init__(self) -> None:
        if self.kind not in VERIFIERS:
            raise RecspecError(f"unknown verification {self.kind!r}; choose one of {', '.join(VERIFIERS)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise RecspecError(f"relaxed verification needs k >= 1 (an integer), got {self.top_k!r}")
        if not 0.0 <= self.min_prob < 1.0:
            raise RecspecError(f"relaxed verification needs p in [0, 1), got {self.min_prob!r}")
        if self.kind == "sample":
            self.warp.check()

    def choices(self, logits: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """int64 ``[B, N]``: the target's own token after each node, its argmax (greedy, relaxed), or
        (sample) the inverse transform of its warped distribution at ``uniforms`` (float64
        ``[B, N]`` in ``[0, 1)``, each node's text position's)."""
        if self.kind != "sample":
            return logits.argmax(dim=-1)
        if uniforms is None:
            raise ValueError("sampling verification needs the uniforms of the nodes' text positions")
        weights = self.warp(logits).exp()  # [B, N, V]
        return inverse_transform(weights.flatten(0, 1), uniforms.reshape(-1, 1)).view(uniforms.shape)

    def accept(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
               choices: torch.Tensor) -> torch.Tensor:
        """bool ``[B, N]``: which nodes pass this rule given their parent's distribution and the
        target's :meth:`choices` (the root always passes)."""
        if self.kind == "relaxed":
            return relaxed_accept(tokens, parents, logits, self.top_k, self.min_prob)
        return chosen_accept(tokens, parents, choices)

    def describe(self) -> str:
        # the rule is spelled out, so a store of the literal Eq. 8 (before the argmax was always kept)
        # is refused rather than resumed
        if self.kind == "sample":
            warp = self.warp
            return f"sample (T={warp.temperature:g}, top-k {warp.top_k}, top-p {warp.top_p})"
        return ("greedy" if self.kind == "greedy"
                else f"relaxed (the argmax, or top-{self.top_k} with p > {self.min_prob:g})")


def _at_parents(values: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``values[b, parents[b, n]]`` for per-node ``values [B, N]`` (the root gets its own)."""
    return values.gather(1, parents.clamp_min(0))


def chosen_accept(tokens: torch.Tensor, parents: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """bool ``[B, N]``: ``tokens[b, n] == choices[b, parents[b, n]]`` (the target's own token at the
    parent, int64 ``[B, N]``); root True."""
    return (tokens == _at_parents(choices, parents)) | (parents < 0)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """bool ``[B, N]``: ``tokens[b, n] == argmax logits[b, parents[b, n]]`` (Eq. 4); root True."""
    return chosen_accept(tokens, parents, logits.argmax(dim=-1))


def relaxed_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, top_k: int,
                   min_prob: float) -> torch.Tensor:
    """bool ``[B, N]``: Eq. 8 as a relaxation of greedy (module docstring): ``tokens[b, n]`` is
    the greedy token of ``q = softmax(logits[b, parent])``, or it is in the top ``top_k`` of ``q``
    (probability >= the ``top_k``-th largest) with ``q(token) > min_prob``; root True."""
    probs = torch.softmax(logits.float(), dim=-1)  # [B, N, V]
    kth = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values[..., -1]  # [B, N]
    parent = parents.clamp_min(0)
    token_prob = probs.flatten(1).gather(1, parent * probs.shape[-1] + tokens)  # [B, N]: q_parent(token)
    ok = (token_prob >= kth.gather(1, parent)) & (token_prob > min_prob)
    return ok | greedy_accept(tokens, parents, logits)


def accepted_path(accept: torch.Tensor, ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deepest node whose root path is all accepted: ``(last [B], path [B, N])``.

    ``path[b, n]`` is True for the nodes on that path (root included), so ``path.sum(1) - 1``
    draft tokens were accepted. Among equally deep candidates the smallest node index wins.
    """
    alive = ~(ancestors & ~accept[:, None, :]).any(dim=-1)  # [B, N]: every ancestor accepted
    depth = ancestors.sum(dim=-1)  # [B, N], 1 for the root
    last = torch.where(alive, depth, 0).argmax(dim=1)  # first maximum
    path = ancestors.gather(1, last[:, None, None].expand(-1, 1, ancestors.shape[2]))[:, 0]
    return last, path
