"""Top-K items by trie-constrained beam search and beam sampling, and the plain beam loop.

:func:`beam_search`, :func:`tree_beam_search` and the Hugging Face peer all return the same
:class:`~recspec.decoding.beams.TopK` (up to float noise, see *Ties* below):

* :func:`~recspec.decoding.hf_reference.hf_beam_search`: ``model.generate`` with ``num_beams=k``
  and a ``prefix_allowed_tokens_fn`` over the trie, the way LC-Rec and AtSpeed run inference. It
  prefills ``B * K`` copies of the prompts and applies the constraint in a Python loop over beams.
* :func:`beam_search`: prefills each prompt once (``B`` rows), then keeps one KV-cache row per beam.
* :func:`tree_beam_search`: prefills each prompt once and keeps ``B`` cache rows for good; each
  step appends a user's ``K`` beam tokens to its row as ``K`` tree nodes under tree attention
  (AtSpeed, Fig. 5a).

**Scoring, as transformers' ``_beam_search`` does it** (``generation/utils.py``, transformers 5.x):
at every step the logits of the last position are cast to float32 and ``log_softmax``-ed over the
*full* vocabulary; the prefix constraint then adds ``-inf`` to disallowed tokens (no
renormalisation over the allowed ones); each beam's running score is added; the best candidates
over all ``K * V`` (beam, token) pairs of a user are kept. Beam 0 starts at score 0 and beams
``1..K-1`` at ``-1e9``, so the first step effectively draws from one copy of the prompt. With
``length_penalty=0`` the returned ``sequences_scores`` are plain sums of the ``L`` log-probs. Our
decoders compute the same float32 sums in the same order (``score + log_prob`` per step).

**Fewer than K candidates.** When the live beams of a user have fewer than ``K`` trie children in
total (e.g. ``K`` above the number of first identifier tokens), HF fills the remaining beams with
copies of real prefixes scored about ``-1e9`` (from its ``-1e9`` initial beams), which can never
outrank a real hypothesis; our decoders fill them with dead beams scored ``-inf``. Either way the
real hypotheses are all kept, and since every trie prefix has a child and ``K <= num_items``, at
least ``K`` real items compete at the last step: the returned top-K are real items in both, and
equal.

**Ties.** Our decoders break exact ties deterministically: a stable sort over each user's
candidates, which are laid out by parent beam (best first) then token id, prefers the candidate of
the better parent, then the smaller token id (dead fillers come last). HF ranks with
``torch.topk``, whose order among equal scores is unspecified. Exact ties between different items
are measure-zero for float32 scores of a trained or randomly initialised model (less so for
bfloat16 logits), but scores closer than float32 noise (about 1e-6: HF prefills ``B * K`` rows and
attends per beam, we do not, so logits differ in the last bits) may come out in either order, in
the final ranking or, rarely, at the ``K``-th place of an intermediate step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from recspec.accel.lean_forward import forward_of
from recspec.decoding.beams import Beams, TopK, best_first, sampling_select, select_top_k
from recspec.decoding.cache import require_full_attention, select_rows
from recspec.decoding.prompts import Prompts, decode_in_batches
from recspec.decoding.scorer import forward_visible, next_log_probs, prefill, prefill_tree
from recspec.decoding.tree import child_rows, tree_position_ids
from recspec.decoding.warp import Warp
from recspec.hub import with_cache
from recspec.itemids.trie import ItemTrie


class PerBeamCache:
    """State of :func:`beam_search`: one KV-cache row per beam (``B * K`` rows).

    The prompt rows are copied once, from ``B`` to ``B * K`` rows, by the first :meth:`extend`
    (which selects row ``b`` for every beam of user ``b``); every later step copies the rows of the
    surviving parents (``index_select`` on each layer's keys and values).
    """

    def __init__(self, model, prompts: Prompts, k: int, cache, depth: int) -> None:
        """``cache``: the prefill's ``B``-row cache; ``depth``: ``L``, the identifier length."""
        batch, self.prompt_width = prompts.input_ids.shape
        self.model, self.cache, self.rows_per_user = model, cache, 1
        beam_mask = prompts.attention_mask.repeat_interleave(k, dim=0)
        self.attention_mask = torch.cat(  # [B*K, P + L - 1]; depth d uses the first P + d + 1
            (beam_mask, beam_mask.new_ones(batch * k, depth - 1)), dim=1
        )
        self.first_positions = prompts.lengths.repeat_interleave(k)[:, None]  # [B*K, 1]
        self.user_offsets = torch.arange(batch, device=beam_mask.device)[:, None]  # [B, 1]

    def extend(self, beams: Beams, depth: int) -> torch.Tensor:
        """Feed each beam's last token (depth ``depth``: ``0`` is the first generated token):
        float32 log-probs ``[B, K, V]`` of the token after each of the ``K`` beams."""
        batch, k = beams.parents.shape
        select_rows(self.cache, (self.user_offsets * self.rows_per_user + beams.parents).view(-1))
        self.rows_per_user = k
        logits = forward_of(self.model)(
            input_ids=beams.tokens[:, :, -1].reshape(batch * k, 1),
            attention_mask=self.attention_mask[:, : self.prompt_width + depth + 1],
            position_ids=self.first_positions + depth,
            **with_cache(self.model, self.cache),
            use_cache=True,
        ).logits
        return next_log_probs(logits[:, -1]).view(batch, k, -1)


class TreeCache:
    """State of :func:`tree_beam_search`: one KV-cache row per user (``B`` rows), never copied.

    Each step appends the ``K`` beams' newest tokens to their user's row as ``K`` tree nodes;
    ``rows`` holds what the last appended nodes see, bool ``[B, S, T]`` over all ``T`` cached
    positions (the prompt's real tokens for ``S = 1`` before the first step). Nodes of beams that
    were not continued stay in the cache, masked out for every later node (``T = P + K * depth``).
    Compacting them away with :func:`~recspec.decoding.cache.gather_positions` (a copy of every
    layer per step) was measured to make no difference on the ~25M-parameter CPU benchmark
    (attention over the whole cache is about 5% of a step there), so it is not done.
    """

    def __init__(self, model, prompts: Prompts, k: int, cache) -> None:
        """``cache``: the prefill's ``B``-row cache, whose layers must all be full attention."""
        require_full_attention(cache)
        self.model, self.cache = model, cache
        self.rows = prompts.attention_mask.bool()[:, None, :]
        depth_zero = torch.zeros(1, k, dtype=torch.int64, device=prompts.input_ids.device)
        self.first_positions = tree_position_ids(prompts.lengths, depth_zero)  # [B, K]

    def extend(self, beams: Beams, depth: int) -> torch.Tensor:
        """Feed each beam's last token (depth ``depth``: ``0`` is the first generated token) as a
        tree node: float32 log-probs ``[B, K, V]`` of the token after each of the ``K`` beams."""
        self.rows = child_rows(self.rows, beams.parents)
        return next_log_probs(forward_visible(self.model, self.cache, beams.tokens[:, :, -1], self.rows,
                                              self.first_positions + depth))


class RootTreeCache(TreeCache):
    """:class:`TreeCache` whose prefill call also fed the root's ``F`` children, the whole first
    identifier level, as tree nodes after the prompt (:func:`root_prefill`): the first step's
    beams are among them, so the log-probs after them are read from that call instead of costing a
    call of their own. The first two steps then take one target call, exactly (each child sees the
    prompt and itself at position ``prompt length``, as a depth-0 beam node does). It pays where a
    call's fixed cost exceeds what ``F - K`` more nodes in the prefill cost (a small batch and a
    narrow first level: 32 children on MovieLens, 91 on Beauty)."""

    def __init__(self, model, prompts: Prompts, k: int, cache, child_log_probs: torch.Tensor) -> None:
        """``cache``: the prefill's cache, the prompts' columns then the ``F`` children's;
        ``child_log_probs``: float32 ``[B, F, V]``, the log-probs after each child, kept until the
        first step has read its beams' (``B * F * V`` floats: 290 MB for 16 users, 91 children and
        an LLM's 49,152 tokens)."""
        super().__init__(model, prompts, k, cache)
        self.child_log_probs: torch.Tensor | None = child_log_probs

    def extend(self, beams: Beams, depth: int) -> torch.Tensor:
        """As :meth:`TreeCache.extend`; at depth 0 the beams' children were scored in the
        prefill: their log-probs ``[B, K, V]`` are gathered (the rest are let go), and each beam
        sees the prompt and its own node there."""
        if depth > 0:
            return super().extend(beams, depth)
        children, self.child_log_probs = self.child_log_probs, None
        assert children is not None, "the first step reads the root's children once"
        batch, k = beams.nodes.shape
        fanout, vocab = children.shape[1:]
        column = (beams.nodes - 1).clamp_(0, fanout - 1)  # depth-1 trie nodes are 1..F, in token order
        own = torch.nn.functional.one_hot(column, fanout).bool()  # [B, K, F]
        self.rows = torch.cat((self.rows.expand(batch, k, -1), own), dim=2)
        return children.gather(1, column[:, :, None].expand(batch, k, vocab))


def root_prefill(model, prompts: Prompts, trie: ItemTrie, k: int) -> tuple[torch.Tensor, RootTreeCache]:
    """The prompts and the root's ``F`` children in one call: the first step's log-probs
    ``[B, 1, V]`` and the :class:`RootTreeCache` that holds the children's."""
    batch = prompts.input_ids.shape[0]
    tokens = trie.first_tokens()[None].expand(batch, -1)  # [B, F]
    visible = child_rows(prompts.attention_mask.bool()[:, None, :], torch.zeros_like(tokens))  # prompt, self
    positions = tree_position_ids(prompts.lengths, torch.zeros_like(tokens))
    log_probs, cache = prefill_tree(model, prompts, tokens, visible, positions)
    return log_probs[:, :1], RootTreeCache(model, prompts, k, cache, log_probs[:, 1:])


def beam_decode(
    make_state: Callable[..., PerBeamCache | TreeCache], model, prompts: Prompts, trie: ItemTrie,
    k: int, select: Callable[[Beams, torch.Tensor, ItemTrie, int], Beams] = select_top_k,
    root: bool = False,
) -> TopK:
    """Beam search for one batch: prefill, then ``L`` steps ``select(beams, log_probs, trie, k)``
    (the top-k by default, or a sampling step) with ``L - 1`` model calls in between, through the
    state ``make_state(model, prompts, k, cache)`` (a :class:`PerBeamCache` or a
    :class:`TreeCache`); with ``root`` (tree attention only) the prefill also scores the first
    level, so the calls are ``L - 2`` (:class:`RootTreeCache`)."""
    if root:
        log_probs, state = root_prefill(model, prompts, trie, k)
        return beam_steps(log_probs, state, trie, k, select).result(trie)
    log_probs, cache = prefill(model, prompts)
    return beam_steps(log_probs, make_state(model, prompts, k, cache), trie, k, select).result(trie)


def beam_steps(
    log_probs: torch.Tensor, state, space, k: int,
    select: Callable[[Beams, torch.Tensor, ItemTrie, int], Beams] = select_top_k,
    stop: Callable[[Beams], bool] | None = None,
) -> Beams:
    """The plain beam loop (search or sampling, items or text): up to ``space.depth`` steps from
    the first token's log-probs ``[B, 1, V]``: ``select`` the beams, then, unless ``stop(beams)``
    (every row finished), ``state.extend(beams, depth)`` gives the next log-probs ``[B, K, V]``."""
    beams = Beams.start(log_probs.shape[0], space)
    for depth in range(space.depth):
        beams = select(beams, log_probs, space, k)
        if depth + 1 == space.depth or (stop is not None and stop(beams)):
            break
        log_probs = state.extend(beams, depth)
    return beams


def beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None = None,
) -> TopK:
    """Top-``k`` items per prompt by trie-constrained beam search with one cache row per beam.

    Same results as :func:`~recspec.decoding.hf_reference.hf_beam_search` (see the module doc).
    Prefills each batch of ``B`` prompts once (``B`` rows, where HF prefills ``B * K``), takes the
    first step's top-``k`` from that row, copies the prompt cache to ``B * K`` beam rows once,
    then per step feeds one token per beam, selects the top-``k`` of each user's ``[K * C]``
    trie-child candidates in one vectorised step and reorders the cache rows by the chosen parents.
    """
    decode = partial(beam_decode, partial(PerBeamCache, depth=trie.depth))
    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)


def tree_beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None = None, root: bool = False,
) -> TopK:
    """Top-``k`` items per prompt by trie-constrained beam search with tree attention.

    Same results as :func:`~recspec.decoding.hf_reference.hf_beam_search` (see the module doc).
    Prefills each batch of ``B`` prompts once and keeps ``B`` cache rows: each step feeds the
    ``k`` beams' newest tokens as ``[B, k]`` with a mask ``[B, 1, k, T + k]`` in which each node
    sees its user's real prompt tokens, its ancestors and itself, at position ``prompt length + depth``
    (:mod:`recspec.decoding.tree`). Needs a model whose cache layers are all full attention and
    which accepts a custom 4D float mask (transformers 5 models built on ``create_causal_mask``).
    With ``root`` the prefill also feeds the first identifier level whole (:class:`RootTreeCache`):
    one call fewer, the same results.
    """
    decode = partial(beam_decode, TreeCache, root=root)
    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)


def sampling_beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int, temperature: float = 1.0,
    seed: int = 0, replacement: bool = False, batch_size: int | None = None, root: bool = False,
) -> TopK:
    """``k`` items per prompt by the target's own beam sampling at ``temperature`` (the
    distribution relaxed verification approximates; see the module doc), with tree attention as
    :func:`tree_beam_search` (``root`` as there). Results best first (by the model's joint
    log-probability); ``seed`` fixes the draws."""
    warp = Warp(temperature)
    warp.check()
    select = sampling_select(warp, torch.Generator(device=model.device).manual_seed(seed), replacement)

    def decode(model, prompts: Prompts, trie: ItemTrie, k: int) -> TopK:
        return best_first(beam_decode(TreeCache, model, prompts, trie, k, select, root))

    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)
