"""Drafting text with a feature-level head (:mod:`recspec.models.text_head`): EAGLE-2's dynamic
draft trees for the text round loop (:mod:`recspec.decoding.text_rounds`), for a whole batch.

:class:`HeadTrees` keeps the head's KV cache over the inputs ``(f_t, x_{t+1})`` whose features are
the target's own, the prompt's and every accepted token's, never a draft's
(:class:`~recspec.decoding.head_cache.HeadCache`). After each target call the loop hands it the
target's features at the positions it kept (:meth:`HeadTrees.learn`: the prompt after the
prefill, then each round's root and accepted path), which wait until the head next drafts; then
one head call reads them for every row, each with the token that follows it in the text (the
last one the target's own token after the accepted path), and each row's last output, the guessed
feature after its text, drafts its tree:

* level 1: the ``width`` most probable draft tokens after the text;
* every further level, up to ``depth``: the ``width`` nodes of the newest level with the highest
  cumulative draft probability (the product of ``q`` along the path) are fed to the head in one
  call (their parent's guessed feature and their own token, at their text positions, attending to
  the cache and to their ancestors in the tree, whose keys and values live for the round only),
  and each gets its ``width`` most probable children;
* the tree proposed is the ``nodes`` nodes of all levels with the highest cumulative probability
  (EAGLE-2's reranking), best first. A node is never more probable than its parent and ties keep
  the parent first, so the selection is a tree whose parents precede their children.

A round costs at most ``depth`` head calls for the whole batch: the first over the newly accepted
inputs, the others over at most ``width`` nodes per row (a row's nodes that need no expansion are
fed as fill, their children never kept). Drafts only choose what the target verifies, so with
greedy verification the text is the greedy decoding's whatever the head's quality.

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

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from recspec.decoding.cost import CallCost, median_seconds
from recspec.decoding.head_cache import HeadCache
from recspec.decoding.prompts import Prompts, left_pad
from recspec.decoding.text_rounds import Draft, DraftTree, Scorer, path_first
from recspec.errors import RecspecError
from recspec.models.text_head import TextHeadDraft


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
    best of its ``config.nodes`` candidates. :meth:`batch` starts a batch's :class:`HeadTrees`."""

    def __init__(self, head: TextHeadDraft, config: HeadTreeConfig = HeadTreeConfig(),
                 cost: CallCost | None = None) -> None:
        if config.width > len(head.ids):
            raise RecspecError(f"a draft tree {config.width} wide needs at least {config.width} draft tokens; the head "
                               f"has {len(head.ids)}")
        self.head, self.config, self.cost = head, config, cost

    def batch(self, prompts: Sequence[Sequence[int]]) -> HeadTrees:
        return HeadTrees(self.head, self.config, self.cost)

    @torch.inference_mode()
    def round_seconds(self, context: int, repeats: int = 10) -> float:
        """Median seconds of the head's part of one round after a text of ``context`` tokens: reading
        two accepted inputs, then growing a full tree, every level expanded (random features and
        tokens: the cost does not depend on them; pruning makes real rounds cheaper, so the cost
        model errs towards larger trees)."""
        head, device = self.head, self.head.ids.device
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(1, context + 2, head.head.config.input_width, generator=generator).to(device)
        text = head.ids[torch.randint(0, len(head.ids), (context + 3,), generator=generator).to(device)].tolist()
        trees = HeadTrees(head, replace(self.config, prune=False))
        trees.start(left_pad([torch.tensor(text[:context])], 0, device), features[:, :context])
        trees.catch_up([text[:context + 1]])
        read = trees.cache.text
        assert read is not None
        keys, values = trees.cache.past

        def one_round() -> None:
            trees.cache.text = replace(read, cache=type(read.cache)(ddp_cache_data=[(keys, values)]))
            trees.pending = (features[:, context:], torch.ones(1, 2, dtype=torch.bool, device=device))
            trees.catch_up([text])
            trees.trees([self.config.depth])

        return median_seconds(one_round, device, repeats)


def round_cost(target: CallCost, head_s: float) -> CallCost:
    """A head round's cost by verified nodes: the target's call (fed the root and the nodes; padded
    as the target's) and the head's drafting (``head_s`` seconds, :meth:`HeadDrafter.round_seconds`)
    folded into the fixed part."""
    return CallCost(target.fixed_s + head_s, target.per_token_s, padded=target.padded)


def expected_rates(log_scores: torch.Tensor, cost: CallCost) -> torch.Tensor:
    """Expected tokens per second of a round verifying the first ``n`` ranked candidates, for ``n``
    in ``1 .. T``: ``log_scores`` float ``[..., T]`` (their cumulative draft log-probabilities, best
    first); float64 ``[..., T]``, ``(1 + sum_{i <= n} exp(log_scores_i)) / cost.call_s(n + 1)``."""
    count = torch.arange(1, log_scores.shape[-1] + 1, dtype=torch.float64, device=log_scores.device)
    emitted = 1 + log_scores.double().exp().cumsum(-1)
    return emitted / cost.call_s(count + 1)


def node_budget(log_scores: torch.Tensor, cost: CallCost) -> torch.Tensor:
    """How many of the ranked candidates to verify: ``log_scores`` float ``[..., T]`` (best first,
    ``T >= 1``); int64 ``[...]``, the ``n`` in ``1 .. T`` with the highest :func:`expected_rates`
    (module doc)."""
    return torch.argmax(expected_rates(log_scores, cost), dim=-1) + 1


def expansion_floor(collected: torch.Tensor, nodes: int, cost: CallCost | None) -> torch.Tensor:
    """Per row, the cumulative log-score at or below which no descendant of a node can be in the
    tree that :func:`select` keeps (``nodes``, ``cost``) from any candidates that include
    ``collected`` (float ``[B, T]``, ``T >= 1``: the scores drafted so far); float ``[B]``.
    Descendants score at most their ancestor (module doc: *pruning*)."""
    ranked = collected.topk(min(nodes, collected.shape[1]), dim=1).values
    floor = ranked[:, -1] if collected.shape[1] >= nodes else torch.full_like(ranked[:, 0], -torch.inf)
    if cost is not None and cost.per_token_s > 0:
        least = cost.per_token_s * expected_rates(ranked, cost).max(dim=1).values
        # the margin absorbs rounding: a node at the floor is kept
        floor = torch.maximum(floor.double(), least.log() - 1e-6).to(collected.dtype)
    return floor


def select(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, levels: torch.Tensor, nodes: int,
           cost: CallCost | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tree of the ``nodes`` candidates with the highest ``scores`` (float ``[B, T]``,
    ``-inf`` for none; never above the parent's), best first, ties in candidate order: ``tokens``,
    ``parents`` (a smaller candidate index, or -1) and ``levels`` (1 for the root's children)
    int64 ``[B, T]``; with ``cost``, only the :func:`node_budget` best of those and the free nodes
    after them (module doc). Returns the tokens and parents (renumbered, -1: a child of the root)
    of ``n`` nodes, int64 ``[B, n]`` (a row with fewer filled with token 0, parent -1), and each
    row's node count and deepest level, int64 ``[B]``."""
    order = torch.argsort(-scores, dim=1, stable=True)[:, :nodes]
    ranked = scores.gather(1, order)
    sizes = (ranked > -torch.inf).sum(dim=1)
    if cost is not None:
        budget = node_budget(ranked, cost)
        if cost.padded:  # the rows the call computes anyway, for each budget
            budget = torch.tensor([cost.free_tokens(n + 1) - 1 for n in range(order.shape[1] + 1)],
                                  device=order.device)[budget]
        sizes = torch.minimum(sizes, budget)
    count = int(sizes.max()) if len(sizes) else 0
    order, kept = order[:, :count], torch.arange(count, device=order.device)[None, :] < sizes[:, None]
    index = torch.full_like(parents, -1).scatter_(1, order, torch.arange(count, device=order.device).expand_as(order))
    parent = parents.gather(1, order)
    renumbered = torch.where(parent >= 0, index.gather(1, parent.clamp(min=0)), -1)
    assert not bool((kept & (parent >= 0) & ((renumbered < 0) | (renumbered >= sizes[:, None]))).any()), \
        "a selected node's parent was not selected"
    depths = torch.where(kept, levels.gather(1, order), 0).amax(dim=1) if count else torch.zeros_like(sizes)
    return tokens.gather(1, order).masked_fill(~kept, 0), renumbered.masked_fill(~kept, -1), sizes, depths


@dataclass
class HeadTrees:
    """A batch's :class:`~recspec.decoding.text_rounds.TextDrafter` of ``head``'s trees (see the
    module doc): its :class:`~recspec.decoding.head_cache.HeadCache` and the target's features
    ``pending`` since the head last read (``[B, M, F]``, and which columns are real, bool
    ``[B, M]``)."""

    head: TextHeadDraft
    config: HeadTreeConfig
    cost: CallCost | None = None
    cache: HeadCache = field(init=False)
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    lag = 0
    drop_hidden = False
    wants_features = True

    def __post_init__(self) -> None:
        self.cache = HeadCache(self.head)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.fused_layers

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        assert features is not None, "a head drafts from the target's features"
        self.pending = (features, prompts.attention_mask.bool())

    def propose(self, texts: list[list[int]], budgets: list[int], score: Scorer) -> Draft:
        self.catch_up(texts)
        tokens, parents, sizes, depths = self.trees(budgets)
        roots = torch.tensor([[text[-1]] for text in texts], device=tokens.device)
        drafted = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < sizes[:, None]
        return Draft(torch.cat((roots, tokens), dim=1),
                     torch.cat((torch.full_like(roots, -1), torch.where(drafted, parents + 1, -1)), dim=1),
                     sizes.cpu(), depths.cpu())

    def catch_up(self, texts: list[list[int]]) -> None:
        """Read the pending features, each with the token after it in ``texts`` (each row's text,
        which the pending features reach up to its last token)."""
        if self.pending is None:
            return
        features, real = self.pending
        counts = real.sum(dim=1).tolist()
        after = [token for text, count in zip(texts, counts) for token in text[len(text) - count:]]
        tokens = torch.zeros(real.shape, dtype=torch.int64, device=real.device)
        tokens[real] = torch.tensor(after, device=real.device)
        self.cache.read(features, tokens, real)
        self.pending = None

    def learn(self, draft: Draft, path: torch.Tensor, own: torch.Tensor, features: torch.Tensor | None) -> None:
        """Keep the target's features at each row's root and accepted path (``path`` bool ``[B, N]``)
        for the next read."""
        assert features is not None, "a head drafts from the target's features"
        kept = path.sum(dim=1)
        count = int(kept.max())
        order = path_first(path)[:, :count]
        new = features.gather(1, order[:, :, None].expand(-1, -1, features.shape[2]))
        real = torch.arange(count, device=path.device)[None, :] < kept[:, None]
        if self.pending is not None:
            new, real = torch.cat((self.pending[0], new), dim=1), torch.cat((self.pending[1], real), dim=1)
        self.pending = (new, real)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        if self.pending is not None:
            self.pending = (self.pending[0][rows], self.pending[1][rows])

    def trees(self, budgets: list[int], chosen_rows: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft tree of each row (or of the rows ``chosen_rows``, an int64 index) at most
        ``min(depth, budget)`` deep (``budgets``: one per tree), after the head has read its text
        (:meth:`catch_up`): :func:`select`'s tokens, parents, sizes and depths."""
        cache, head, config = self.cache, self.head, self.config
        assert cache.guessed is not None and cache.text is not None, "the head has read nothing yet"
        (past_keys, past_values), visible, lengths = cache.past, cache.text.visible, cache.text.count
        guessed, width = cache.guessed, config.width
        if chosen_rows is not None:  # a copy of those rows' cache, for this round's drafting only
            guessed, past_keys, past_values, visible, lengths = (part[chosen_rows] for part in (
                guessed, past_keys, past_values, visible, lengths))
        rows, device = guessed.shape[0], guessed.device
        depth = torch.tensor(budgets, device=device).clamp(max=config.depth)
        top = head.log_probs(guessed).topk(width)  # [B, width]
        # the newest level's candidates: cumulative log-probs, draft-vocabulary slots, the features
        # they would be fed with (their parent's guess) and their ancestors among the fed nodes
        scores, slots = top.values.masked_fill((depth < 1)[:, None], -torch.inf), top.indices
        inputs = guessed[:, None].expand(rows, width, -1)
        ancestors = torch.zeros(rows, width, 0, dtype=torch.bool, device=device)
        all_scores, all_slots = [scores], [slots]
        all_parents = [torch.full((rows, width), -1, device=device)]
        all_levels = [torch.ones(rows, width, dtype=torch.int64, device=device)]
        first, tree_keys, tree_values = 0, past_keys[:, :, :0], past_values[:, :, :0]
        for level in range(1, int(depth.max()) if rows else 0):
            chosen = scores.topk(min(width, scores.shape[1]), dim=1).indices  # [B, c]: the level's nodes to expand
            chosen_scores = scores.gather(1, chosen)
            alive = (chosen_scores > -torch.inf) & (depth > level)[:, None]
            if config.prune:
                alive &= chosen_scores > expansion_floor(torch.cat(all_scores, dim=1), config.nodes, self.cost)[:, None]
            count = int(alive.sum(dim=1).max())  # a prefix of each row's chosen nodes
            if count == 0:
                break
            chosen, chosen_scores, alive = chosen[:, :count], chosen_scores[:, :count], alive[:, :count]
            seen = torch.cat((ancestors.gather(1, chosen[:, :, None].expand(-1, -1, ancestors.shape[2])),
                              torch.eye(count, dtype=torch.bool, device=device).expand(rows, -1, -1)), dim=2)
            out, keys, values = head.step(
                inputs.gather(1, chosen[:, :, None].expand(-1, -1, inputs.shape[2])),
                head.ids[slots.gather(1, chosen)], (lengths - 1 + level)[:, None].expand(rows, count),
                torch.cat((visible[:, None, :].expand(rows, count, -1), seen), dim=2),
                (torch.cat((past_keys, tree_keys), dim=2), torch.cat((past_values, tree_values), dim=2)))
            tree_keys, tree_values = torch.cat((tree_keys, keys), dim=2), torch.cat((tree_values, values), dim=2)
            children = head.log_probs(out).topk(width)  # [B, c, width]
            all_parents.append((first + chosen)[:, :, None].expand(rows, count, width).reshape(rows, -1))
            first += scores.shape[1]
            scores = (chosen_scores[:, :, None] + children.values).masked_fill(~alive[:, :, None], -torch.inf)
            scores, slots = scores.reshape(rows, -1), children.indices.reshape(rows, -1)
            inputs, ancestors = out.repeat_interleave(width, dim=1), seen.repeat_interleave(width, dim=1)
            all_scores.append(scores)
            all_slots.append(slots)
            all_levels.append(torch.full_like(slots, level + 1))
        return select(torch.cat(all_scores, dim=1), head.ids[torch.cat(all_slots, dim=1)],
                      torch.cat(all_parents, dim=1), torch.cat(all_levels, dim=1), config.nodes, self.cost)

    def trees_for(self, texts: list[list[int]], budgets: list[int], wanted: list[bool]) -> list[DraftTree | None]:
        """After reading ``texts``, the :meth:`trees` of the rows ``wanted`` (None for the others),
        one :class:`~recspec.decoding.text_rounds.DraftTree` per row."""
        self.catch_up(texts)
        rows = [row for row, want in enumerate(wanted) if want]
        index = None if len(rows) == len(wanted) else torch.tensor(rows, device=self.head.ids.device)
        tokens, parents, sizes, _ = self.trees([budgets[row] for row in rows], index)
        trees: list[DraftTree | None] = [None] * len(wanted)
        for row, own, up, size in zip(rows, tokens.tolist(), parents.tolist(), sizes.tolist()):
            trees[row] = DraftTree(own[:size], up[:size])
        return trees
