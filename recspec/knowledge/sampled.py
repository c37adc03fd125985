"""Exact speculative sampling over a text head's draft trees (``recspec generate --method
spec-sample --tree``).

The prompts are decoded in batches by :func:`~recspec.decoding.text_rounds.generate_texts` with the
head's EAGLE-2 trees (:class:`~recspec.decoding.head_trees.HeadDrafter`, each round's tree sized
by the measured cost model, :func:`tree_drafter`) and sampling verification
(:class:`~recspec.decoding.acceptance.SampledAcceptance`: the target's own draw at every node, from one uniform per text
position). A level is accepted with the target's probability of the drafted siblings (not
Leviathan's ``sum min(p, q)`` of one drafted token), a round can accept a whole branch, and the
texts are draws from the target's warped distribution; for a seed they are the texts of plain
sampling in the same loop (:func:`sample_texts` without a drafter), whatever the trees.

The requests' uniforms come from one CPU generator seeded ``seed``, prompt after prompt, so a
batch draws what the same prompts decoded one at a time draw.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from recspec.calibration import sized_round_cost
from recspec.decoding.acceptance import SampledAcceptance
from recspec.decoding.head_trees import HeadDrafter, HeadTreeConfig
from recspec.decoding.text import Generated, TextOptions
from recspec.decoding.text_rounds import Generation, generate_texts
from recspec.decoding.warp import Warp
from recspec.models.text_head import TextHeadDraft


def tree_drafter(model, model_dir: str | Path, head: TextHeadDraft, tree: HeadTreeConfig = HeadTreeConfig()
                 ) -> HeadDrafter:
    """``head``'s drafter for ``model`` (loaded from ``model_dir``), its trees sized by the cost
    model of a round where ``tree.sized``."""
    return HeadDrafter(head, tree, sized_round_cost(model, model_dir, head, tree) if tree.sized else None)


def sample_texts(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: frozenset[int], warp: Warp,
                 seed: int, drafter: HeadDrafter | None = None, batch_size: int = 1) -> list[Generation]:
    """A text after each prompt (token ids) drawn from ``model``'s distribution warped by ``warp``,
    speculatively with ``drafter``'s trees (None: plain sampling, one token per call), in batches
    of ``batch_size`` prompts."""
    generator = torch.Generator().manual_seed(seed)
    acceptance = SampledAcceptance(warp)
    generations: list[Generation] = []
    for start in range(0, len(prompts), batch_size):
        part = prompts[start:start + batch_size]
        batch = None if drafter is None else drafter.batch(part)
        generations += generate_texts(model, part, max_new_tokens, eos, batch, acceptance, generator)
    return generations


def generate_tree(model, prompts: Sequence[torch.Tensor], options: TextOptions, eos: int | None,
                  drafter: HeadDrafter | None = None, batch_size: int = 1) -> Generated:
    """``sample`` (``drafter`` None) or ``spec-sample`` with ``drafter``'s trees in the tree loop,
    as the text decoders' :func:`~recspec.decoding.text.generate` runs them (1-D prompt ids,
    ``options``' ``max_new_tokens``, ``warp`` and ``seed``; an end token ``eos`` or none), with the
    target's calls (the prefills included); ``batch_size`` prompts per batch."""
    started = time.perf_counter()
    generations = sample_texts(model, [prompt.tolist() for prompt in prompts], options.max_new_tokens,
                               frozenset() if eos is None else frozenset({eos}), options.warp, options.seed, drafter,
                               batch_size)
    return Generated(tokens=[generation.tokens for generation in generations], seconds=time.perf_counter() - started,
                     calls=sum(generation.calls for generation in generations))
