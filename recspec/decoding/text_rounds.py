"""The text round loop: speculative decoding of free text over drafted token trees, for a batch of
prompts (LASER's retrieval, ReSD, a text head's EAGLE-2 trees, a hybrid of both, spec-sample over
trees, and plain greedy decoding or plain sampling, which draft nothing).

:func:`generate_texts` prefills the prompts once (left-padded), takes the target's own token after
each (:class:`~recspec.decoding.acceptance.TreeAcceptance`: greedy, relaxed or drawn), and then
repeats one *round* per target call until every row has an end-of-sequence token or
``max_new_tokens``:

1. draft: each row's :class:`TextSession` proposes a token tree after its current text
   (:class:`DraftTree`, ``N_b - 1`` nodes; none for plain decoding);
2. score: every row's last committed token (its *root*, not yet in the KV cache) and draft nodes
   are scored in one forward pass over the batch's cache with tree attention
   (:func:`~recspec.decoding.scorer.score_tree`); shorter trees are padded with roots that nothing
   descends from, and each row attends to its own cached positions only;
3. verify: the acceptance rule passes nodes, and each row keeps the deepest draft path whose
   tokens all pass (:func:`~recspec.decoding.acceptance.accepted_path`); the accepted tokens and
   the target's own token after them are committed;
4. advance: a session that reads features learns the target's at the row's kept positions
   (:meth:`TextSession.observe`);
5. compact: the cache keeps each row's accepted path (:func:`~recspec.decoding.cache.compact`,
   which copies only the tail past what every row keeps); finished rows leave the batch.

A row's tokens depend on its own prompt, drafts and uniforms only, so a batch writes each row's
text as that prompt alone does (up to the rounding of a batched call against a single one). A
batch of one runs the very computation of a single request: no padding, every cached position
visible. With sampling, each row's uniforms (one per text position) come from the generator in
row order, as requests decoded one after another draw them.

Every step is a Python iteration over decoding steps (and over the rows' drafting sessions, which
are per-request Python objects: tries, a head's cache); tree masks, positions, verification and
cache compaction are tensor operations over the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from recspec.decoding.acceptance import GreedyAcceptance, TreeAcceptance, accepted_path
from recspec.decoding.cache import compact, require_full_attention, select_rows
from recspec.decoding.prompts import Prompts, left_pad
from recspec.decoding.scorer import score_tree, score_tree_features
from recspec.decoding.tree import ancestor_matrix, node_depths
from recspec.errors import RecspecError
from recspec.hub import keep_logits_at, returned_cache
from recspec.models.text_head import layer_features


@dataclass(frozen=True)
class DraftTree:
    """``N`` draft nodes: ``tokens[i]`` and ``parents[i]`` in ``[-1, i)`` (``-1``: continues the
    current text directly); best-first order, so every parent precedes its children."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def longest_branch(self) -> int:
        """Depth of the deepest node (0 for an empty draft)."""
        depth = [0] * len(self.parents)
        for i, parent in enumerate(self.parents):
            depth[i] = 1 + (depth[parent] if parent >= 0 else 0)
        return max(depth, default=0)


@dataclass
class Generation:
    """One generated text and how it was produced.

    ``tokens``: the generated token ids, the end-of-sequence token included when the model emitted
    it (as ``generate`` returns them); ``calls``: target forward calls, the prefill included;
    ``accepted``: accepted draft tokens kept in the text (``len(tokens) - calls``: every call
    commits one token of its own); ``drafted``: draft nodes scored in total;
    ``ceiling_tokens``: tokens the same calls would have produced had every step accepted its
    longest draft branch (``1 + sum(longest branch + 1)`` over steps); ``retrieval_s``: seconds
    spent drafting (retrieving drafts and growing the temporary branches, or a head's calls);
    ``prefill_s``: the first target call (the prompt); ``wall_s``: the whole request, prefill
    included. A batch shares its prefill and wall seconds: each text gets them divided by the
    batch size.
    """

    tokens: list[int]
    prompt_tokens: int
    calls: int
    accepted: int
    drafted: int
    ceiling_tokens: int
    retrieval_s: float
    prefill_s: float
    wall_s: float

    @property
    def aal(self) -> float:
        """Average acceptance length: tokens per target call (accepted draft tokens + 1)."""
        return len(self.tokens) / max(1, self.calls)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second after the prefill (the decoding phase alone)."""
        seconds = self.wall_s - self.prefill_s
        return (len(self.tokens) - 1) / seconds if seconds > 0 else 0.0


class TextSession:
    """One request's drafting state, the text loop's drafter: :meth:`propose` drafts a tree after
    the request's text; a session that reads the target's features (``wants_features``: a text
    head's, :mod:`recspec.knowledge.head_draft`) learns from what was accepted through
    :meth:`observe`, which receives the target's features at the positions each call keeps,
    before the next :meth:`propose`. Sessions that need nothing back keep the defaults."""

    wants_features = False

    def propose(self, text: list[int], max_depth: int) -> DraftTree:
        """A draft tree, at most ``max_depth`` deep, after ``text`` (prompt and generated tokens)."""
        raise NotImplementedError

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's decoder layers whose outputs the features carry before its top feature
        (:func:`~recspec.models.text_head.layer_features`; empty: the top feature alone)."""
        return ()

    def observe(self, features: torch.Tensor, start: int) -> None:
        """The target's features ``[n, H * (len(feature_layers) + 1)]`` at text positions ``start ..
        start + n - 1``: the prompt after the prefill, the root and the accepted path after every
        round (only where ``wants_features``)."""


def prefill_prompts(model, prompts: Prompts, features: bool, layers: Sequence[int] = ()
                    ) -> tuple[torch.Tensor, object, torch.Tensor | None]:
    """Run the left-padded prompts once: ``(the logits after each [B, V], cache, the last hidden
    states [B, P, H] (with the outputs of ``layers`` before them,
    :func:`~recspec.models.text_head.layer_features`) when ``features``, else None)``; only the
    last column's logits are computed where the model supports ``logits_to_keep``. An unpadded
    batch is fed without a mask (the model's own causal attention)."""
    padded = not bool(prompts.attention_mask.all())
    out = model(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask if padded else None,
                position_ids=prompts.position_ids if padded else None, use_cache=True,
                output_hidden_states=features, **keep_logits_at(model, 1))
    cache = returned_cache(out)
    require_full_attention(cache)
    read = layer_features(model, out.hidden_states, layers) if features else None
    return out.logits[:, -1], cache, read


def finish_text(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Cut ``tokens`` after the first end-of-sequence token or at ``max_new_tokens``; True if done."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return tokens[:i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def check_prompt(prompt: Sequence[int], max_new_tokens: int) -> None:
    if len(prompt) == 0:
        raise RecspecError("empty prompt: knowledge generation needs at least one prompt token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RecspecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def tree_block(roots: list[int], drafts: list[DraftTree], device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's fed nodes, int64 ``(tokens [B, N], parents [B, N])``: each row's root (node 0) and
    draft nodes (renumbered after it), padded to the longest tree with roots (parent -1) of token
    0 that nothing descends from."""
    width = 1 + max(len(draft) for draft in drafts)
    tokens = [[root, *draft.tokens] + [0] * (width - 1 - len(draft)) for root, draft in zip(roots, drafts)]
    parents = [[-1, *(p + 1 for p in draft.parents)] + [-1] * (width - 1 - len(draft)) for draft in drafts]
    return torch.tensor(tokens, device=device), torch.tensor(parents, device=device)


@torch.inference_mode()
def generate_texts(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: frozenset[int],
                   sessions: Sequence[TextSession] | None = None,
                   acceptance: TreeAcceptance = GreedyAcceptance(),
                   generator: torch.Generator | None = None, pad_token_id: int = 0) -> list[Generation]:
    """Generate after each of ``prompts`` (token ids, chat template applied) in one batch, row ``b``
    drafted by ``sessions[b]`` (None: plain decoding) and verified by ``acceptance``; see the module
    doc. Sessions that want features get the target's at every kept position. Sampling draws each
    row's uniforms, one per text position, from ``generator`` (a CPU generator; None: one seeded 0)
    before decoding, row after row. ``pad_token_id`` fills the left padding (never attended to)."""
    for prompt in prompts:
        check_prompt(prompt, max_new_tokens)
    started = time.perf_counter()
    batch = left_pad([torch.tensor(list(prompt)) for prompt in prompts], pad_token_id, model.device)
    device = batch.input_ids.device
    uniforms = None
    if acceptance.draws:
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        uniforms = torch.stack([torch.rand(max_new_tokens, generator=generator, dtype=torch.float64)
                                for _ in prompts]).to(device)  # [B, max_new_tokens]
    observing = sessions is not None and any(session.wants_features for session in sessions)
    layers = next(session.feature_layers for session in sessions if session.wants_features) if observing else ()
    tick = time.perf_counter()
    first, cache, prompt_features = prefill_prompts(model, batch, observing, layers)
    roots = acceptance.choices(first[:, None], None if uniforms is None else uniforms[:, :1])[:, 0].tolist()
    prefill_s = (time.perf_counter() - tick) / len(prompts)
    visible = batch.attention_mask.bool()  # [B, W]: the cached positions holding each row's text
    count = batch.lengths.clone()  # [B]: each row's cached text tokens, the position of its root
    rows = list(range(len(prompts)))  # the batch's rows, by request
    width = batch.input_ids.shape[1]
    if sessions is not None and prompt_features is not None:
        for row, session in enumerate(sessions):
            if session.wants_features:
                session.observe(prompt_features[row, width - len(prompts[row]):], 0)
    generated, done = map(list, zip(*(finish_text([root], max_new_tokens, eos) for root in roots)))
    calls, drafted, ceiling, retrieval_s = ([n] * len(prompts) for n in (1, 0, 1, 0.0))
    while True:
        if any(done[request] for request in rows):
            stay = [i for i, request in enumerate(rows) if not done[request]]
            if not stay:
                break
            index = torch.tensor(stay, device=device)
            select_rows(cache, index)
            visible, count, rows = visible[index], count[index], [rows[i] for i in stay]
            uniforms = None if uniforms is None else uniforms[index]
        texts = [list(prompts[request]) + generated[request] for request in rows]
        drafts = [DraftTree([], []) for _ in rows]
        if sessions is not None:
            for i, request in enumerate(rows):
                tick = time.perf_counter()
                drafts[i] = sessions[request].propose(texts[i], max_new_tokens - len(generated[request]) - 1)
                retrieval_s[request] += time.perf_counter() - tick
        tokens, parents = tree_block([text[-1] for text in texts], drafts, device)  # [B, N]
        ancestors = ancestor_matrix(parents)
        tree = (model, cache, tokens, ancestors, visible, count)
        logits, features = score_tree_features(*tree, layers) if observing else (score_tree(*tree), None)
        # the uniforms of the positions the nodes' next tokens fill (sampling)
        lengths = torch.tensor([len(generated[request]) for request in rows], device=device)
        at = None if uniforms is None else uniforms.gather(1, lengths[:, None] + node_depths(ancestors))
        choices = acceptance.choices(logits, at)
        last, path = accepted_path(acceptance.accept(tokens, parents, logits, choices), ancestors)
        positions, filled = compact([cache], torch.cat((torch.ones_like(visible), path), dim=1))
        visible = torch.cat((visible, path), dim=1).gather(1, positions) & filled
        kept, own = path.sum(dim=1), choices.gather(1, last[:, None])[:, 0]
        for i, request in enumerate(rows):
            nodes = path[i].nonzero()[:, 0]  # path order: parents precede children
            if features is not None and sessions[request].wants_features:
                sessions[request].observe(features[i, nodes], int(count[i]))
            new = tokens[i, nodes[1:]].tolist() + [int(own[i])]
            calls[request], drafted[request] = calls[request] + 1, drafted[request] + len(drafts[i])
            ceiling[request] += drafts[i].longest_branch() + 1
            generated[request], done[request] = finish_text(generated[request] + new, max_new_tokens, eos)
        count = count + kept
    wall_s = (time.perf_counter() - started) / len(prompts)
    return [Generation(tokens=tokens, prompt_tokens=len(prompt), calls=calls[b], accepted=len(tokens) - calls[b],
                       drafted=drafted[b], ceiling_tokens=ceiling[b], retrieval_s=retrieval_s[b], prefill_s=prefill_s,
                       wall_s=wall_s) for b, (prompt, tokens) in enumerate(zip(prompts, generated))]


class TextDrafter(Protocol):
    """What drafts a request: a :class:`TextSession` per prompt (token ids)."""

    def session(self, prompt: Sequence[int]) -> TextSession: ...


def speculative_generate(model, prompt: Sequence[int], max_new_tokens: int, eos: frozenset[int],
                         drafter: TextDrafter | None = None, acceptance: TreeAcceptance = GreedyAcceptance(),
                         generator: torch.Generator | None = None) -> Generation:
    """:func:`generate_texts` of one request, drafted by a session of ``drafter`` (None: plain
    decoding)."""
    check_prompt(prompt, max_new_tokens)
    sessions = None if drafter is None else [drafter.session(prompt)]
    return generate_texts(model, [prompt], max_new_tokens, eos, sessions, acceptance, generator)[0]
