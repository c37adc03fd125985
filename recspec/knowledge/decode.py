"""Knowledge generation: plain greedy decoding and retrieval-based speculative decoding in one
loop, and the transformers baselines.

:func:`speculative_generate` prefills the prompt once, takes the target's own token (greedy, or
drawn: :mod:`recspec.knowledge.verify`), and then repeats one *step* per target call until an
end-of-sequence token or ``max_new_tokens``:

1. the drafter proposes a token tree for the current text (``N - 1`` draft nodes; none for
   plain greedy decoding): retrieval from token tries (:class:`RetrievalDrafter`), or a text
   draft head over the target's features (:mod:`recspec.knowledge.head_draft`), which then also
   receives the target's last hidden states at the prompt and at every kept node;
2. the last committed token (the *root*, not yet in the KV cache) and the draft nodes are scored
   in one forward pass over the cache with tree attention
   (:func:`~recspec.decoding.scorer.score_tree`);
3. the verifier (:mod:`recspec.knowledge.verify`) accepts the deepest draft path whose tokens
   pass its rule; the accepted tokens and the target's own token after them are committed;
4. the KV cache is compacted to the accepted path (:func:`~recspec.decoding.cache.compact_tail`,
   which moves only the tree's kept positions) and the drafter's temporary branches grow
   by the new tokens.

Plain greedy decoding (``ar``) is the same loop with no drafter: each step feeds the root alone,
exactly one token per call, so it shares every line of the speculative path except retrieval;
with sampling verification the same loop is plain ancestral sampling.
:func:`hf_generate` runs transformers' ``generate`` (greedy, or prompt lookup decoding with
``prompt_lookup_num_tokens``), counting its forward calls with a hook.

Every step is a Python iteration over decoding steps only; tree masks, positions, verification
and cache compaction are tensor operations over the whole tree.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from recspec.decoding.prompts import left_pad
from recspec.decoding.cache import compact_tail, require_full_attention
from recspec.decoding.scorer import score_tree, score_tree_features
from recspec.decoding.tree import ancestor_matrix, node_depths
from recspec.errors import RecspecError
from recspec.hub import keep_logits_at, returned_cache
from recspec.knowledge.retrieval import DraftTree, RetrievalConfig, retrieve
from recspec.knowledge.trie import TokenTrie
from recspec.knowledge.verify import Verification, accepted_path
from recspec.models.text_head import layer_features

GREEDY = Verification("greedy")


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
    included.
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


@runtime_checkable
class FeatureSession(Protocol):
    """A request's drafting state that reads the target's features (a text head's,
    :mod:`recspec.knowledge.head_draft`): :meth:`observe` receives the target's last hidden states
    (after its final norm) at the positions each call keeps, before the next :meth:`propose`."""

    def propose(self, text: list[int], max_depth: int) -> DraftTree:
        """A draft tree, at most ``max_depth`` deep, after ``text`` (prompt and generated tokens)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's decoder layers whose outputs the features carry before its top feature
        (:func:`~recspec.models.text_head.layer_features`; empty: the top feature alone)."""

    def observe(self, features: torch.Tensor, start: int) -> None:
        """The target's features ``[n, H * (len(feature_layers) + 1)]`` at text positions ``start ..
        start + n - 1``: the prompt after the prefill, the root and the accepted path after every step."""


class Drafter(Protocol):
    """What :func:`speculative_generate` drafts with: a session per request, a
    :class:`DraftSession` (retrieval) or a :class:`FeatureSession`."""

    def session(self, prompt: Sequence[int]) -> DraftSession | FeatureSession:
        """The drafting state of a request with ``prompt``."""


class RetrievalDrafter:
    """Drafts from a permanent pool trie plus the request's temporary branches.

    ``pool``: the permanent trie (None: temporary branches only); :meth:`session` starts a
    request with a fresh temporary trie holding the prompt's branches.
    """

    def __init__(self, pool: TokenTrie | None, config: RetrievalConfig) -> None:
        if pool is not None and pool.window < config.window:
            raise RecspecError(f"the pool stores branches of {pool.window} tokens, but drafting needs "
                               f"{config.window} (max suffix + max depth); rebuild the pool")
        self.pool, self.config = pool, config

    def session(self, prompt: Sequence[int]) -> DraftSession:
        return DraftSession(self, prompt)


class DraftSession:
    """One request's drafting state: the temporary trie (dropped with the session)."""

    def __init__(self, drafter: RetrievalDrafter, prompt: Sequence[int]) -> None:
        self.config = drafter.config
        self.temporary = TokenTrie(drafter.config.window)
        self.temporary.add(prompt)
        self.tries = [t for t in (drafter.pool, self.temporary) if t is not None]
        self.known = len(prompt)

    def propose(self, text: list[int], max_depth: int) -> DraftTree:
        """Grow the temporary branches by the text added since the last call, then retrieve."""
        self.temporary.extend(text, self.known)
        self.known = len(text)
        return retrieve(self.tries, text, self.config, max_depth)


def _prefill(model, prompt: Sequence[int], features: bool, layers: Sequence[int] = ()
             ) -> tuple[torch.Tensor, object, torch.Tensor | None]:
    """Run the prompt once: ``(the logits after it [V], cache, the last hidden states [P, H] (with
    the outputs of ``layers`` before them, :func:`~recspec.models.text_head.layer_features`) when
    ``features``, else None)``; only the last position's logits are computed where the model
    supports ``logits_to_keep``."""
    out = model(input_ids=torch.tensor([list(prompt)], device=model.device), use_cache=True,
                output_hidden_states=features, **keep_logits_at(model, 1))
    cache = returned_cache(out)
    require_full_attention(cache)
    read = layer_features(model, out.hidden_states, layers)[0] if features else None
    return out.logits[0, -1], cache, read


def _finish(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], bool]:
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


@torch.inference_mode()
def speculative_generate(model, prompt: Sequence[int], max_new_tokens: int, eos: frozenset[int],
                         drafter: Drafter | None = None, verification: Verification = GREEDY,
                         generator: torch.Generator | None = None) -> Generation:
    """Generate after ``prompt`` (token ids, chat template applied) with ``drafter`` (None: plain
    greedy decoding, or plain sampling) and ``verification``; see the module docstring. A drafter
    whose sessions read features (:class:`FeatureSession`) gets the target's at every kept
    position. Sampling verification draws the request's uniforms, one per text position, from
    ``generator`` (a CPU generator; None: one seeded 0) before decoding."""
    check_prompt(prompt, max_new_tokens)
    started = time.perf_counter()
    device = model.device
    uniforms = None
    if verification.kind == "sample":
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        uniforms = torch.rand(max_new_tokens, generator=generator, dtype=torch.float64).to(device)
    session = drafter.session(prompt) if drafter is not None else None
    observer = session if isinstance(session, FeatureSession) else None
    tick = time.perf_counter()
    layers = () if observer is None else observer.feature_layers
    first, cache, prompt_features = _prefill(model, prompt, observer is not None, layers)
    root = int(verification.choices(first[None, None], None if uniforms is None else uniforms[None, :1])[0, 0])
    prefill_s = time.perf_counter() - tick
    if observer is not None:
        observer.observe(prompt_features, 0)
    text = list(prompt) + [root]
    generated, done = _finish([root], max_new_tokens, eos)
    calls, drafted, ceiling, retrieval_s = 1, 0, 1, 0.0
    while not done:
        cached = len(text) - 1
        draft = DraftTree([], [])
        if session is not None:
            tick = time.perf_counter()
            draft = session.propose(text, max_new_tokens - len(generated) - 1)
            retrieval_s += time.perf_counter() - tick
        tokens = torch.tensor([[text[-1]] + draft.tokens], device=device)  # [1, N]
        parents = torch.tensor([[-1] + [p + 1 for p in draft.parents]], device=device)  # [1, N]
        ancestors = ancestor_matrix(parents)
        tree = (model, cache, tokens, ancestors, torch.ones(1, cached, dtype=torch.bool, device=device),
                torch.tensor([cached], device=device))
        logits, features = score_tree_features(*tree, layers) if observer is not None else (score_tree(*tree), None)
        # the uniforms of the positions the nodes' next tokens fill (sampling)
        at = None if uniforms is None else uniforms[len(generated) + node_depths(ancestors)]  # [1, N]
        choices = verification.choices(logits, at)
        last, path = accepted_path(verification.accept(tokens, parents, logits, choices), ancestors)
        nodes = path[0].nonzero()[:, 0]  # path order: parents precede children
        if len(draft):
            compact_tail(cache, cached, cached + nodes[None])
        if observer is not None:
            observer.observe(features[0, nodes], cached)
        new = tokens[0, nodes[1:]].tolist() + [int(choices[0, last[0]])]
        calls, drafted = calls + 1, drafted + len(draft)
        ceiling += draft.longest_branch() + 1
        generated, done = _finish(generated + new, max_new_tokens, eos)
        text = list(prompt) + generated
    return Generation(tokens=generated, prompt_tokens=len(prompt), calls=calls, accepted=len(generated) - calls,
                      drafted=drafted,
                      ceiling_tokens=ceiling, retrieval_s=retrieval_s, prefill_s=prefill_s,
                      wall_s=time.perf_counter() - started)


@torch.inference_mode()
def hf_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: frozenset[int],
                prompt_lookup_tokens: int | None = None) -> list[Generation]:
    """transformers ``generate`` over ``prompts`` (token ids; several are one left-padded batch):
    greedy, or prompt lookup decoding when ``prompt_lookup_tokens`` (draft length; one prompt
    at a time) is given. Forward calls are counted with hooks (for the AAL), which also time the
    first one (the prefill).

    A batch shares its time: each text gets the batch's wall and prefill seconds divided by the
    batch size (so a store's tokens/s is the batch throughput), and as calls the steps that
    produced its own tokens (one per token; rows that ended early ride along in the batch's
    later calls). A text is cut after its first end-of-sequence token, as ``generate`` returns it
    for a single prompt.
    """
    from transformers import GenerationConfig

    for prompt in prompts:
        check_prompt(prompt, max_new_tokens)
    if prompt_lookup_tokens is not None and len(prompts) != 1:
        raise RecspecError("prompt lookup decoding runs one prompt at a time")
    calls, prefill_end = 0, 0.0

    def count(*_) -> None:
        nonlocal calls
        calls += 1

    def first_done(*_) -> None:
        nonlocal prefill_end
        if calls == 1:
            prefill_end = time.perf_counter()

    pad = min(eos)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=sorted(eos), pad_token_id=pad,
                              prompt_lookup_num_tokens=prompt_lookup_tokens)
    batch = left_pad([torch.tensor(list(prompt)) for prompt in prompts], pad, model.device)
    width = batch.input_ids.shape[1]
    hooks = [model.register_forward_pre_hook(count), model.register_forward_hook(first_done)]
    try:
        started = time.perf_counter()
        out = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             generation_config=config)
        wall = time.perf_counter() - started
    finally:
        for hook in hooks:
            hook.remove()
    share, new = len(prompts), out[:, width:]
    ended = torch.isin(new, torch.tensor(sorted(eos), device=new.device))
    lengths = torch.where(ended.any(dim=1), ended.int().argmax(dim=1) + 1, new.shape[1]).tolist()
    generations = []
    for prompt, row, length in zip(prompts, new.tolist(), lengths):
        tokens = row[:length]
        own_calls = calls if share == 1 else length
        generations.append(Generation(tokens=tokens, prompt_tokens=len(prompt), calls=own_calls,
                                      accepted=len(tokens) - own_calls, drafted=0, ceiling_tokens=len(tokens),
                                      retrieval_s=0.0, prefill_s=(prefill_end - started) / share,
                                      wall_s=wall / share))
    return generations


def eos_ids(model, tokenizer) -> frozenset[int]:
    """The end-of-sequence ids ``generate`` stops at: the generation config's, else the tokenizer's."""
    value = model.generation_config.eos_token_id
    if value is None:
        value = tokenizer.eos_token_id
    if value is None:
        raise RecspecError("the model defines no end-of-sequence token; knowledge generation needs one")
    return frozenset([value] if isinstance(value, int) else value)
