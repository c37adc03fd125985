"""Drafting text with a feature-level head (:mod:`recspec.models.text_head`): EAGLE-2's dynamic
draft trees for the text round loop (:mod:`recspec.decoding.text_rounds`).

A request's :class:`HeadSession` keeps the head's KV cache over the inputs ``(f_t, x_{t+1})`` whose
features are the target's own: the prompt's and every accepted token's, never a draft's. After
each target call the decoder hands it the target's features at the positions it kept
(:meth:`HeadSession.observe`: the prompt after the prefill, then each step's root and accepted
path); the next :meth:`HeadSession.propose` feeds them, each with the token that follows it in the
text (the last one the target's own token after the accepted path), in one head call that extends
the cache, and the last output, the guessed feature after the text, drafts the tree:

* level 1: the ``width`` most probable draft tokens after the text;
* every further level, up to ``depth``: the ``width`` nodes of the newest level with the highest
  cumulative draft probability (the product of ``q`` along the path) are fed to the head in one
  call (their parent's guessed feature and their own token, at their text positions, attending to
  the cache and to their ancestors in the tree, whose keys and values live for the round only),
  and each gets its ``width`` most probable children;
* the tree proposed is the ``nodes`` nodes of all levels with the highest cumulative probability
  (EAGLE-2's reranking), best first. A node is never more probable than its parent and ties keep
  the parent first, so the selection is a tree whose parents precede their children.

A round costs at most ``depth`` head calls: the first over the newly accepted inputs, the others
over at most ``width`` nodes each. Drafts only choose what the target verifies, so with greedy
verification the text is the greedy decoding's whatever the head's quality.

**Node budget from the cost model.** With a round's cost ``C(n) = F + r (n + 1)`` (the target's
call over the root and ``n`` nodes, ``F`` including the head's drafting, :func:`round_cost`) and
the draft's path probabilities ``c_1 >= c_2 >= ...`` of the ranked candidates taken as their
acceptance probabilities (EAGLE-2's premise: a node is accepted only with its whole path, and the
head's confidence tracks the acceptance rate), a round emits ``1 + sum_{i <= n} c_i`` tokens in
expectation, so :func:`node_budget` keeps the ``n <= nodes`` best candidates that maximise
``(1 + sum_{i <= n} c_i) / C(n)``: per round, from that round's own confidences. A prefix of the
ranking is still a tree (parents rank before their children). **Free nodes**: where the target
computes a call over more rows than it is fed (:attr:`~recspec.decoding.cost.CallCost.padded`, as
accel says: :class:`~recspec.accel.CallShape`), a budget is filled with the next-ranked candidates
up to the rows that call computes anyway (:meth:`~recspec.decoding.cost.CallCost.free_tokens`):
more expected tokens at the same cost (still a prefix of the ranking).

**Pruning.** A node never scores above its ancestors, so once a node's score is at or below
:func:`expansion_floor` none of its descendants can be kept: the ``nodes``-th best score drafted
so far, and with a cost model the least path probability a kept node can have (every node the
budget keeps past the first, which is on level 1 and never pruned, has ``c >= r * R*``, ``R*``
the best expected rate, and ``R*`` is at least the best rate of the candidates drafted so far).
Such nodes are not expanded and a level with none left ends the tree: the same tree as full
growth, with fewer and smaller head calls; free nodes come from the candidates drafted, which
under pruning may lack a low-ranked one full growth would have drafted (the budgeted nodes are
the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from recspec.calibration import call_cost
from recspec.decoding.cost import CallCost, median_seconds
from recspec.decoding.text_rounds import DraftTree, TextSession
from recspec.errors import RecspecError
from recspec.knowledge.decode import DraftSession, RetrievalDrafter
from recspec.models.text_head import TextHeadDraft


#: Text tokens before a round that a head's cost-sized trees are costed at (a knowledge prompt of
#: ~360 tokens and part of its text; a call's cost hardly depends on it at these lengths).
COST_CONTEXT = 384


@dataclass(frozen=True)
class HeadTreeConfig:
    """A head's draft tree: ``width`` children per expanded node and nodes expanded per level,
    ``depth`` levels at most, ``nodes`` nodes proposed at most (15, with the root a call of 16
    rows: the shape measured best on this project's CPU); ``sized``: under
    greedy or sampling verification (where the tree cannot change the text, for a given seed) each
    round verifies only the :func:`node_budget` best of them and its free nodes, from the measured
    cost model (relaxed verification always verifies ``nodes``: its text depends on the tree, which
    must not depend on the machine); ``prune``: expand only nodes whose descendants can be kept
    (module doc; ``False`` grows the same tree at full cost, to measure what pruning saves);
    ``gate``: in hybrid drafting, the head drafts only in rounds whose retrieved tree is less than
    ``gate`` tokens deep (None: every round; 2, the default: level with or above retrieval alone,
    where drafting every round falls below it)."""

    width: int = 4
    depth: int = 5
    nodes: int = 15
    sized: bool = True
    prune: bool = True
    gate: int | None = 2

    def shape(self) -> dict[str, int]:
        """What a relaxed store records: the tree's shape and the hybrid's gate (absent: every round)."""
        shape = {"width": self.width, "depth": self.depth, "nodes": self.nodes}
        return shape if self.gate is None else {**shape, "gate": self.gate}

    def __post_init__(self) -> None:
        if min(self.width, self.depth, self.nodes) < 1:
            raise RecspecError(f"a head's draft tree needs width, depth and nodes >= 1, got {self}")
        if self.gate is not None and self.gate < 1:
            raise RecspecError(f"a hybrid's gate is a retrieved depth of at least 1 token, got {self.gate}")


class HeadDrafter:
    """Drafts with a bound text head (``head``) in trees shaped by ``config``; with ``cost`` (a
    round's cost by verified nodes, :func:`round_cost`) each tree keeps the :func:`node_budget`
    best of its ``config.nodes`` candidates."""

    def __init__(self, head: TextHeadDraft, config: HeadTreeConfig = HeadTreeConfig(),
                 cost: CallCost | None = None) -> None:
        if config.width > len(head.ids):
            raise RecspecError(f"a draft tree {config.width} wide needs at least {config.width} draft tokens; the head "
                               f"has {len(head.ids)}")
        self.head, self.config, self.cost = head, config, cost

    def session(self, prompt: Sequence[int]) -> HeadSession:
        return HeadSession(self.head, self.config, self.cost)

    @torch.inference_mode()
    def round_seconds(self, context: int, repeats: int = 10) -> float:
        """Median seconds of the head's part of one round after a text of ``context`` tokens: reading
        two accepted inputs, then growing a full tree, every level expanded (random features and
        tokens: the cost does not depend on them; pruning makes real rounds cheaper, so the cost
        model errs towards larger trees)."""
        head, device = self.head, self.head.ids.device
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(context + 2, head.head.config.input_width, generator=generator).to(device)
        text = head.ids[torch.randint(0, len(head.ids), (context + 3,), generator=generator).to(device)].tolist()
        session = HeadSession(head, replace(self.config, prune=False))
        session.observe(features[:context], 0)
        guessed = session.read(text[:context + 1])
        cache, length = session.cache, session.length

        def one_round() -> None:
            session.observe(features[context:], context)
            session.grow(session.read(text), self.config.depth)
            session.cache, session.length = cache, length

        return median_seconds(one_round, guessed.device, repeats)


def round_cost(target: CallCost, head_s: float) -> CallCost:
    """A head round's cost by verified nodes: the target's call (fed the root and the nodes; padded
    as the target's) and the head's drafting (``head_s`` seconds, :meth:`HeadDrafter.round_seconds`)
    folded into the fixed part."""
    return CallCost(target.fixed_s + head_s, target.per_token_s, padded=target.padded)


def sized_round_cost(model, model_dir: str | Path, head: TextHeadDraft, tree: HeadTreeConfig) -> CallCost:
    """The cost model of ``head``'s rounds in ``tree``s for ``model`` (loaded from ``model_dir``):
    :func:`round_cost` of the model's call cost (kept beside it by
    :func:`~recspec.calibration.call_cost`) and the head's drafting (timed now), at
    :data:`COST_CONTEXT` tokens."""
    target = call_cost(model, model_dir, COST_CONTEXT)
    return round_cost(target, HeadDrafter(head, tree).round_seconds(COST_CONTEXT))


def expected_rates(log_scores: torch.Tensor, cost: CallCost) -> torch.Tensor:
    """Expected tokens per second of a round verifying the first ``n`` ranked candidates, for ``n``
    in ``1 .. T``: ``log_scores`` float ``[T]`` (their cumulative draft log-probabilities, best
    first); float64 ``[T]``, ``(1 + sum_{i <= n} exp(log_scores_i)) / cost.call_s(n + 1)``."""
    count = torch.arange(1, len(log_scores) + 1, dtype=torch.float64, device=log_scores.device)
    emitted = 1 + log_scores.double().exp().cumsum(0)
    return emitted / (cost.fixed_s + cost.per_token_s * (count + 1))


def node_budget(log_scores: torch.Tensor, cost: CallCost) -> int:
    """How many of the ranked candidates to verify: ``log_scores`` float ``[T]`` (best first,
    ``T >= 1``); the ``n`` in ``1 .. T`` with the highest :func:`expected_rates` (module doc)."""
    return int(torch.argmax(expected_rates(log_scores, cost))) + 1


def expansion_floor(collected: torch.Tensor, nodes: int, cost: CallCost | None) -> float:
    """The cumulative log-score at or below which no descendant of a node can be in the tree that
    :func:`select` keeps (``nodes``, ``cost``) from any candidates that include ``collected``
    (float ``[T]``, ``T >= 1``: the scores drafted so far). Descendants score at most their
    ancestor (module doc: *pruning*)."""
    ranked = collected.topk(min(nodes, len(collected))).values
    floor = float(ranked[-1]) if len(collected) >= nodes else -math.inf
    if cost is not None and cost.per_token_s > 0:
        least = cost.per_token_s * float(expected_rates(ranked, cost).max())
        floor = max(floor, math.log(least) - 1e-6)  # the margin absorbs rounding: a node at the floor is kept
    return floor


class HeadSession(TextSession):
    """One request's head state: its KV cache over ``length`` inputs (positions ``0 .. length - 1``)
    and the target's features handed over since the last proposal."""

    wants_features = True

    def __init__(self, head: TextHeadDraft, config: HeadTreeConfig, cost: CallCost | None = None) -> None:
        self.head, self.config, self.cost = head, config, cost
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values [1, kv_heads, length, d]
        self.length = 0
        self.pending: torch.Tensor | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.fused_layers

    def observe(self, features: torch.Tensor, start: int) -> None:
        """The target's features ``[n, input_width]`` (its fused layers' outputs, then its top
        feature) at text positions ``start .. start + n - 1``, which must follow the inputs read and
        the features pending so far (rounds without a proposal, in a hybrid, leave theirs to the
        next :meth:`read`); kept as the head's inputs ``[n, H]``."""
        pending = 0 if self.pending is None else len(self.pending)
        if start != self.length + pending:
            raise RuntimeError(f"head session out of step: features from position {start}, "
                               f"{self.length} read and {pending} pending")
        read = self.head.read(features)
        self.pending = read if self.pending is None else torch.cat((self.pending, read))

    def propose(self, text: list[int], max_depth: int) -> DraftTree:
        """Read the pending features, then draft a tree (at most ``max_depth`` deep) after ``text``."""
        guessed = self.read(text)
        depth = min(self.config.depth, max_depth)
        return self.grow(guessed, depth) if depth >= 1 else DraftTree([], [])

    def read(self, text: list[int]) -> torch.Tensor:
        """Feed the pending features with the tokens after them in ``text`` (which must end there) to
        the head, extending its cache; returns the guessed feature after ``text``, ``[H]``."""
        features, start = self.pending, self.length
        if features is None or start + len(features) + 1 != len(text):
            raise RuntimeError("head session out of step: the text does not end after the observed features")
        count, device = len(features), features.device
        tokens = torch.tensor(text[start + 1:], device=device)[None]
        positions = torch.arange(start, start + count, device=device)[None]
        visible = torch.cat((torch.ones(count, start, dtype=torch.bool, device=device),
                             torch.ones(count, count, dtype=torch.bool, device=device).tril()), dim=1)
        guessed, keys, values = self.head.step(features[None], tokens, positions, visible[None], self.cache)
        self.cache = (keys, values) if self.cache is None else \
            (torch.cat((self.cache[0], keys), dim=2), torch.cat((self.cache[1], values), dim=2))
        self.length, self.pending = start + count, None
        return guessed[0, -1]

    def grow(self, guessed: torch.Tensor, depth: int) -> DraftTree:
        """The draft tree of ``depth`` levels below the feature ``guessed`` ``[H]`` (module doc)."""
        assert self.cache is not None
        width, head = self.config.width, self.head
        device = guessed.device
        top = head.log_probs(guessed[None])[0].topk(width)
        # the newest level's candidates: cumulative log-probs, draft-vocabulary slots, the features
        # they would be fed with (their parent's guess) and their ancestors among the fed nodes
        scores, slots = top.values, top.indices
        inputs, ancestors = guessed[None].expand(width, -1), torch.zeros(width, 0, dtype=torch.bool, device=device)
        all_scores, all_slots, all_parents = [scores], [slots], [torch.full((width,), -1, device=device)]
        first, tree_keys, tree_values = 0, self.cache[0][:, :, :0], self.cache[1][:, :, :0]
        for level in range(1, depth):
            chosen = scores.topk(min(width, len(scores))).indices  # [c]: the level's nodes to expand
            if self.config.prune:
                chosen = chosen[scores[chosen] > expansion_floor(torch.cat(all_scores), self.config.nodes, self.cost)]
            count = len(chosen)
            if count == 0:
                break
            rows = torch.cat((ancestors[chosen], torch.eye(count, dtype=torch.bool, device=device)), dim=1)
            visible = torch.cat((torch.ones(count, self.length, dtype=torch.bool, device=device), rows), dim=1)
            positions = torch.full((1, count), self.length - 1 + level, device=device)
            past = (torch.cat((self.cache[0], tree_keys), dim=2), torch.cat((self.cache[1], tree_values), dim=2))
            out, keys, values = head.step(inputs[chosen][None], head.ids[slots[chosen]][None], positions,
                                          visible[None], past)
            tree_keys, tree_values = torch.cat((tree_keys, keys), dim=2), torch.cat((tree_values, values), dim=2)
            children = head.log_probs(out[0]).topk(width)  # [c, width]
            parents = (first + chosen)[:, None].expand(count, width).reshape(-1)
            first += len(scores)
            scores = (scores[chosen][:, None] + children.values).reshape(-1)
            slots = children.indices.reshape(-1)
            inputs = out[0].repeat_interleave(width, dim=0)
            ancestors = rows.repeat_interleave(width, dim=0)
            all_scores.append(scores)
            all_slots.append(slots)
            all_parents.append(parents)
        return select(torch.cat(all_scores), head.ids[torch.cat(all_slots)], torch.cat(all_parents), self.config.nodes,
                      self.cost)


def select(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, nodes: int,
           cost: CallCost | None = None) -> DraftTree:
    """The ``nodes`` candidates with the highest ``scores`` (float ``[T]``; never above the
    parent's), best first, ties in candidate order, as a :class:`DraftTree`: ``tokens`` int64
    ``[T]``, ``parents`` int64 ``[T]`` (a smaller candidate index, or -1). With ``cost``, only the
    :func:`node_budget` best of those and the free nodes after them (module doc)."""
    order = torch.argsort(-scores, stable=True)[:nodes]
    if cost is not None:
        order = order[:cost.free_tokens(node_budget(scores[order], cost) + 1) - 1]
    index = torch.full_like(parents, -1)
    index[order] = torch.arange(len(order), device=order.device)
    kept = parents[order]
    renumbered = torch.where(kept >= 0, index[kept.clamp(min=0)], -1)
    assert not bool(((kept >= 0) & (renumbered < 0)).any()), "a selected node's parent was not selected"
    return DraftTree(tokens[order].tolist(), renumbered.tolist())


def merge_trees(first: DraftTree, second: DraftTree) -> DraftTree:
    """The union of two draft trees after the same text: ``first``'s nodes in its order, then the
    nodes of ``second`` whose path ``first`` lacks (their parents renumbered); a path in both is
    kept once. Parents still precede their children."""
    index: dict[tuple[int, int], int] = {(parent, token): i for i, (token, parent)
                                         in enumerate(zip(first.tokens, first.parents))}
    tokens, parents = list(first.tokens), list(first.parents)
    where: list[int] = []  # second's node -> merged node
    for token, parent in zip(second.tokens, second.parents):  # a tree of at most a few dozen nodes
        key = (where[parent] if parent >= 0 else -1, token)
        if key not in index:
            index[key] = len(tokens)
            tokens.append(token)
            parents.append(key[0])
        where.append(index[key])
    return DraftTree(tokens, parents)


class HybridDrafter:
    """Retrieval drafting (``retrieval``) and a head (``head``) in one tree per step (module doc)."""

    def __init__(self, retrieval: RetrievalDrafter, head: HeadDrafter) -> None:
        self.retrieval, self.head = retrieval, head

    def session(self, prompt: Sequence[int]) -> HybridSession:
        return HybridSession(self.retrieval.session(prompt), self.head.session(prompt))


class HybridSession(TextSession):
    """A request's retrieval session and head session side by side: the head observes the
    target's features; retrieval proposes, and the head too unless the head's ``gate`` says the
    retrieved tree is deep enough; the trees are merged."""

    wants_features = True

    def __init__(self, retrieval: DraftSession, head: HeadSession) -> None:
        self.retrieval, self.head = retrieval, head

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def observe(self, features: torch.Tensor, start: int) -> None:
        self.head.observe(features, start)

    def propose(self, text: list[int], max_depth: int) -> DraftTree:
        retrieved, gate = self.retrieval.propose(text, max_depth), self.head.config.gate
        if gate is not None and retrieved.longest_branch() >= gate:
            return retrieved
        return merge_trees(retrieved, self.head.propose(text, max_depth))
