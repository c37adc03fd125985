"""Top-K items by trie-constrained beam search: the Hugging Face peer and recspec's two decoders.

All three return the same :class:`TopK` (up to float noise, see *Ties* below):

* :func:`hf_beam_search`: ``model.generate`` with ``num_beams=k`` and a ``prefix_allowed_tokens_fn``
  over the trie, the way LC-Rec and AtSpeed run inference. It prefills ``B * K`` copies of the
  prompts and applies the constraint in a Python loop over beams.
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

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
from transformers import GenerationConfig

from recspec.decoding.cache import require_full_attention, select_rows
from recspec.decoding.scorer import next_log_probs
from recspec.decoding.topk import TopK
from recspec.decoding.tree import additive_mask, append_children, self_only_rows, tree_position_ids
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie
from recspec.hub import keep_last_logits

R = TypeVar("R")


@dataclass(frozen=True)
class Prompts:
    """A batch of ``B`` prompts, left-padded to width ``P`` as Hugging Face generate expects.

    ``input_ids``: int64 ``[B, P]``, each prompt right-aligned after ``pad_token_id``s;
    ``attention_mask``: int64 ``[B, P]``, 1 on real tokens; ``position_ids``: int64 ``[B, P]``,
    a token's index among its row's real tokens (``cumsum(attention_mask) - 1``, 0 on padding, as
    generate computes them); ``lengths``: int64 ``[B]``, the number of real tokens, which is also
    the position id of the first generated token.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    pad_token_id: int


def left_pad(prompts: Sequence[torch.Tensor], pad_token_id: int, device: torch.device) -> Prompts:
    """Left-pad 1-D non-empty token-id tensors into one :class:`Prompts` batch on ``device``."""
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    width = int(lengths.max())
    real = torch.arange(width) >= (width - lengths)[:, None]
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    input_ids[real] = torch.cat([prompt.to("cpu", torch.int64) for prompt in prompts])
    position_ids = (real.long().cumsum(dim=1) - 1).masked_fill_(~real, 0)
    return Prompts(
        input_ids=input_ids.to(device),
        attention_mask=real.long().to(device),
        position_ids=position_ids.to(device),
        lengths=lengths.to(device),
        pad_token_id=pad_token_id,
    )


# ------------------------------------------------------------------------- candidate selection


@dataclass(frozen=True)
class Beams:
    """The live hypotheses of ``B`` users after ``d`` decoding steps, ``S`` per user, best first
    (``S = 1`` before the first step: the empty prefix; ``K`` afterwards).

    ``scores``: float32 ``[B, S]``, summed log-probs, ``-inf`` for a dead beam (a filler when the
    user had fewer than ``K`` candidates); ``nodes``: int64 ``[B, S]``, the trie node of each
    prefix, ``-1`` when dead; ``tokens``: int64 ``[B, S, d]``, the prefixes; ``parents``: int64
    ``[B, S]``, the index in ``[0, S_prev)`` of the previous step's beam each one extends;
    ``margin``: float32 ``[B]``, the smallest gap so far between the K-th kept and the best
    dropped candidate (see :class:`TopK`).
    """

    scores: torch.Tensor
    nodes: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    margin: torch.Tensor

    @staticmethod
    def start(batch_size: int, trie: ItemTrie) -> Beams:
        """One empty prefix (the trie's root, score 0) per user."""
        zeros = torch.zeros(batch_size, 1, dtype=torch.int64, device=trie.device)
        return Beams(
            scores=torch.zeros(batch_size, 1, dtype=torch.float32, device=trie.device),
            nodes=zeros + trie.root,
            tokens=zeros.new_zeros(batch_size, 1, 0),
            parents=zeros,
            margin=torch.full((batch_size,), torch.inf, device=trie.device),
        )

    def result(self, trie: ItemTrie) -> TopK:
        """The beams as the final :class:`TopK` (call after ``L`` steps, when they are leaves)."""
        return TopK(items=trie.items(self.nodes), scores=self.scores, tokens=self.tokens, margin=self.margin)


def select_top_k(beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, k: int) -> Beams:
    """One beam-search step: the ``k`` best one-token continuations of ``beams`` within the trie.

    ``log_probs``: float32 ``[B, S, V]``, the next-token log-probabilities (log-softmax over the
    full vocabulary) after each beam's prefix. The candidates are the trie children of every beam,
    ``[B, S * C]`` with ``C`` the largest fan-out among the beams, scored ``beam score + log-prob``
    (``-inf`` for padding slots and children of dead beams); one stable descending sort per user
    keeps the ``k`` best, best first (exact ties: better parent, then smaller token). Fully
    vectorised: no Python loop over users, beams or tokens.
    """
    batch, width = beams.nodes.shape
    tokens, real = trie_children(trie, beams.nodes.view(-1), min_count=-(-k // width))  # [B*S, C]
    fanout = tokens.shape[1]
    step_log_probs = log_probs.reshape(batch * width, -1).gather(1, tokens)
    candidates = (beams.scores.reshape(-1, 1) + step_log_probs).masked_fill_(~real, -torch.inf)
    ranked, index = candidates.view(batch, width * fanout).sort(dim=1, descending=True, stable=True)
    scores, index = ranked[:, :k], index[:, :k]
    margin = beams.margin
    if ranked.shape[1] > k:  # a real (finite) dropped candidate narrows the margin
        gap = torch.where(ranked[:, k].isfinite(), ranked[:, k - 1] - ranked[:, k], torch.inf)
        margin = torch.minimum(margin, gap)
    parents = index // fanout
    chosen = tokens.view(batch, width * fanout).gather(1, index)
    nodes = trie.step(beams.nodes.gather(1, parents).view(-1), chosen.view(-1)).view(batch, k)
    history = beams.tokens.gather(1, parents[:, :, None].expand(-1, -1, beams.tokens.shape[2]))
    return Beams(
        scores=scores,
        nodes=nodes.masked_fill_(scores.isneginf(), -1),
        tokens=torch.cat((history, chosen[:, :, None]), dim=2),
        parents=parents,
        margin=margin,
    )


def trie_children(
    trie: ItemTrie, nodes: torch.Tensor, min_count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``trie.children(nodes)``, ``[N, C]`` tokens and real flags, padded to at least
    ``min_count`` columns so that a user's ``S * C`` candidates are never fewer than ``k``."""
    tokens, real = trie.children(nodes)
    missing = min_count - tokens.shape[1]
    if missing > 0:
        tokens = torch.nn.functional.pad(tokens, (0, missing))
        real = torch.nn.functional.pad(real, (0, missing))
    return tokens, real


# ----------------------------------------------------------------------------- model calls


def prefill(model, prompts: Prompts):
    """Run the prompts once: ``(log_probs [B, 1, V] of the first generated token, KV cache)``."""
    out = model(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        position_ids=prompts.position_ids,
        use_cache=True,
        **keep_last_logits(model, 1),
    )
    return next_log_probs(out.logits[:, -1:]), out.past_key_values


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
        logits = self.model(
            input_ids=beams.tokens[:, :, -1].reshape(batch * k, 1),
            attention_mask=self.attention_mask[:, : self.prompt_width + depth + 1],
            position_ids=self.first_positions + depth,
            past_key_values=self.cache,
            use_cache=True,
        ).logits
        return next_log_probs(logits[:, -1]).view(batch, k, -1)


class TreeCache:
    """State of :func:`tree_beam_search`: one KV-cache row per user (``B`` rows), never copied.

    Each step appends the ``K`` beams' newest tokens to their user's row as ``K`` tree nodes;
    ``rows`` holds the additive mask rows ``[B, S, T]`` of the last appended nodes over all ``T``
    cached positions (the prompt's for ``S = 1`` before the first step). Nodes of beams that were
    not continued stay in the cache, masked out for every later node (``T = P + K * depth``).
    Compacting them away with :func:`~recspec.decoding.cache.gather_positions` (a copy of every
    layer per step) was measured to make no difference on the ~25M-parameter CPU benchmark
    (attention over the whole cache is about 5% of a step there), so it is not done.
    """

    def __init__(self, model, prompts: Prompts, k: int, cache) -> None:
        """``cache``: the prefill's ``B``-row cache, whose layers must all be full attention."""
        require_full_attention(cache)
        self.model, self.cache = model, cache
        self.rows = additive_mask(prompts.attention_mask.bool(), model.dtype)[:, None, :]
        self.self_rows = self_only_rows(k, model.dtype, prompts.input_ids.device)
        depth_zero = torch.zeros(1, k, dtype=torch.int64, device=prompts.input_ids.device)
        self.first_positions = tree_position_ids(prompts.lengths, depth_zero)  # [B, K]

    def extend(self, beams: Beams, depth: int) -> torch.Tensor:
        """Feed each beam's last token (depth ``depth``: ``0`` is the first generated token) as a
        tree node: float32 log-probs ``[B, K, V]`` of the token after each of the ``K`` beams."""
        self.rows = append_children(self.rows, beams.parents, self.self_rows)
        logits = self.model(
            input_ids=beams.tokens[:, :, -1],
            attention_mask=self.rows[:, None],
            position_ids=self.first_positions + depth,
            past_key_values=self.cache,
            use_cache=True,
        ).logits
        return next_log_probs(logits)


# -------------------------------------------------------------------------------- decoders


def beam_decode(
    make_state: Callable[..., PerBeamCache | TreeCache], model, prompts: Prompts, trie: ItemTrie,
    k: int, select: Callable[[Beams, torch.Tensor, ItemTrie, int], Beams] = select_top_k,
) -> TopK:
    """Beam search for one batch: prefill, then ``L`` steps ``select(beams, log_probs, trie, k)``
    (the top-k by default, or a sampling step) with ``L - 1`` model calls in between, through the
    state ``make_state(model, prompts, k, cache)`` (a :class:`PerBeamCache` or a
    :class:`TreeCache`)."""
    log_probs, cache = prefill(model, prompts)
    return beam_steps(log_probs, make_state(model, prompts, k, cache), trie, k, select)


def beam_steps(
    log_probs: torch.Tensor, state, trie: ItemTrie, k: int,
    select: Callable[[Beams, torch.Tensor, ItemTrie, int], Beams] = select_top_k,
) -> TopK:
    """The ``L`` steps of beam search from the first token's log-probs ``[B, 1, V]``: ``select``
    the beams, then ``state.extend(beams, depth)`` gives the next log-probs ``[B, K, V]``."""
    beams = Beams.start(log_probs.shape[0], trie)
    for depth in range(trie.depth):
        beams = select(beams, log_probs, trie, k)
        if depth + 1 < trie.depth:
            log_probs = state.extend(beams, depth)
    return beams.result(trie)


def _hf_decode(
    allowed: dict[tuple[int, ...], list[int]], model, prompts: Prompts, trie: ItemTrie, k: int
) -> TopK:
    """``model.generate`` beam search for one batch, constrained by the ``allowed`` table."""
    batch, width = prompts.input_ids.shape
    depth = trie.depth

    def prefix_allowed_tokens(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        return allowed[tuple(input_ids[width:].tolist())]

    settings = dict(max_new_tokens=depth, do_sample=False, pad_token_id=prompts.pad_token_id,
                    repetition_penalty=1.0, no_repeat_ngram_size=0, return_dict_in_generate=True)
    if k == 1:  # generate runs greedy search, which returns raw logits instead of beam scores
        config = GenerationConfig(num_beams=1, output_logits=True, **settings)
    else:
        config = GenerationConfig(num_beams=k, num_return_sequences=k, length_penalty=0.0,
                                  early_stopping=True, output_scores=True, **settings)
    out = model.generate(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        generation_config=config,
        prefix_allowed_tokens_fn=prefix_allowed_tokens,
    )
    tokens = out.sequences[:, width:]  # [B*K, L]
    if k == 1:
        scores = torch.zeros(batch, dtype=torch.float32, device=tokens.device)
        for step, logits in enumerate(out.logits):
            scores = scores + next_log_probs(logits).gather(1, tokens[:, step : step + 1])[:, 0]
    else:
        scores = out.sequences_scores.float()
    return TopK(
        items=trie.items(trie.walk(tokens)).view(batch, k),
        scores=scores.view(batch, k),
        tokens=tokens.reshape(batch, k, depth),
    )


_ALLOWED_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _allowed_tokens_table(trie: ItemTrie) -> dict[tuple[int, ...], list[int]]:
    """Every non-leaf prefix of the trie -> its allowed next tokens (sorted), built once per trie
    (as LC-Rec precomputes its prefix table), so HF's constraint is a dict lookup per beam."""
    if trie not in _ALLOWED_TABLES:
        table = {}
        nodes, prefixes = torch.tensor([trie.root], device=trie.device), [()]
        for _ in range(trie.depth):
            tokens, real = trie.children(nodes)
            for prefix, row, keep in zip(prefixes, tokens.tolist(), real.tolist()):
                table[prefix] = [token for token, ok in zip(row, keep) if ok]
            parent, slot = real.nonzero(as_tuple=True)
            child_tokens = tokens[parent, slot]
            nodes = trie.step(nodes[parent], child_tokens)
            prefixes = [prefixes[p] + (t,) for p, t in zip(parent.tolist(), child_tokens.tolist())]
        _ALLOWED_TABLES[trie] = table
    return _ALLOWED_TABLES[trie]


def prompt_batches(prompts: Sequence[torch.Tensor], pad_token_id: int, device: torch.device,
                   batch_size: int | None) -> Iterator[Prompts]:
    """Consecutive batches of ``batch_size`` prompts (all at once if None), left-padded on ``device``."""
    size = batch_size or len(prompts)
    for start in range(0, len(prompts), size):
        yield left_pad(prompts[start:start + size], pad_token_id, device)


def decode_batches(model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
                   batch_size: int | None, decode: Callable[[Prompts, ItemTrie], R],
                   check: Callable[[], None] | None = None) -> list[R]:
    """Validate the request (then the decoder's own ``check``), then ``decode(batch, trie)`` every
    batch of prompts (the trie on the model's device, no autograd): the one batch wrapper of the
    item decoders."""
    validate_request(model, prompts, trie, k, pad_token_id, batch_size)
    if check is not None:
        check()
    device = model.device
    trie = trie if trie.device == device else trie.to(device)
    with torch.inference_mode():
        return [decode(batch, trie) for batch in prompt_batches(prompts, pad_token_id, device, batch_size)]


def decode_in_batches(
    decode: Callable[..., TopK],
    model,
    prompts: Sequence[torch.Tensor],
    trie: ItemTrie,
    k: int,
    pad_token_id: int,
    batch_size: int | None,
) -> TopK:
    """Validate, then run ``decode(model, Prompts, trie, k)`` on consecutive batches of
    ``batch_size`` users (all at once if None) and concatenate the results."""
    return TopK.cat(decode_batches(model, prompts, trie, k, pad_token_id, batch_size,
                                   lambda batch, on_device: decode(model, batch, on_device, k)))


def validate_request(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None,
) -> None:
    """Raise :class:`RecspecError` for arguments no decoder can serve."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RecspecError(f"k must be a positive integer, got {k!r}")
    if k > trie.num_items:
        raise RecspecError(f"k={k} exceeds the number of items in the trie ({trie.num_items}); "
                           f"ask for at most {trie.num_items}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise RecspecError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    if len(prompts) == 0:
        raise RecspecError("no prompts given: pass one 1-D tensor of token ids per user")
    vocab_size = model.config.get_text_config().vocab_size
    if trie.vocab_size > vocab_size:
        raise RecspecError(f"the trie's vocabulary ({trie.vocab_size} tokens) is larger than the "
                           f"model's ({vocab_size}); build the trie for this model's tokens")
    if not 0 <= pad_token_id < vocab_size:
        raise RecspecError(f"pad_token_id {pad_token_id} is outside the model's vocabulary "
                           f"[0, {vocab_size})")
    for i, prompt in enumerate(prompts):
        if (not isinstance(prompt, torch.Tensor) or prompt.dim() != 1
                or prompt.dtype.is_floating_point or prompt.dtype.is_complex
                or prompt.dtype == torch.bool):
            raise RecspecError(f"prompt {i} must be a 1-D tensor of integer token ids, got "
                               f"{type(prompt).__name__} {getattr(prompt, 'shape', '')}")
        if prompt.numel() == 0:
            raise RecspecError(f"prompt {i} is empty: every user needs at least one prompt token")
    tokens = torch.cat([prompt.to("cpu", torch.int64) for prompt in prompts])
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise RecspecError(f"prompt token ids must lie in the model's vocabulary "
                           f"[0, {vocab_size}), got ids from {low} to {high}")


# ---------------------------------------------------------------------------- public API


def hf_beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None = None,
) -> TopK:
    """Top-``k`` items per prompt by transformers' ``model.generate`` beam search (the peer).

    ``num_beams=k, num_return_sequences=k, max_new_tokens=L, do_sample=False,
    length_penalty=0.0, early_stopping=True`` and a ``prefix_allowed_tokens_fn`` that maps the
    generated suffix to the trie's allowed tokens (a precomputed dict, as in LC-Rec); ``k = 1`` is
    generate's greedy search, scored from its raw logits. Other settings of the model's
    ``generation_config`` still apply (e.g. its ``eos_token_id``, harmless unless it is an
    identifier token); ``repetition_penalty`` and ``no_repeat_ngram_size`` are neutralised.

    ``prompts``: one 1-D int tensor per user (lengths may differ); batches of ``batch_size`` users
    (all if None) are left-padded with ``pad_token_id``.
    """
    decode = partial(_hf_decode, _allowed_tokens_table(trie))
    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)


def beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None = None,
) -> TopK:
    """Top-``k`` items per prompt by trie-constrained beam search with one cache row per beam.

    Same results as :func:`hf_beam_search` (see the module doc). Prefills each batch of ``B``
    prompts once (``B`` rows, where HF prefills ``B * K``), takes the first step's top-``k`` from
    that row, copies the prompt cache to ``B * K`` beam rows once, then per step feeds one token
    per beam, selects the top-``k`` of each user's ``[K * C]`` trie-child candidates in one
    vectorised step and reorders the cache rows by the chosen parents.
    """
    decode = partial(beam_decode, partial(PerBeamCache, depth=trie.depth))
    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)


def tree_beam_search(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None = None,
) -> TopK:
    """Top-``k`` items per prompt by trie-constrained beam search with tree attention.

    Same results as :func:`hf_beam_search` (see the module doc). Prefills each batch of ``B``
    prompts once and keeps ``B`` cache rows: each step feeds the ``k`` beams' newest tokens as
    ``[B, k]`` with an additive 4D mask ``[B, 1, k, T + k]`` in which each node sees its user's
    real prompt tokens, its ancestors and itself, at position ``prompt length + depth``
    (:mod:`recspec.decoding.tree`). Needs a model whose cache layers are all full attention and
    which accepts a custom 4D float mask (transformers 5 models built on ``create_causal_mask``).
    """
    decode = partial(beam_decode, TreeCache)
    return decode_in_batches(decode, model, prompts, trie, k, pad_token_id, batch_size)
