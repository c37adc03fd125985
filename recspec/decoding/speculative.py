"""Speculative beam search for top-K items (AtSpeed): a draft model drafts beams, the target
verifies them in one tree-attention call per round.

One round, for every user of the batch at once (users may be at different depths):

1. **Draft** (:func:`_draft`): level 0 is the target's ``K`` current beams, whose last tokens
   are pending (in the first round: the prompt's last token, one "beam" per user); the draft
   model feeds a level and selects the next one from the trie children of its nodes: the top
   ``N`` (strict) or ``K`` samples (relaxed), for ``gamma`` levels, at most up to the last depth
   that has children (the final step is computed from that depth's distributions whatever the
   draft guesses, so drafting leaves would only cost) (atspeed.txt Eq. 1). Strict drafting ranks a drafted sequence by the *target's*
   exact score of its level-0 beam plus the draft's log-probabilities of the tokens after it: any
   ranking keeps strict verification exact, and this one uses what the target already knows.
2. **Score** (:func:`_score`): the target is fed every level in one call; in the first round
   the prompt goes in the same call (atspeed.txt Alg. 1 runs the target on the prefix and the
   drafted steps together), so with a perfect draft the whole search costs the target one call.
   The draft has been fed the same levels (less the last one when the round's bonus step always
   completes the identifiers), so both caches hold the same nodes.
3. **Verify** (:mod:`recspec.decoding.verify`), step by step from level 0: the target's own
   beam-search step (strict, :func:`~recspec.decoding.beam.select_top_k`, so ties break exactly as
   in ``beam``) or sampling step (relaxed) over the children of its current beams, whose log-probs
   are in the scored tree; the step is accepted when all ``K`` new beams are drafted nodes
   (atspeed.txt Alg. 1 / Alg. 2). A user's round ends at its first rejected step (whose beams are
   the target's own, computed from the scored tree: the correction), after the step that follows
   the last drafted level (the bonus), or when its identifiers are complete.
4. **Compact** (:func:`_compact`): both caches keep the prompt and the ancestors of the new beams,
   nothing else (one gather per layer); users whose beams are complete leave the batch.

With strict verification the result equals :func:`~recspec.decoding.beam.beam_search` (same
items, order and scores, up to float noise in near-ties: :attr:`TopK.margin`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from transformers import DynamicCache

from recspec.decoding.beam import Beams, Prompts, left_pad, prefill, select_top_k, validate_request
from recspec.decoding.cache import compact, require_full_attention, select_rows
from recspec.decoding.draft_tree import Level, child_level, feed, stacked
from recspec.decoding.scorer import forward_prompt_and_tree, next_log_probs
from recspec.decoding.topk import TopK
from recspec.decoding.sampling import best_first
from recspec.decoding.verify import RelaxedSampler, strict_accepted
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie

VERIFICATIONS = ("strict", "relaxed")


@dataclass(frozen=True)
class SpecConfig:
    """``draft_beams``: N, drafted sequences per level (strict); ``gamma``: drafted levels per
    round (None: the rest of the identifier); ``verify``: ``"strict"`` or ``"relaxed"``;
    ``temperature``, ``seed`` and ``replacement``: of relaxed (sampling) verification, see
    :class:`~recspec.decoding.verify.RelaxedSampler` (relaxed drafts K sequences per level, as
    atspeed.txt Alg. 2; ``draft_beams`` is strict's)."""

    draft_beams: int = 40
    gamma: int | None = None
    verify: str = "strict"
    temperature: float = 1.0
    seed: int = 0
    replacement: bool = False


@dataclass
class SpecStats:
    """Per user, float32 ``[B]`` each: ``accepted_steps`` (AS: drafted steps accepted),
    ``drafted_steps`` (steps drafted for the user; acceptance rate = accepted / drafted),
    ``target_calls`` (prefill included), ``draft_calls`` (prefill included), ``tree_nodes`` (tree
    nodes fed to the target, summed over rounds), ``rounds``; and seconds of the user's batch,
    divided among its users: ``prefill_s``, ``draft_s``, ``verify_s`` (target call and
    verification), ``overhead_s`` (the rest: compaction, bookkeeping)."""

    accepted_steps: torch.Tensor
    drafted_steps: torch.Tensor
    target_calls: torch.Tensor
    draft_calls: torch.Tensor
    tree_nodes: torch.Tensor
    rounds: torch.Tensor
    prefill_s: torch.Tensor
    draft_s: torch.Tensor
    verify_s: torch.Tensor
    overhead_s: torch.Tensor

    @classmethod
    def zeros(cls, batch: int) -> SpecStats:
        return cls(*(torch.zeros(batch) for _ in fields(cls)))

    @classmethod
    def cat(cls, parts: Sequence[SpecStats]) -> SpecStats:
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def add_round(self, users: torch.Tensor, drafted: torch.Tensor, draft_calls: int, tree_nodes: int) -> None:
        """Count one round of the users ``users`` (int64 index): one target call, the steps each
        drafted (``drafted``, float32), the draft calls and the tree nodes fed to the target."""
        self.drafted_steps[users] += drafted
        self.target_calls[users] += 1
        self.draft_calls[users] += draft_calls
        self.tree_nodes[users] += float(tree_nodes)
        self.rounds[users] += 1

    def summary(self) -> dict[str, float]:
        """Means over users (AS@K and the rest)."""
        return {f.name: float(getattr(self, f.name).mean()) for f in fields(self)}


@dataclass
class SpecResult:
    topk: TopK
    stats: SpecStats


@dataclass
class _Frontier:
    """The target's current beams of the active users (pending last tokens; see draft_tree).

    ``beams``: scores, trie nodes and margin ``[B, K]`` / ``[B]`` (its ``tokens`` are not kept;
    ``paths`` holds them); ``paths``: int64 ``[B, K, L]``; ``depth``: int64 ``[B]``;
    ``visible``: bool ``[B, K, T]``, each beam's view of the cache (prompt and ancestors);
    ``lengths``: int64 ``[B]``, real prompt tokens; ``users``: int64 ``[B]``, row in the batch.
    """

    beams: Beams
    paths: torch.Tensor
    depth: torch.Tensor
    visible: torch.Tensor
    lengths: torch.Tensor
    users: torch.Tensor


@dataclass
class _Clock:
    """Wall time per phase; waits for the device before each reading."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("prefill", "draft", "verify"), 0.0))

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add(self, phase: str, since: float) -> float:
        now = self.now()
        self.seconds[phase] += now - since
        return now


def _root(prompts: Prompts, trie: ItemTrie) -> _Frontier:
    """Every user at depth 0: one beam, the empty prefix, whose "pending" token is the prompt's
    last one (it is fed with the prompt in the first round)."""
    batch = len(prompts.lengths)
    return _Frontier(beams=Beams.start(batch, trie),
                     paths=torch.zeros(batch, 1, trie.depth, dtype=torch.int64, device=trie.device),
                     depth=torch.zeros(batch, dtype=torch.int64, device=trie.device),
                     visible=prompts.attention_mask.bool()[:, None, :], lengths=prompts.lengths,
                     users=torch.arange(batch, device=trie.device))


def drafted_per_row(depth: torch.Tensor, max_depth: int, drafted: int) -> torch.Tensor:
    """The steps each row of a round really drafts, float32 ``[B]`` on the CPU: the round drafts
    ``drafted`` levels for the whole batch (from its shallowest row), a row ahead of the others
    only those up to its identifiers' last step (``depth``: int64 ``[B]``, steps taken)."""
    return (max_depth - depth).clamp(min=0, max=drafted).cpu().float()


def _level_zero(front: _Frontier, prompts: Prompts | None) -> Level:
    """The round's first level: the pending beams, or (``prompts`` given, first round) the root,
    which is the prompt's last token and sees the prompt."""
    batch, k = front.beams.nodes.shape
    if prompts is not None:
        return Level(tokens=prompts.input_ids[:, -1:], nodes=front.beams.nodes, parents=torch.full_like(
            front.beams.nodes, -1), scores=front.beams.scores, visible=front.visible,
            positions=(front.lengths - 1)[:, None], paths=front.paths)
    own = torch.eye(k, dtype=torch.bool, device=front.paths.device).expand(batch, k, k)
    tokens = front.paths.gather(2, (front.depth - 1)[:, None, None].expand(-1, k, 1))[:, :, 0]
    return Level(tokens=tokens, nodes=front.beams.nodes, parents=torch.full_like(tokens, -1),
                 scores=front.beams.scores, visible=torch.cat((front.visible, own), dim=2),
                 positions=(front.lengths + front.depth - 1)[:, None].expand(-1, k), paths=front.paths)


def _draft(draft, cache, level0: Level, root_log_q: torch.Tensor | None, front: _Frontier, trie: ItemTrie,
           config: SpecConfig, k: int, sampler: RelaxedSampler | None, drafted: int, feed_last: bool) -> list[Level]:
    """Levels ``0 .. drafted`` of this round's tree. The draft is fed each level it drafts from
    (level 0 not in the first round: ``root_log_q`` [B, 1, V] are its prefill's log-probs) and,
    if ``feed_last``, the last level too, so that its cache holds what the target's will."""
    levels = [level0]
    for j in range(1, drafted + 1):
        parent = levels[-1]
        log_q = root_log_q if j == 1 and root_log_q is not None else feed(draft, cache, [parent])
        depth = front.depth + j
        start = Beams(scores=parent.scores, nodes=parent.nodes, tokens=parent.tokens[:, :, None],
                      parents=parent.parents, margin=front.beams.margin)
        if sampler is None:  # strict: the top N by target prefix score + draft log-probs
            chosen = select_top_k(start, log_q, trie, config.draft_beams)
            levels.append(child_level(parent, chosen.parents, chosen.tokens[:, :, -1], chosen.nodes, chosen.scores,
                                      depth))
        else:  # relaxed: K sequences sampled from the draft's beam-sampling distribution q_j
            chosen, proposal, choice = sampler.draft(start, log_q, trie, k)
            levels.append(child_level(parent, chosen.parents, chosen.tokens[:, :, -1], chosen.nodes, chosen.scores,
                                      depth, proposal, choice))
    if feed_last:
        feed(draft, cache, [levels[-1]])
    return levels


def _score(target, cache, levels: list[Level], prompts: Prompts | None) -> torch.Tensor:
    """The target's log-probs at every node of ``levels``: float32 ``[B, sum n, V]``. In the
    first round (``prompts`` given) the prompt is fed in the same call, before levels 1.., and
    row 0 of the result is the prompt's last position (level 0, the root)."""
    if prompts is None:
        return feed(target, cache, levels)
    return next_log_probs(forward_prompt_and_tree(target, cache, prompts.input_ids, prompts.attention_mask,
                                                  prompts.position_ids, *stacked(levels[1:])))


def _verify(front: _Frontier, levels: list[Level], log_p: torch.Tensor, trie: ItemTrie, k: int,
            sampler: RelaxedSampler | None) -> tuple[Beams, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps ``j = 1, 2, ...`` of the target over the scored tree until each user's round ends.

    ``log_p``: float32 ``[B, M, V]``, the target's log-probs at every fed node (levels
    ``0 .. len(fed) - 1`` concatenated). Returns the new beams, the fed index of each new beam's
    parent ``[B, K]``, the number of steps taken ``[B]`` and of drafted steps accepted ``[B]``.
    """
    batch, width = front.beams.nodes.shape
    device = front.depth.device
    offsets = [0]
    for level in levels:
        offsets.append(offsets[-1] + level.width)
    fed = log_p.shape[1]
    current, where = front.beams, torch.arange(width, device=device).expand(batch, width)  # fed index per beam
    active = torch.ones(batch, dtype=torch.bool, device=device)
    steps = torch.zeros(batch, dtype=torch.int64, device=device)
    accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    for j in range(1, len(levels) + 1):
        if offsets[j] > fed:  # level j - 1 was not fed: no distributions to step from
            break
        step_log_p = log_p.gather(1, where[:, :, None].expand(-1, -1, log_p.shape[2]))
        drafted = levels[j] if j < len(levels) else None
        if sampler is None:
            new = select_top_k(current, step_log_p, trie, k)
            ok, next_where = strict_accepted(new, where, drafted, offsets[j - 1], offsets[j])
        else:
            new, ok, next_where = sampler.verify(current, where, step_log_p, drafted, offsets[j], trie, k)
        new_parent_at = where.gather(1, new.parents)
        steps = torch.where(active, j, steps)
        done = active & (front.depth + j >= trie.depth)
        accepted += (active & ok).long()
        go_on = active & ok & ~done & (j < len(levels) and offsets[j + 1] <= fed)
        stop = active & ~go_on
        if j == 1:  # every user is active at the first step
            result, parent_at = new, new_parent_at
        else:
            result = _where_beams(stop, new, result)
            parent_at = torch.where(stop[:, None], new_parent_at, parent_at)
        if not bool(go_on.any()):
            break
        current = new if j == 1 else _where_beams(go_on, new, current)
        where = torch.where(go_on[:, None], next_where, where)
        active = go_on
    return result, parent_at, steps, accepted


def _where_beams(rows: torch.Tensor, new: Beams, old: Beams) -> Beams:
    """``new`` for users where ``rows`` (bool ``[B]``), else ``old`` (same width ``K``)."""
    pick = rows[:, None]
    return Beams(scores=torch.where(pick, new.scores, old.scores), nodes=torch.where(pick, new.nodes, old.nodes),
                 tokens=torch.where(pick[:, :, None], new.tokens[:, :, -1:], old.tokens[:, :, -1:]),
                 parents=torch.where(pick, new.parents, old.parents),
                 margin=torch.where(rows, new.margin, old.margin))


def _advance(front: _Frontier, levels: list[Level], beams: Beams, parent_at: torch.Tensor,
             steps: torch.Tensor) -> tuple[_Frontier, torch.Tensor]:
    """The frontier after the round (new beams, paths, depths) and, per beam, its view of the
    uncompacted cache: bool ``[B, K, W]`` (prompt and ancestors, W = cache width)."""
    _, visible, _ = stacked(levels)  # [B, M, W]: every node's view
    width = visible.shape[2]
    paths = torch.cat([level.paths for level in levels], dim=1)
    k = parent_at.shape[1]
    view = visible.gather(1, parent_at[:, :, None].expand(-1, -1, width))
    depth = front.depth + steps
    new_paths = paths.gather(1, parent_at[:, :, None].expand(-1, -1, paths.shape[2])).clone()
    new_paths.scatter_(2, (depth - 1).clamp(max=paths.shape[2] - 1)[:, None, None].expand(-1, k, 1),
                       beams.tokens[:, :, -1:])
    return _Frontier(beams=beams, paths=new_paths, depth=depth, visible=view, lengths=front.lengths,
                     users=front.users), view


def _compact(front: _Frontier, caches: Sequence) -> _Frontier:
    """Keep in both caches the prompt and the ancestors of the beams, nothing else (one gather per
    layer, the same for both: their layouts agree); rows of users with fewer such positions than
    the longest are filled with position 0, hidden from every beam."""
    width = caches[0].layers[0].keys.shape[2]
    view = front.visible[:, :, :width]
    positions, filled = compact(caches, view.any(dim=1))
    visible = view.gather(2, positions[:, None, :].expand(-1, view.shape[1], -1)) & filled[:, None, :]
    return _Frontier(beams=front.beams, paths=front.paths, depth=front.depth, visible=visible,
                     lengths=front.lengths, users=front.users)


def _select_users(front: _Frontier, rows: torch.Tensor, caches: Sequence) -> _Frontier:
    """Keep the users ``rows`` (int64 index) of the frontier and of every cache."""
    for cache in caches:
        select_rows(cache, rows)
    b = front.beams
    return _Frontier(
        beams=Beams(scores=b.scores[rows], nodes=b.nodes[rows], tokens=b.tokens[rows], parents=b.parents[rows],
                    margin=b.margin[rows]),
        paths=front.paths[rows], depth=front.depth[rows], visible=front.visible[rows], lengths=front.lengths[rows],
        users=front.users[rows])


def _decode_batch(target, draft, prompts: Prompts, trie: ItemTrie, k: int, config: SpecConfig,
                  generator: torch.Generator | None) -> SpecResult:
    """Speculative beam search for one batch of users."""
    device = prompts.input_ids.device
    clock = _Clock(device)
    batch = len(prompts.lengths)
    stats = SpecStats.zeros(batch)
    started = clock.now()
    root_log_q, draft_cache = prefill(draft, prompts)
    target_cache = DynamicCache(config=target.config)
    caches = (target_cache, draft_cache)
    mark = clock.add("prefill", started)
    sampler = None if config.verify == "strict" else RelaxedSampler(config.temperature, generator, config.replacement)
    front = _root(prompts, trie)
    stats.draft_calls += 1
    out = TopK(items=torch.full((batch, k), -1, dtype=torch.int64, device=device),
               scores=torch.full((batch, k), -torch.inf, device=device),
               tokens=torch.zeros(batch, k, trie.depth, dtype=torch.int64, device=device),
               margin=torch.full((batch,), torch.inf, device=device))
    first = True
    while True:
        remaining = trie.depth - int(front.depth.min())
        drafted = min(config.gamma or remaining, remaining - 1)
        feed_last = drafted < remaining - 1  # a bonus step can then leave identifiers incomplete
        users = front.users.cpu()
        own_drafted = drafted_per_row(front.depth, trie.depth, drafted)
        mark = clock.now()
        level0 = _level_zero(front, prompts if first else None)
        levels = _draft(draft, draft_cache, level0, root_log_q if first else None, front, trie, config, k, sampler,
                        drafted, feed_last)
        mark = clock.add("draft", mark)
        log_p = _score(target, target_cache, levels, prompts if first else None)
        if first:
            require_full_attention(target_cache)
            require_full_attention(draft_cache)
        beams, parent_at, steps, accepted = _verify(front, levels, log_p, trie, k, sampler)
        mark = clock.add("verify", mark)
        front, _ = _advance(front, levels, beams, parent_at, steps)
        stats.accepted_steps[users] += accepted.cpu().float()
        stats.add_round(users, own_drafted, drafted - first + feed_last, sum(level.width for level in levels[first:]))
        first = False
        finished = front.depth >= trie.depth
        if bool(finished.any()):
            rows = front.users[finished]
            out.items[rows] = trie.items(front.beams.nodes[finished].reshape(-1)).view(-1, k)
            out.scores[rows] = front.beams.scores[finished]
            out.tokens[rows] = front.paths[finished]
            out.margin[rows] = front.beams.margin[finished]
            if bool(finished.all()):
                break
            front = _select_users(front, (~finished).nonzero()[:, 0], caches)
        front = _compact(front, caches)
    total = clock.now() - started
    stats.prefill_s += clock.seconds["prefill"] / batch
    stats.draft_s += clock.seconds["draft"] / batch
    stats.verify_s += clock.seconds["verify"] / batch
    stats.overhead_s += (total - sum(clock.seconds.values())) / batch
    return SpecResult(out if sampler is None else best_first(out), stats)


def check_config(config: SpecConfig, k: int, trie: ItemTrie) -> None:
    """Raise :class:`RecspecError` for settings no speculative search can serve."""
    if config.verify not in VERIFICATIONS:
        raise RecspecError(f"unknown verification {config.verify!r}; choose strict or relaxed")
    if config.verify == "strict" and config.draft_beams < k:
        raise RecspecError(f"draft beams N={config.draft_beams} must be at least k={k}: strict verification "
                           f"accepts a step only when all k target beams were drafted")
    if config.gamma is not None and not 1 <= config.gamma <= trie.depth - 1:
        raise RecspecError(f"gamma={config.gamma} is outside [1, {trie.depth - 1}]: an identifier of length "
                           f"{trie.depth} leaves at most {trie.depth - 1} steps to draft after the first")
    if config.verify == "relaxed":
        Warp(config.temperature).check()


def check_draft_vocabulary(target, draft) -> None:
    """Raise :class:`RecspecError` unless the draft's vocabulary is the target's."""
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise RecspecError(f"the draft's vocabulary ({draft_vocab}) differs from the target's ({target_vocab}); "
                           f"train the draft with the target's tokenizer")


def speculative_beam_search(
    target, draft, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    config: SpecConfig | None = None, batch_size: int | None = None,
) -> SpecResult:
    """Top-``k`` items per prompt by speculative beam search (see the module doc).

    ``target``, ``draft``: HF causal LMs over the same vocabulary (full-attention caches, custom
    4D masks); ``prompts``: one 1-D int tensor per user; batches of ``batch_size`` users (all if
    None) are left-padded with ``pad_token_id``. Strict verification returns what
    :func:`~recspec.decoding.beam.beam_search` returns; relaxed verification samples.
    """
    config = config or SpecConfig()
    validate_request(target, prompts, trie, k, pad_token_id, batch_size)
    check_config(config, k, trie)
    check_draft_vocabulary(target, draft)
    device = target.device
    trie = trie if trie.device == device else trie.to(device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    size = batch_size or len(prompts)
    with torch.inference_mode():
        parts = [_decode_batch(target, draft, left_pad(prompts[start:start + size], pad_token_id, device), trie, k,
                               config, generator)
                 for start in range(0, len(prompts), size)]
    return SpecResult(TopK.cat([part.topk for part in parts]), SpecStats.cat([part.stats for part in parts]))
