"""A draft that costs no model call, read off the target itself: the target's own next-level
distributions averaged over many users (``recspec align prior``; ``--draft PRIOR``).

Strict verification accepts a level only when the draft's top ``N`` children hold all ``K`` beams
the target keeps there. One step from the target's own features, the Beauty heads miss that at
level 2 for all but 0.5% of users at ``N = 4K``, while the target's ``p(x2 | x1)`` averaged over
other users covers it for most of them: the part of the target's
conditional that does not depend on the user is most of what decides a level past the first. This
draft is that average, for every level:

* **Fit** (:func:`fit_prior`): exact trie-constrained beam search of the target over many users
  (``K`` beams, tree attention); at every step, for every live beam at trie node ``n``, the
  target's probability of each child token of ``n`` is added to that child's entry. A child's
  weight is thus the sum, over the fitted beams that reached its parent, of the target's
  probability of it; a small uniform weight per parent (:data:`PSEUDO_COUNT`) stands for the
  nodes no fitted beam reached.
* **Draft** (:class:`TargetPriorDraft`): the draft's ``log q`` of a child token at node ``n`` is
  the log of the child's share of the weight of ``n``'s children (the mean of the target's
  renormalised conditional over the beams that reached ``n``); the same for every user. The first
  round drafts from the root, in the prompt's own target call: level 1 is few nodes (the root's
  children: 32 on MovieLens, 91 on Beauty) and the prior's top ``N`` of them nearly always hold
  the target's top ``K`` (at ``N`` = all of them, always), so the first beam step costs no call of
  its own. Later levels are ranked by the target's exact score of the round's level-0 beam plus
  ``log q`` (:class:`~recspec.decoding.drafters.TopNDrafter`).

The table is one float per trie node (``[num_nodes]``); drafting a level is two gathers and a
scatter, no model call. Strict verification keeps the output the target's, whatever it proposes.

**Its folder** (:func:`save_prior`, :func:`load_prior`): ``prior.safetensors`` (the weights),
``prior.json`` (format, the fingerprint of the target and item index it was fitted on, how it was
fitted) and checksums; loading checks all three, so a prior is never read for another target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import torch

from recspec.decoding.beam_search import TreeCache, beam_decode
from recspec.decoding.beams import Beams, select_top_k
from recspec.decoding.draft_tree import Level
from recspec.decoding.drafting import DraftSource
from recspec.decoding.frontier import Frontier
from recspec.decoding.item_prior import child_log_probs, sub_trie
from recspec.decoding.prompts import Prompts, decode_in_batches
from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, record_checksums, write_json_atomic
from recspec.itemids.trie import ItemTrie
from recspec.models.head import check_tied, read_tied_config

#: The weight a parent's children share evenly before any fitted beam adds to them: a parent no
#: fitted beam reached drafts its children uniformly, one reached by a single beam moves by at most
#: this share.
PSEUDO_COUNT = 1e-3

PRIOR_WEIGHTS = "prior.safetensors"
PRIOR_CONFIG = "prior.json"
PRIOR_FORMAT = "recspec-target-prior/1"
REMEDY = "fit it again (recspec align prior)"
#: The ``--draft`` value of the unfitted prior (:func:`uniform_prior`).
ROOT_DRAFT = "root"


def empty_weights(trie: ItemTrie) -> torch.Tensor:
    """The weights before fitting: float64 ``[num_nodes]`` on the trie's device,
    :data:`PSEUDO_COUNT` shared evenly by the children of every parent (the root's entry 0)."""
    nodes = torch.arange(1, trie.num_nodes, device=trie.device)
    parents = trie.parent(nodes)
    fanout = torch.bincount(parents, minlength=trie.num_nodes).double()
    weights = torch.zeros(trie.num_nodes, dtype=torch.float64, device=trie.device)
    weights[nodes] = PSEUDO_COUNT / fanout[parents]
    return weights


def uniform_prior(trie: ItemTrie) -> TargetPrior:
    """The prior before any fit (``--draft root``): every node's children drafted alike. What it
    gives is its first round: drafted as wide as the root's children, level 1 is all of them, fed
    in the prompt's own target call and always accepted, so the first two beam steps cost one call
    with no draft trained; later levels it drafts as the target's best beams' children."""
    return TargetPrior(empty_weights(trie).float(), trie)


def add_step(weights: torch.Tensor, trie: ItemTrie, beams: Beams, log_probs: torch.Tensor) -> None:
    """Add, in place, the target's probability of every trie child of every live beam of ``beams``
    (nodes int64 ``[B, S]``, ``-1`` dead) to the child's entry of ``weights`` (float64
    ``[num_nodes]``); ``log_probs``: the target's float32 ``[B, S, V]`` after each beam."""
    nodes = beams.nodes.reshape(-1)
    nodes = nodes[nodes >= 0]
    rows = log_probs.reshape(-1, log_probs.shape[-1])[beams.nodes.reshape(-1) >= 0]
    tokens, real, children = trie.child_edges(nodes)  # [n, C]
    children = children.view(-1)
    chances = rows.gather(1, tokens).exp().double().view(-1)
    keep = real.view(-1)
    weights.index_add_(0, children[keep], chances[keep])


def fit_prior(model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
              batch_size: int | None = 64, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The prior's weights (module doc) after the target's exact beam search of ``k`` beams over
    ``prompts`` (one 1-D int tensor per user), float64 ``[num_nodes]`` on the trie's device; added
    to ``weights`` (a fit over earlier prompts, updated in place) if given."""
    weights = empty_weights(trie) if weights is None else weights

    def recorded(beams: Beams, log_probs: torch.Tensor, space: ItemTrie, width: int) -> Beams:
        add_step(weights, space, beams, log_probs)
        return select_top_k(beams, log_probs, space, width)

    decode_in_batches(partial(beam_decode, TreeCache, select=recorded), model, prompts, trie, k, pad_token_id,
                      batch_size)
    return weights


@dataclass(frozen=True)
class TargetPrior:
    """The draft ``--draft PRIOR`` names: the fitted ``weights`` (float32 ``[num_nodes]``) and the
    trie they are read through (the target's, or a decode's sub-trie of it: :meth:`for_trie`)."""

    weights: torch.Tensor
    trie: ItemTrie
    _maps: WeakKeyDictionary[ItemTrie, torch.Tensor] = field(default_factory=WeakKeyDictionary, init=False,
                                                             repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.weights.shape != (self.trie.num_nodes,):
            raise RecspecError(f"a target prior holds one weight per trie node ({self.trie.num_nodes}), "
                               f"got shape {tuple(self.weights.shape)}")

    def for_trie(self, trie: ItemTrie) -> TargetPrior:
        """This prior over the decode's ``trie``: itself for its own trie, else the prior over
        ``trie`` read as a sub-trie of its own (:func:`~recspec.decoding.item_prior.sub_trie`: e.g.
        the catalogue less a request's excluded items), each node weighing what the node of the
        same prefix weighs here. A trie with a prefix this prior was not fitted over is refused."""
        if trie is self.trie:
            return self
        sub = sub_trie(self._maps, self.trie, trie, "the decode's item trie holds identifiers the target prior was "
                                                    "not fitted over; fit it for this target (recspec align prior)")
        return TargetPrior(self.weights[sub.nodes], sub.trie)

    def log_q(self, nodes: torch.Tensor) -> torch.Tensor:
        """``log q`` after trie ``nodes`` int64 ``[B, n]``: float32 ``[B, n, V]``."""
        return child_log_probs(self.trie, self.weights[None], nodes, torch.zeros(len(nodes), dtype=torch.int64,
                                                                               device=nodes.device))

    @cached_property
    def root_log_q(self) -> torch.Tensor:
        """``log q`` after the root, float32 ``[1, 1, V]`` (computed once: every user's first level)."""
        return self.log_q(torch.full((1, 1), self.trie.root, dtype=torch.int64, device=self.trie.device))


@dataclass
class TargetPriorDraft(DraftSource):
    """The round loop's draft source for a :class:`TargetPrior`
    (:class:`~recspec.decoding.drafting.DraftSource`): no cache, no features; the first round drafts
    from the root (``start``: the prior's level-1 distribution, the same for every user)."""

    prior: TargetPrior
    wants_features = False
    feature_layers = ()
    caches = ()

    def start(self, prompts: Prompts) -> torch.Tensor:
        """The root's ``log q``, float32 ``[B, 1, V]`` (``B`` prompts)."""
        return self.prior.root_log_q.expand(len(prompts.lengths), -1, -1)

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        return self.prior.log_q(levels[-1].nodes)


def save_prior(path: Path, weights: torch.Tensor, fingerprint: dict[str, str], info: dict[str, Any]) -> None:
    """Write the prior folder ``path`` whole (module doc) under a temporary name: ``weights``
    float ``[num_nodes]``, the ``fingerprint`` of the target it was fitted on, and ``info``."""
    from safetensors.torch import save_file

    with atomic_dir(path, overwrite=True) as tmp:
        save_file({"weights": weights.detach().float().cpu().contiguous()}, str(tmp / PRIOR_WEIGHTS))
        write_json_atomic(tmp / PRIOR_CONFIG, {"format": PRIOR_FORMAT, "fingerprint": fingerprint, **info})
        record_checksums(tmp)


def is_prior_dir(path: str | Path) -> bool:
    """Whether ``path`` is a target-prior folder."""
    return (Path(path) / PRIOR_CONFIG).is_file()


def read_prior_config(path: Path) -> dict[str, Any]:
    """The ``prior.json`` of a prior folder, its checksums checked first."""
    return read_tied_config(path, PRIOR_CONFIG, PRIOR_FORMAT, "target prior", REMEDY)


def load_prior(path: str | Path, fingerprint: dict[str, str], trie: ItemTrie) -> TargetPrior:
    """The prior saved in ``path``, checked against the ``fingerprint`` of the target it is to
    draft for (same keys as saved) and read through that target's ``trie``."""
    from safetensors.torch import load_file

    path = Path(path)
    check_tied(path, read_prior_config(path), fingerprint, "this prior was fitted",
               "fit one for this target (recspec align prior)")
    weights = load_file(str(path / PRIOR_WEIGHTS)).get("weights")
    if weights is None or not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise RecspecError(f"{path / PRIOR_WEIGHTS}: no finite, non-negative weights; {REMEDY}")
    return TargetPrior(weights.to(trie.device), trie)
