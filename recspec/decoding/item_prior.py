"""A draft that costs no model call: an item-transition prior over the catalogue, read through
the item trie (``--draft items``).

A round of speculative beam search only pays when its draft costs far less than a target call;
on a CPU, where a small target's call is cheap, even a tiny draft model eats most of the gain.
This draft is a table, not a model. It is accepted more than the trained drafts, but only at
wide levels, whose nodes a call pays for, so on small CPU targets ``auto`` keeps ``tree-beam``
(docs/drafts.md gives the measurements). It is built for targets whose calls are dear and nodes
cheap. How it drafts:

* **Fit** (:meth:`TransitionPrior.fit`): from the training part of the data, how often item ``j``
  directly follows item ``i`` in a user's sequence, each row normalised to ``P(j | i)``, and the
  items' popularity ``P(j)``.
* **A user's item weights** (:meth:`TransitionPrior.scores`): ``P(j | i)`` summed over the user's
  history, the latest item weighted 1 and each earlier one ``decay`` times the next, normalised,
  then mixed with popularity (``smoothing``) so that every item has weight.
* **Per trie node** (:func:`node_mass`): an identifier prefix weighs what the items under it weigh,
  and the draft's ``log q`` of a child token at a node is the log of the child's share of the node's
  weight. So the draft's level distributions are the exact marginals of one item distribution.

The user's history is read from the prompt itself (:func:`prompt_histories`: its identifier
tokens, ``L`` per item, in order), so the draft needs nothing a decoder does not already have.
Strict verification keeps the output the target's whatever the draft proposes; the draft only
decides how often a round's levels are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import numpy as np
import torch

from recspec.decoding.draft_tree import Level
from recspec.decoding.drafting import DraftSource
from recspec.decoding.frontier import Frontier
from recspec.decoding.prompts import Prompts
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie


#: The ``--draft`` value that names the item prior instead of a folder (a folder of that name is
#: given by its absolute path).
ITEM_DRAFT = "items"


#: The defaults of :class:`TransitionPrior`: the most accepted levels per user of those tried on
#: Beauty's validation users against its ``target-mini`` (K = 10, N = 40).
DECAY = 0.8
SMOOTHING = 0.5


@dataclass(frozen=True)
class TransitionPrior:
    """The transition table in rows by previous item (CSR): the items that followed item ``i``
    are ``successors[starts[i]:starts[i + 1]]`` (int64), at ``chances[...]`` (float32,
    ``P(next | i)``, summing to 1 over a row); ``popular``: float32 ``[I]``, the items' training
    frequency, summing to 1; ``decay``: the weight of a history item relative to the one after
    it; ``smoothing``: the share of popularity in a user's weights."""

    starts: torch.Tensor
    successors: torch.Tensor
    chances: torch.Tensor
    popular: torch.Tensor
    decay: float = DECAY
    smoothing: float = SMOOTHING

    @classmethod
    def fit(cls, sequences: Sequence[np.ndarray], num_items: int, decay: float = DECAY,
            smoothing: float = SMOOTHING) -> TransitionPrior:
        """Count direct successions in ``sequences`` (int item indices in time order, one array per
        user) over ``num_items`` items."""
        if not 0 < decay <= 1 or not 0 < smoothing <= 1:
            raise RecspecError(f"decay and smoothing must lie in (0, 1], got {decay} and {smoothing}")
        arrays = [np.asarray(seq, dtype=np.int64) for seq in sequences]
        items = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        if len(items) == 0:
            raise RecspecError("the item prior needs training interactions, and the training part is empty")
        if items.min() < 0 or items.max() >= num_items:
            raise RecspecError(f"item indices must lie in [0, {num_items})")
        previous = np.concatenate([seq[:-1] for seq in arrays])
        following = np.concatenate([seq[1:] for seq in arrays])
        pairs, counts = np.unique(previous * num_items + following, return_counts=True)  # sorted by previous
        rows, successors = np.divmod(pairs, num_items)
        chances = counts / np.bincount(previous, minlength=num_items)[rows]
        starts = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=num_items))))
        popular = np.bincount(items, minlength=num_items) / len(items)
        return cls(torch.from_numpy(starts), torch.from_numpy(successors), torch.from_numpy(chances).float(),
                   torch.from_numpy(popular).float(), decay, smoothing)

    def scores(self, histories: torch.Tensor) -> torch.Tensor:
        """Item weights of each user: float32 ``[B, I]``, summing to 1 per row (0 only for an item
        that neither follows the history nor occurs in training).
        ``histories``: int64 ``[B, H]``, item indices oldest first, ``-1`` for none (padding, or an
        item the prior does not know), right-aligned or not. Reads only the history items' rows."""
        batch, width = histories.shape
        known = histories >= 0
        # the latest known item weighs 1, the one before it decay, ...
        later = known.flip(1).long().cumsum(1).flip(1) - known.long()  # known items after each position
        weights = torch.where(known, torch.tensor(self.decay).pow(later.float()), 0.0).view(-1)
        first = self.starts[histories.clamp(min=0)].view(-1)
        counts = torch.where(known.view(-1), self.starts[histories.clamp(min=0) + 1].view(-1) - first, 0)
        owner = torch.repeat_interleave(torch.arange(batch * width), counts)  # the history slot of each edge
        edges = first[owner] + torch.arange(len(owner)) - (counts.cumsum(0) - counts)[owner]
        spread = torch.zeros(batch * self.popular.shape[0])
        spread.index_add_(0, owner // width * self.popular.shape[0] + self.successors[edges],
                          weights[owner] * self.chances[edges])
        spread = spread.view(batch, -1)
        total = spread.sum(dim=1, keepdim=True)
        spread = torch.where(total > 0, spread / total.clamp(min=1e-30), self.popular)
        return (1 - self.smoothing) * spread + self.smoothing * self.popular


@dataclass(frozen=True)
class SubTrie:
    """A decode's trie read as a sub-trie of a prior's (the same identifiers, maybe fewer items: the
    catalogue less a request's excluded items): ``trie``, on the prior's device, and ``nodes``, int64
    ``[trie.num_nodes]``: the prior trie's node with the prefix of each of ``trie``'s nodes, through
    which the prior's per-node tables are read (:func:`sub_trie`)."""

    trie: ItemTrie
    nodes: torch.Tensor


def sub_trie(maps: WeakKeyDictionary[ItemTrie, torch.Tensor], prior_trie: ItemTrie, decode: ItemTrie,
             refusal: str) -> SubTrie:
    """The decode's trie ``decode`` read as a sub-trie of ``prior_trie``, the trie a prior was built
    over. Its node map is computed once per trie object and kept in ``maps`` while that trie lives
    (the service reuses the tries of its exclusion sets; weak keys let them go). A trie that is not
    a sub-trie (another vocabulary or depth, or a prefix ``prior_trie`` lacks) is refused with the
    one-line ``refusal``."""
    nodes = maps.get(decode)
    if nodes is None:
        nodes = prior_trie.prefix_nodes(decode)
        if (decode.vocab_size, decode.depth) != (prior_trie.vocab_size, prior_trie.depth) or bool((nodes < 0).any()):
            raise RecspecError(refusal)
        maps[decode] = nodes
    return SubTrie(decode if decode.device == prior_trie.device else decode.to(prior_trie.device), nodes)


def identifier_tokens(trie: ItemTrie) -> torch.Tensor:
    """Bool ``[V]`` on the trie's device: True for every token of some item's identifier."""
    nodes = torch.arange(1, trie.num_nodes, device=trie.device)
    table = torch.zeros(trie.vocab_size, dtype=torch.bool, device=trie.device)
    return table.index_fill_(0, trie.last_token(nodes), True)


def prompt_histories(prompts: Prompts, trie: ItemTrie) -> torch.Tensor:
    """The items a prompt lists: int64 ``[B, H]`` (``H`` the most in a row), oldest first,
    right-aligned after ``-1``. Reads each row's identifier tokens in order, ``L`` per item
    (recspec's prompts hold nothing else of the trie's tokens); a row holding a partial
    identifier is a :class:`RecspecError`."""
    ids = prompts.input_ids.to(trie.device)
    marked = identifier_tokens(trie)[ids] & prompts.attention_mask.to(trie.device).bool()
    counts = marked.sum(dim=1)
    if bool((counts % trie.depth != 0).any()):
        raise RecspecError(f"a prompt holds identifier tokens that are not whole {trie.depth}-token identifiers; "
                           f"the item prior reads the history from recspec's own prompts")
    width = int(counts.max()) if len(counts) else 0
    # identifier tokens to the right of each row, in order (a stable sort on "not marked")
    order = torch.sort(marked.to(torch.int8), dim=1, stable=True).indices[:, ids.shape[1] - width:]
    tokens = ids.gather(1, order)
    present = torch.arange(width, device=ids.device) >= width - counts[:, None]
    leaves = trie.walk(tokens.masked_fill(~present, 0).view(-1, trie.depth))
    items = trie.items(leaves).view(len(ids), width // trie.depth)
    return items.masked_fill(~present[:, trie.depth - 1::trie.depth], -1)


def node_mass(trie: ItemTrie, scores: torch.Tensor) -> torch.Tensor:
    """What each trie node's items weigh: float32 ``[B, num_nodes]`` from item weights ``scores``
    ``[B, I]`` (the root holds the row's total). One pass per depth, leaves up."""
    nodes = torch.arange(trie.num_nodes, device=scores.device)
    items = trie.items(nodes)
    mass = torch.zeros(scores.shape[0], trie.num_nodes, device=scores.device)
    leaves = items >= 0
    mass[:, nodes[leaves]] = scores[:, items[leaves]]
    depth = trie.node_depth(nodes)
    parents = trie.parent(nodes)
    for d in range(trie.depth, 0, -1):
        at = nodes[depth == d]
        mass.index_add_(1, parents[at], mass[:, at])
    return mass


def child_log_probs(trie: ItemTrie, mass: torch.Tensor, nodes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The draft's ``log q`` at trie ``nodes`` int64 ``[B, n]`` (``-1``: dead): float32
    ``[B, n, V]``, each child token's log share of its node's weight in row ``rows[b]`` (int64
    ``[B]``) of ``mass`` ``[U, num_nodes]``, the lowest float elsewhere (never read: drafters rank
    trie children only)."""
    batch, width = nodes.shape
    flat = nodes.reshape(-1)
    tokens, real, children = trie.child_edges(flat)  # [B * n, C]
    fanout = tokens.shape[1]
    children = children.view(batch, width * fanout).clamp(max=trie.num_nodes - 1)  # padding: any node
    weight = mass[rows[:, None], children].masked_fill_(~real.view(batch, -1), 0)
    weight = weight.view(batch * width, fanout)
    share = weight / weight.sum(dim=1, keepdim=True).clamp(min=1e-30)
    lowest = torch.finfo(torch.float32).min
    log_q = torch.full((batch * width, trie.vocab_size), lowest, device=mass.device)
    log_q.scatter_(1, tokens, torch.where(real, share.clamp(min=1e-30).log(), lowest))
    return log_q.view(batch, width, -1)


@dataclass(frozen=True)
class ItemDraft:
    """The draft ``--draft items`` names: a :class:`TransitionPrior` and the item trie it is read
    through (the target's: the users' histories and the items' weights per node); ``sub``: the
    decode's trie when that is another (:meth:`for_trie`), the one it drafts over."""

    prior: TransitionPrior
    trie: ItemTrie
    sub: SubTrie | None = None
    _maps: WeakKeyDictionary[ItemTrie, torch.Tensor] = field(default_factory=WeakKeyDictionary, init=False,
                                                             repr=False, compare=False)

    def for_trie(self, trie: ItemTrie) -> ItemDraft:
        """This draft over the decode's ``trie``: itself for its own trie, else drafting over
        ``trie`` read as a sub-trie of its own (:func:`sub_trie`: e.g. the catalogue less a
        request's excluded items). Refuses another item index (or a prior over fewer items than
        the trie)."""
        refusal = ("the item draft was built for another item index than the decode's; build it from the same "
                   "recommender (Recommender.item_draft)")
        if self.trie.num_items > self.prior.popular.shape[0]:
            raise RecspecError(refusal)
        return self if trie is self.space else ItemDraft(self.prior, self.trie,
                                                         sub_trie(self._maps, self.trie, trie, refusal))

    @property
    def space(self) -> ItemTrie:
        """The trie it drafts over: the decode's."""
        return self.trie if self.sub is None else self.sub.trie

    def space_mass(self, scores: torch.Tensor) -> torch.Tensor:
        """What each node of :attr:`space` weighs: float32 ``[B, space.num_nodes]`` from item
        weights ``scores`` ``[B, I]``; over a sub-trie, what the same prefix weighs in the full
        trie (excluded items included: the draft only ranks a node's children)."""
        mass = node_mass(self.trie, scores)
        return mass if self.sub is None else mass[:, self.sub.nodes]


@dataclass
class ItemPriorDraft(DraftSource):
    """The round loop's draft source for an :class:`ItemDraft`
    (:class:`~recspec.decoding.drafting.DraftSource`): no cache, no features; the item weights of
    the batch's users are computed once, from their prompts, at :meth:`start`."""

    draft: ItemDraft
    mass: torch.Tensor = field(init=False)
    wants_features = False
    feature_layers = ()
    caches = ()

    def start(self, prompts: Prompts) -> torch.Tensor:
        draft = self.draft
        scores = draft.prior.scores(prompt_histories(prompts, draft.trie).cpu()).to(draft.trie.device)
        self.mass = draft.space_mass(scores)
        root = torch.full((len(scores), 1), draft.space.root, dtype=torch.int64, device=draft.trie.device)
        return child_log_probs(draft.space, self.mass, root, torch.arange(len(scores), device=draft.trie.device))

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        return child_log_probs(self.draft.space, self.mass, levels[-1].nodes, front.users)
