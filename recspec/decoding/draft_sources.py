"""What gives a round's drafter its log-probabilities: a draft model with a KV cache of its own
(:class:`ModelDraft`), or a feature-level head over the target's hidden states
(:class:`FeatureDraft`, :mod:`recspec.models.head`). The search over item beams
(:class:`~recspec.decoding.rounds.ItemSearch`) talks to either through the same calls
(:class:`~recspec.decoding.drafting.DraftSource`; ``feed_last`` and ``learn`` default to nothing):

* ``start(prompts)``: before the first round; the draft's log-probs at the root ``[B, 1, V]``,
  or None when the first round drafts nothing (a head: level 1 then comes exactly from the
  target's prefill, and the head drafts from the target's feature there on);
* ``log_probs(levels, front)``: the draft's log-probs ``[B, n, V]`` at the nodes of
  ``levels[-1]``, the round's newest level (``levels[0]`` is the round's level 0);
* ``feed_last(levels)``: the round's last level, so that a draft cache holds what the target's will;
* ``learn(levels, features, prompts, front, beams, parent_at)``: after the target's call and its
  verification, its features at every position it was fed ``[B, F, H]`` (the prompt's too in the
  first round, ``prompts`` given) with the round's ``front`` and the new ``beams``, whose parents are
  the fed nodes ``parent_at`` (int64 ``[B, K]``); returns what each new beam carries into the next
  round (:attr:`Frontier.draft_state`, ``[B, K, D]``); called only if ``wants_features``;
* ``caches``: the KV caches to keep in step with the target's (compacted by the same gather).

:class:`ModelHeadDraft` combines the two: the draft model drafts the first round (in the same target
call as the prompt), the head every later one. :class:`TextTreeDraft` is a text head
(:mod:`recspec.models.text_head`) drafting tree levels over free text (DSBD), with a KV cache of its
own laid out as the target's.

``wants_features`` says whether the target's scoring call must also return its features (a
feature head then carries, per beam, the target's feature at its parent: :attr:`Frontier.draft_state`).

**A text head's tree cache** (:class:`TextTreeDraft`). Column ``c`` of the target's cache holds
token ``x_c`` at position ``t + 1``; the same column of the head's cache holds the head's input
``(f_t, x_c)`` at position ``t``, where ``f_t`` is the target's feature at ``c``'s parent (the
column before it in the prompt, the parent node in a tree): the input that guesses the feature at
``c`` (EAGLE's pairing, indexed by the child so that a tree, where a node has several children,
maps column for column). The first real prompt token has no parent: its column holds a
placeholder that no input ever sees (after the first compaction it is column 0). While drafting,
deeper levels take the head's own guesses at their parents, and those inputs live for the round
only. Once the target has scored and verified the round, :meth:`TextTreeDraft.learn` makes one
head call over every node the target was fed past level 0, with the target's true features at
their parents, in the target's column order (the head's cache again holds only true features, and
the round loop compacts and narrows it with the target's), and over each new beam's input (the
target's feature at the beam's parent, its pending token): that is the next round's level 0,
computed ahead. Its guess, key and value ride with the beam (:attr:`Frontier.draft_state`, through
the round loop's narrowing and reordering), so the next round drafts level 1 straight from them and
its re-read starts at level 1: two head calls a round at two drafted levels instead of three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from transformers import DynamicCache

from recspec.decoding.beams import Beams
from recspec.decoding.draft_tree import Level, fed_block, feed
from recspec.decoding.drafting import DraftSource
from recspec.decoding.frontier import Frontier
from recspec.decoding.item_prior import ItemDraft, ItemPriorDraft
from recspec.decoding.prompts import Prompts
from recspec.decoding.scorer import prefill
from recspec.decoding.target_prior import TargetPrior, TargetPriorDraft
from recspec.decoding.tree import gather_rows
from recspec.models.head import HeadDraft
from recspec.models.text_head import TextHeadDraft


@dataclass
class ModelDraft(DraftSource):
    """A draft causal LM over the target's vocabulary; its cache mirrors the target's."""

    model: object
    cache: object = None
    wants_features = False
    feature_layers = ()

    def start(self, prompts: Prompts) -> torch.Tensor:
        log_q, self.cache = prefill(self.model, prompts)
        return log_q

    @property
    def caches(self) -> tuple:
        return (self.cache,)

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        return feed(self.model, self.cache, levels[-1:])

    def feed_last(self, levels: list[Level]) -> None:
        feed(self.model, self.cache, levels[-1:])


@dataclass
class FeatureDraft(DraftSource):
    """A draft head (:class:`~recspec.models.head.HeadDraft`): level 0's nodes take the target's
    feature at their parent (``front.draft_state``), deeper levels the head's own guess at theirs.
    A head that attends also reads the target's features at the prompt's tokens, kept from the
    first round by batch row (``context``: ``[B, P, H]`` and the prompts' mask ``[B, P]``) and
    picked by :attr:`Frontier.users`, so the users that finish early need no narrowing here."""

    head: HeadDraft
    guessed: list[torch.Tensor] = field(default_factory=list)  # this round's features, per level
    context: tuple[torch.Tensor, torch.Tensor] | None = None
    wants_features = True
    feature_layers = ()
    caches = ()

    def start(self, prompts: Prompts) -> None:
        return None

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        level, j = levels[-1], len(levels) - 1
        parent = parent_features(levels, front, self.guessed)
        depth = (front.depth - 1 + j)[:, None].expand_as(level.tokens)  # 0-based level of the nodes' tokens
        context = None if self.context is None else tuple(part[front.users] for part in self.context)
        feature = self.head.features(parent.to(self.head.device), level.tokens, depth, context)
        self.guessed = [*self.guessed[:j], feature]
        return self.head.log_probs(feature)

    def learn(self, levels: list[Level], features: torch.Tensor, prompts: Prompts | None, front: Frontier,
               beams: Beams, parent_at: torch.Tensor) -> torch.Tensor:
        if prompts is not None and self.head.attends:  # the first round: the prompt's columns come first
            self.context = (features[:, :prompts.input_ids.shape[1]], prompts.attention_mask.bool())
        return gather_rows(node_features(features, levels), parent_at)  # the target's at the new beams' parents


@dataclass
class ModelHeadDraft(DraftSource):
    """A draft model for the first round, a head for the rest: the first round keeps the prompt
    and every drafted level in one target call (the head has no target feature to start from
    yet), and from then on the head drafts from the features that call returned. The model's
    cache serves the first round only and is then dropped (never compacted)."""

    model: ModelDraft
    head: FeatureDraft
    wants_features = True
    feature_layers = ()
    caches = ()

    def start(self, prompts: Prompts) -> torch.Tensor:
        return self.model.start(prompts)

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        if front.draft_state is None:  # the first round
            return self.model.log_probs(levels, front)
        self.model.cache = None
        return self.head.log_probs(levels, front)

    def learn(self, levels: list[Level], features: torch.Tensor, prompts: Prompts | None, front: Frontier,
               beams: Beams, parent_at: torch.Tensor) -> torch.Tensor:
        return self.head.learn(levels, features, prompts, front, beams, parent_at)


@dataclass
class TextTreeDraft(DraftSource):
    """A text head drafting tree levels over free text (see the module doc): ``cache`` (one layer,
    laid out as the target's), and this round's drafted inputs' keys and values and guesses."""

    head: TextHeadDraft
    cache: DynamicCache = field(init=False)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    guessed: list[torch.Tensor] = field(default_factory=list)
    wants_features = True

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.fused_layers

    @property
    def caches(self) -> tuple:
        return (self.cache,)

    def start(self, prompts: Prompts) -> None:
        config, batch = self.head.head.config, len(prompts.lengths)
        empty = torch.zeros(batch, config.kv_heads, 0, config.head_dim, device=prompts.input_ids.device)
        self.cache = DynamicCache(ddp_cache_data=[(empty, empty.clone())])
        return None

    def log_probs(self, levels: list[Level], front: Frontier) -> torch.Tensor:
        if len(levels) == 1:  # a new round: level 0's inputs were computed ahead, by the last learn()
            guessed, keys, values = self.unpacked(front)
            self.keys, self.values, self.guessed = [keys], [values], [guessed]
            return self.head.vocabulary_log_probs(guessed)
        level = levels[-1]
        parent = parent_features(levels, front, self.guessed)
        layer = self.cache.layers[0]
        past = (torch.cat((layer.keys, *self.keys), dim=2), torch.cat((layer.values, *self.values), dim=2))
        guessed, keys, values = self.head.step(parent, level.tokens, level.positions - 1,
                                               placeholder_hidden(level.visible, placeholder_column(front),
                                                                  past[0].shape[2]), past)
        self.keys.append(keys)
        self.values.append(values)
        self.guessed.append(guessed)
        return self.head.vocabulary_log_probs(guessed)

    def learn(self, levels: list[Level], features: torch.Tensor, prompts: Prompts | None, front: Frontier,
               beams: Beams, parent_at: torch.Tensor) -> torch.Tensor:
        """One head call (see the module doc): append to the cache the head's inputs of every column
        the target was just fed past level 0 (in the first round: the prompt's), with the target's
        true features at their parents, and compute each new beam's input (the target's feature at
        its parent node ``parent_at``, its pending token: the last of ``beams.tokens``). Returns
        those inputs' guesses, keys and values packed per beam, ``[B, K, H + 2 kv d]``."""
        features = self.head.read(features)
        tokens, visible, positions, _ = fed_block(levels, prompts)
        nodes = node_features(features, levels)
        layer = self.cache.layers[0]
        if prompts is None:  # level 0's inputs were computed ahead: its keys and values join the past
            _, keys, values = self.unpacked(front)
            skip, past = levels[0].width, (torch.cat((layer.keys, keys), dim=2), torch.cat((layer.values, values),
                                                                                           dim=2))
            parents, first = [], placeholder_column(front)
        else:  # the first round: every prompt column's parent is the column before it
            prompt_len = prompts.input_ids.shape[1]
            skip, past = 0, (layer.keys, layer.values)
            parents = [torch.cat((torch.zeros_like(features[:, :1]), features[:, :prompt_len - 1]), dim=1)]
            first = prompt_len - prompts.lengths
        own = torch.split(nodes, [level.width for level in levels], dim=1)  # the features at each level's nodes
        for j in range(1, len(levels)):
            parents.append(gather_rows(own[j - 1], levels[j].parents.clamp(min=0)))
        parents.append(gather_rows(nodes, parent_at))
        count, fed = parent_at.shape[1], tokens.shape[1] - skip
        # the new beams' inputs see what their parents saw, and themselves
        ahead = torch.cat((gather_rows(visible[:, -nodes.shape[1]:], parent_at),
                           torch.eye(count, dtype=torch.bool, device=visible.device).expand(len(visible), -1, -1)),
                          dim=2)
        seen = torch.cat((torch.nn.functional.pad(visible[:, skip:], (0, count)), ahead), dim=1)
        guessed, keys, values = self.head.step(
            torch.cat(parents, dim=1), torch.cat((tokens[:, skip:], beams.tokens[:, :, -1]), dim=1),
            torch.cat(((positions[:, skip:] - 1).clamp(min=0), gather_rows(positions[:, -nodes.shape[1]:], parent_at)),
                      dim=1),
            placeholder_hidden(seen, first, past[0].shape[2]), past)
        layer.keys, layer.values = torch.cat((past[0], keys[:, :, :fed]), dim=2), torch.cat((past[1], values[:, :, :fed]),
                                                                                          dim=2)
        return torch.cat((guessed[:, fed:], keys[:, :, fed:].transpose(1, 2).flatten(2),
                          values[:, :, fed:].transpose(1, 2).flatten(2)), dim=2)

    def unpacked(self, front: Frontier) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs of ``front``'s pending beams computed ahead by :meth:`learn`: guesses ``[B, K,
        H]``, keys and values ``[B, kv, K, d]``."""
        state, config = front.draft_state, self.head.head.config
        if state is None:
            raise RuntimeError("a head drafts from the target's features: the first round must draft nothing")
        width = config.kv_heads * config.head_dim
        guessed, keys, values = state.split((state.shape[2] - 2 * width, width, width), dim=2)
        shape = (*state.shape[:2], config.kv_heads, config.head_dim)
        return guessed, keys.reshape(shape).transpose(1, 2), values.reshape(shape).transpose(1, 2)


def node_features(features: torch.Tensor, levels: list[Level]) -> torch.Tensor:
    """The target's features at the round's nodes, level 0 first, ``[B, M, H]``: ``features``
    ``[B, F, H]`` at every position fed (in the first round the prompt's before them)."""
    return features[:, -sum(level.width for level in levels):]


def parent_features(levels: list[Level], front: Frontier, guessed: list[torch.Tensor]) -> torch.Tensor:
    """The features a head's inputs at the round's newest level take, ``[B, n, H]``: the target's
    at the beams' parents on level 0 (:attr:`Frontier.draft_state`), the head's own guesses at the
    nodes' parents (``guessed``: per earlier level of the round, ``[B, n_j, H]``) deeper."""
    j = len(levels) - 1
    if j == 0:
        if front.draft_state is None:
            raise RuntimeError("a head drafts from the target's features: the first round must draft nothing")
        return front.draft_state
    return gather_rows(guessed[j - 1], levels[j].parents)


def placeholder_column(front: Frontier) -> torch.Tensor:
    """int64 ``[B]``: the cache column of each user's first prompt token (whose head input is a
    placeholder), the first column any of its beams sees: 0 once the caches were compacted, the
    prompt's left padding before (:func:`~recspec.decoding.frontier.settle_frontier`)."""
    return front.visible.any(dim=1).int().argmax(dim=1)


def placeholder_hidden(visible: torch.Tensor, first: torch.Tensor, start: int) -> torch.Tensor:
    """A target's visibility as a text head's: ``visible`` bool ``[B, n, W]`` of the inputs at
    columns ``start .. start + n - 1`` with column ``first[b]`` (int64 ``[B]``: the first prompt
    token, whose head input is a placeholder) hidden from every input but its own."""
    columns = torch.arange(visible.shape[2], device=visible.device)
    own = start + torch.arange(visible.shape[1], device=visible.device)
    hidden = (columns[None, None, :] == first[:, None, None]) & (columns[None, None, :] != own[None, :, None])
    return visible & ~hidden


@dataclass(frozen=True)
class ModelHeadPair:
    """A draft model and a head of the same target, drafted with as :class:`ModelHeadDraft`."""

    model: object
    head: HeadDraft


def draft_source(draft) -> ModelDraft | FeatureDraft | ModelHeadDraft | TextTreeDraft | ItemPriorDraft | TargetPriorDraft:
    """The source for ``draft``: a :class:`~recspec.models.head.HeadDraft`, a :class:`ModelHeadPair`,
    a :class:`~recspec.models.text_head.TextHeadDraft`, an
    :class:`~recspec.decoding.item_prior.ItemDraft`, a
    :class:`~recspec.decoding.target_prior.TargetPrior` or a causal LM."""
    if isinstance(draft, ItemDraft):
        return ItemPriorDraft(draft)
    if isinstance(draft, TargetPrior):
        return TargetPriorDraft(draft)
    if isinstance(draft, ModelHeadPair):
        return ModelHeadDraft(ModelDraft(draft.model), FeatureDraft(draft.head))
    if isinstance(draft, TextHeadDraft):
        return TextTreeDraft(draft)
    return FeatureDraft(draft) if isinstance(draft, HeadDraft) else ModelDraft(draft)
