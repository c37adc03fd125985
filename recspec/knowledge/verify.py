"""How knowledge generation verifies a drafted token tree: :class:`Verification`, the command's and
the store's choice among the tree acceptance rules of :mod:`recspec.decoding.acceptance`
(:class:`~recspec.decoding.acceptance.TreeAcceptance`: pure functions, tensors in, tensors out).

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
same text as plain sampling (:func:`~recspec.decoding.text_rounds.speculative_generate` without a
drafter), up to the rounding of a tree call against a one-token call, as for greedy. A node whose
siblings are ``c_1 .. c_m`` is accepted with probability ``p(c_i)``, so a level is accepted with
``sum_i p(c_i)``: the point-mass case of Leviathan's test applied to the siblings in turn
(accepting ``c_i`` with probability ``p'(c_i) / 1`` under the residual ``p'`` left by the ones
before), which EAGLE's sampling verification also uses; the draft's own probabilities only choose
the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from recspec.decoding.acceptance import GreedyAcceptance, RelaxedAcceptance, SampledAcceptance, TreeAcceptance
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError

VERIFIERS = ("greedy", "relaxed", "sample")


@dataclass(frozen=True)
class Verification:
    """How draft tokens are accepted: ``kind`` greedy, relaxed (with ``top_k`` and ``min_prob``)
    or sample (from the target's distribution warped by ``warp``); :attr:`rule` is the acceptance
    rule the text round loop applies."""

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

    @property
    def rule(self) -> TreeAcceptance:
        """The tree acceptance rule of this ``kind``."""
        if self.kind == "relaxed":
            return RelaxedAcceptance(self.top_k, self.min_prob)
        return SampledAcceptance(self.warp) if self.kind == "sample" else GreedyAcceptance()

    def describe(self) -> str:
        # the rule is spelled out, so a store of the literal Eq. 8 (before the argmax was always kept)
        # is refused rather than resumed
        if self.kind == "sample":
            warp = self.warp
            return f"sample (T={warp.temperature:g}, top-k {warp.top_k}, top-p {warp.top_p})"
        return ("greedy" if self.kind == "greedy"
                else f"relaxed (the argmax, or top-{self.top_k} with p > {self.min_prob:g})")
