"""Exact speculative sampling over a text head's draft trees (``recspec generate --method
spec-sample --tree``).

Each prompt is decoded alone by :func:`~recspec.decoding.text_rounds.speculative_generate` with the
head's EAGLE-2 trees (:class:`~recspec.knowledge.head_draft.HeadDrafter`, each round's tree sized
by the measured cost model, :func:`tree_drafter`) and sampling verification
(:class:`~recspec.decoding.acceptance.SampledAcceptance`: the target's own draw at every node, from one uniform per text
position). A level is accepted with the target's probability of the drafted siblings (not
Leviathan's ``sum min(p, q)`` of one drafted token), a round can accept a whole branch, and the
texts are draws from the target's warped distribution; for a seed they are the texts of plain
sampling in the same loop (:func:`sample_texts` without a drafter), whatever the trees.

The requests' uniforms come from one CPU generator seeded ``seed``, prompt after prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from recspec.decoding.acceptance import SampledAcceptance
from recspec.decoding.text import Generated, TextOptions
from recspec.decoding.text_rounds import Generation, speculative_generate
from recspec.decoding.warp import Warp
from recspec.knowledge.head_draft import HeadDrafter, HeadTreeConfig, sized_round_cost
from recspec.models.text_head import TextHeadDraft


def tree_drafter(model, model_dir: str | Path, head: TextHeadDraft, tree: HeadTreeConfig = HeadTreeConfig()
                 ) -> HeadDrafter:
    """``head``'s drafter for ``model`` (loaded from ``model_dir``), its trees sized by the cost
    model of a round where ``tree.sized``."""
    return HeadDrafter(head, tree, sized_round_cost(model, model_dir, head, tree) if tree.sized else None)


def sample_texts(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: frozenset[int], warp: Warp,
                 seed: int, drafter: HeadDrafter | None = None) -> list[Generation]:
    """A text after each prompt (token ids) drawn from ``model``'s distribution warped by ``warp``,
    speculatively with ``drafter``'s trees (None: plain sampling, one token per call)."""
    generator = torch.Generator().manual_seed(seed)
    acceptance = SampledAcceptance(warp)
    return [speculative_generate(model, prompt, max_new_tokens, eos, drafter, acceptance, generator)
            for prompt in prompts]


def generate_tree(model, prompts: Sequence[torch.Tensor], options: TextOptions, eos: int | None,
                  drafter: HeadDrafter | None = None) -> Generated:
    """``sample`` (``drafter`` None) or ``spec-sample`` with ``drafter``'s trees in the tree loop,
    as the text decoders' :func:`~recspec.decoding.text.generate` runs them (1-D prompt ids,
    ``options``' ``max_new_tokens``, ``warp`` and ``seed``; an end token ``eos`` or none), with the
    target's calls (the prefills included)."""
    started = time.perf_counter()
    generations = sample_texts(model, [prompt.tolist() for prompt in prompts], options.max_new_tokens,
                               frozenset() if eos is None else frozenset({eos}), options.warp, options.seed, drafter)
    return Generated(tokens=[generation.tokens for generation in generations], seconds=time.perf_counter() - started,
                     calls=sum(generation.calls for generation in generations))
