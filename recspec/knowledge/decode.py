"""Knowledge generation's own wiring: LASER's retrieval drafter (:class:`RetrievalDrafter`: a
permanent pool trie plus the request's temporary branches, one :class:`DraftSession` per request)
for the text round loop (:mod:`recspec.decoding.text_rounds`, where plain greedy decoding, plain
sampling and every drafted method run), retrieval and a text head's trees in one tree per round
(:class:`HybridDrafter`), and the transformers baselines.

Each round the session grows its temporary branches by the text added since the last round and
retrieves a draft tree (:func:`~recspec.knowledge.retrieval.retrieve`); the loop scores it in one
target call and keeps the deepest accepted path. Plain greedy decoding (``ar``) is the same loop
with no drafter: each step feeds the root alone, exactly one token per call.
:func:`hf_generate` runs transformers' ``generate`` (greedy, or prompt lookup decoding with
``prompt_lookup_num_tokens``), counting its forward calls with a hook.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from recspec.decoding.head_trees import HeadDrafter, HeadTrees
from recspec.decoding.prompts import Prompts, left_pad
from recspec.decoding.text_rounds import Draft, DraftTree, Generation, Scorer, Sessions, TextSession, check_prompt
from recspec.errors import RecspecError
from recspec.hub import eos_token_ids
from recspec.knowledge.retrieval import RetrievalConfig, retrieve
from recspec.knowledge.trie import TokenTrie


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

    def batch(self, prompts: Sequence[Sequence[int]]) -> Sessions:
        return Sessions([self.session(prompt) for prompt in prompts])


class DraftSession(TextSession):
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
    """Retrieval drafting (``retrieval``) and a text head (``head``) in one tree per round
    (:class:`HybridTrees`)."""

    def __init__(self, retrieval: RetrievalDrafter, head: HeadDrafter) -> None:
        self.retrieval, self.head = retrieval, head

    def batch(self, prompts: Sequence[Sequence[int]]) -> HybridTrees:
        return HybridTrees(self.retrieval.batch(prompts), self.head.batch(prompts))


class HybridTrees:
    """A batch's retrieval sessions and a head's trees side by side, a
    :class:`~recspec.decoding.text_rounds.TextDrafter`: the head keeps the target's features every
    round; retrieval proposes, and the head too for the rows whose retrieved tree is less than its
    ``gate`` deep (every row without one), their trees merged. The head reads what it kept only
    in the rounds it drafts (every row's, in one call), and drafts for those rows only."""

    lag = 0
    drop_hidden = False
    wants_features = True

    def __init__(self, retrieval: Sessions, head: HeadTrees) -> None:
        self.retrieval, self.head = retrieval, head

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        self.retrieval.start(prompts, features)
        self.head.start(prompts, features)

    def propose(self, texts: list[list[int]], budgets: list[int], score: Scorer) -> Draft:
        trees = self.retrieval.proposals(texts, budgets)
        gate = self.head.config.gate
        wanted = [gate is None or tree.longest_branch() < gate for tree in trees]
        if any(wanted):
            drafted = self.head.trees_for(texts, budgets, wanted)
            trees = [tree if own is None else merge_trees(tree, own) for tree, own in zip(trees, drafted)]
        return self.retrieval.draft(texts, trees)

    def learn(self, draft: Draft, path: torch.Tensor, own: torch.Tensor, features: torch.Tensor | None) -> None:
        self.head.learn(draft, path, own, features)

    def select(self, rows: torch.Tensor) -> None:
        self.retrieval.select(rows)
        self.head.select(rows)


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
    return frozenset(eos_token_ids(value))
