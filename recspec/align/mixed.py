"""Target-mixed alignment sequences (atspeed.txt Eq. 3 and its footnote 3, after MiniLLM):
``D' = {(x, TopK((1 - lambda) M_q(x) + lambda M_p(x)))}``, the top-K of trie-constrained beam
search in which every next-token distribution is the mixture ``(1 - lambda) q + lambda p`` of the
draft's ``q`` and the target's ``p``.

``lambda = 1`` is the target's own top-K (the default data); smaller values move the sequences
towards what the draft would propose, so that the alignment losses also look at the draft's own
likely beams. The draft that mixes is a fixed model (typically the SFT draft that the aligned
draft is trained from): the data are made once, not re-sampled while the draft trains.
"""

from __future__ import annotations

import math

import torch

from recspec.decoding.beam_search import TreeCache, beam_steps
from recspec.decoding.beams import Beams, TopK
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import prefill
from recspec.itemids.trie import ItemTrie


def mix_log_probs(p: torch.Tensor, q: torch.Tensor, lam: float) -> torch.Tensor:
    """``log((1 - lam) exp(q) + lam exp(p))`` elementwise, for ``p``, ``q`` log-probs of the same
    shape and ``0 <= lam <= 1`` (``lam = 1`` returns ``p`` itself, ``lam = 0`` ``q``)."""
    if lam >= 1.0:
        return p
    if lam <= 0.0:
        return q
    return torch.logaddexp(p + math.log(lam), q + math.log1p(-lam))


class MixedTreeCache:
    """Beam-search state over two models at once: the target's and the draft's
    :class:`~recspec.decoding.beam_search.TreeCache` take the same beams, and each step returns the mixed
    log-probs ``[B, K, V]``."""

    def __init__(self, target: TreeCache, draft: TreeCache, lam: float) -> None:
        self.target, self.draft, self.lam = target, draft, lam

    def extend(self, beams: Beams, depth: int) -> torch.Tensor:
        return mix_log_probs(self.target.extend(beams, depth), self.draft.extend(beams, depth), self.lam)


def mixed_beam_search(target, draft, prompts: Prompts, trie: ItemTrie, k: int, lam: float) -> TopK:
    """Top-``k`` sequences per prompt (one left-padded batch) of trie-constrained beam search under
    ``(1 - lam) q + lam p``; the scores are summed log-probs of the mixture. Both models must share
    the vocabulary and have full-attention caches (tree attention)."""
    p, target_cache = prefill(target, prompts)
    q, draft_cache = prefill(draft, prompts)
    state = MixedTreeCache(TreeCache(target, prompts, k, target_cache), TreeCache(draft, prompts, k, draft_cache), lam)
    return beam_steps(mix_log_probs(p, q, lam), state, trie, k).result(trie)
