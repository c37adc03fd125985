"""The text decoders (knowledge generation): plain sampling, speculative sampling,
TopK-ImpSpecDec, beam sampling and DSBD, over a causal LM and a draft with the same tokenizer (for
every drafted method, or a text head over the target's features: :mod:`recspec.decoding.chains`
for the chain methods, :class:`~recspec.decoding.draft_sources.TextTreeDraft` for DSBD's trees);
each method is a few lines of wiring here.

* ``sample``: ancestral sampling from the warped target distribution: beam sampling with one beam
  (:func:`beam_sample`, the same code as ``beam-sample``).
* ``spec-sample``: the draft samples ``gamma`` tokens (:class:`~recspec.decoding.chains.
  ChainDrafter`), the target scores the pending token and all of them in one call, Leviathan's
  test keeps a prefix (:class:`~recspec.decoding.chains.ChainVerifier`), in the text round loop
  :func:`~recspec.decoding.text_rounds.generate_texts`.
* ``topk-imp``: as ``spec-sample``, each drafted token drawn from the draft's top-K reweighted by
  ``p / q`` (:func:`~recspec.decoding.chains.importance_proposal`); the target is run once per
  drafted token.
* ``beam-sample``: the target's beam sampling with ``W`` independent draws per step from the
  warped joint distribution (dsbd.txt Eq. 1), the plain beam loop over
  :class:`~recspec.decoding.space.FreeText`; the output is the best beam by target score.
* ``dsbd`` (:mod:`recspec.decoding.dsbd`): DSBD over the free vocabulary, the same output
  distribution as ``beam-sample`` with a fixed width.

Generation stops at ``max_new_tokens`` or when every beam of a row is finished; outputs are cut
after their first end token. Chain methods keep rows of different lengths in one batch
(:class:`~recspec.decoding.text_cache.TextCache`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from recspec.decoding.acceptance import check_lenience
from recspec.decoding.beam_search import TreeCache, beam_steps
from recspec.decoding.beams import Beams, sample_step
from recspec.decoding.chains import ChainDrafter, ChainStats, ChainVerifier, chain_draft
from recspec.decoding.dsbd import DSBDConfig, DSBDStats, dsbd_batch
from recspec.decoding.registry import TEXT, Decoder, check_owned, decoder as registered, register
from recspec.decoding.prompts import Prompts, check_draft_vocabulary, left_pad, prompt_batches
from recspec.decoding.rounds import SpecStats
from recspec.decoding.scorer import next_log_probs, prefill
from recspec.decoding.space import FreeText
from recspec.decoding.text_rounds import generate_texts
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.hub import keep_logits_at
from recspec.models.text_head import TextHeadDraft

#: The text decoders' names (registered below, :mod:`recspec.decoding.registry`).
SAMPLE, SPEC_SAMPLE, TOPK_IMP, BEAM_SAMPLE, DSBD = "sample", "spec-sample", "topk-imp", "beam-sample", "dsbd"
#: ``gamma`` where a method's fastest differs from :class:`TextOptions`' default (DSBD's third
#: drafted layer is seldom accepted given the second, so drafting it costs more than it saves).
DEFAULT_GAMMA = {DSBD: 2}


@dataclass(frozen=True)
class TextOptions:
    """Settings of the text decoders: ``max_new_tokens``; ``warp`` (temperature, top-k, top-p of
    every method); ``gamma`` (drafted tokens or layers per round; with ``draft_stop`` the most);
    ``draft_stop`` (``spec-sample``'s dynamic draft length: :class:`~recspec.decoding.drafters.
    ChainDrafter`'s ``stop``); ``lenience`` (``spec-sample``, speculative_decoding.txt A.5);
    ``candidates`` (TopK-ImpSpecDec's K); ``beams`` (``W`` of ``beam-sample``, and ``W_min`` of
    ``dsbd``); ``draft_width`` (``W_S`` of ``dsbd``; None: ``beams``, the fastest with a text head on
    a CPU, where each drafted node adds to the target's call), ``threshold``,
    ``one_cache`` (``dsbd``); ``seed``."""

    max_new_tokens: int = 64
    warp: Warp = Warp()
    gamma: int = 4
    draft_stop: float | None = None
    lenience: float = 1.0
    candidates: int = 10
    beams: int = 2
    draft_width: int | None = None
    threshold: float | None = None
    one_cache: bool = False
    seed: int = 0
    #: Options only some decoders take (field: how the command line spells it).
    OWNED: ClassVar[dict[str, str]] = {"draft_stop": "--draft-stop"}

    def check(self, decoder: Decoder) -> None:
        """Raise :class:`RecspecError` for settings that ``decoder`` cannot serve (before any work)."""
        self.warp.check()
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 2:
            raise RecspecError(f"max_new_tokens must be an integer of at least 2, got {self.max_new_tokens!r}")
        if decoder.drafted and (not isinstance(self.gamma, int) or self.gamma < 1):
            raise RecspecError(f"gamma must be a positive integer (tokens drafted per round), got {self.gamma!r}")
        check_lenience(self.lenience)
        check_owned(self, decoder)
        if self.draft_stop is not None and not 0.0 < self.draft_stop < 1.0:
            raise RecspecError(f"draft_stop must lie in (0, 1), got {self.draft_stop!r}")

    def dsbd(self) -> DSBDConfig:
        draft_width = self.beams if self.draft_width is None else self.draft_width
        return DSBDConfig(gamma=self.gamma, draft_width=draft_width, min_width=self.beams,
                          threshold=self.threshold, one_cache=self.one_cache, warp=self.warp, seed=self.seed)


@dataclass
class Generated:
    """Per prompt, the generated token ids (through the first end token) and, for the drafted
    methods, their statistics; ``calls``: the target's calls where a decoder counts them without
    statistics (the tree loop's)."""

    tokens: list[list[int]]
    stats: SpecStats | None = None
    seconds: float = 0.0
    calls: int | None = None


def default_gamma(method: str) -> int:
    """Drafted tokens (or layers) per round for ``method`` when none is asked for."""
    return DEFAULT_GAMMA.get(method, TextOptions.gamma)


def check_request(method: str, options: TextOptions, has_draft: bool) -> Decoder:
    """The text decoder ``method``; raise :class:`RecspecError` for settings it cannot serve
    (before any work)."""
    spec = registered(method, TEXT)
    spec.check(options, has_draft)
    return spec


def beam_sample(model, prompts: Prompts, space: FreeText, width: int, warp: Warp,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's beam sampling with ``width`` independent draws per step (``width=1``: plain
    sampling), with tree attention: the plain beam loop of the item decoders over free text.
    Returns the scores ``[B, W]`` (target joint log-probabilities, untempered) and tokens
    ``[B, W, d]``."""
    ends = space if space.eos is not None else None

    def select(beams: Beams, log_probs: torch.Tensor, space: FreeText, k: int) -> Beams:
        return sample_step(beams, log_probs, space, k, warp, generator, replacement=True, ends=ends)

    log_probs, cache = prefill(model, prompts)
    beams = beam_steps(log_probs, TreeCache(model, prompts, width, cache), space, width, select,
                       stop=lambda beams: bool(space.complete(beams.nodes).all()))
    return beams.scores, beams.tokens


def best_texts(scores: torch.Tensor, tokens: torch.Tensor, eos: int | None) -> list[list[int]]:
    """Each row's best beam (highest score), cut after its first end token."""
    best = tokens.gather(1, scores.argmax(dim=1)[:, None, None].expand(-1, 1, tokens.shape[2]))[:, 0]
    texts = []
    for row in best.tolist():  # once per output, after decoding
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        texts.append(row)
    return texts


def check_draft(target, draft) -> None:
    """Raise :class:`RecspecError` unless ``draft`` can draft for ``target``: a
    causal LM over the target's vocabulary, or a text head bound to this target (whose draft
    vocabulary is the target's by construction)."""
    if not isinstance(draft, TextHeadDraft):
        check_draft_vocabulary(target, draft)
    elif draft.embed is not target.get_input_embeddings():
        raise RecspecError("this text head is bound to another model: bind it with TextHeadDraft(head, target)")


def generate(method: str, target, draft, prompts: Sequence[torch.Tensor], options: TextOptions, pad_token_id: int,
             eos: int | None, batch_size: int | None = None) -> Generated:
    """Generate from every prompt (1-D token ids, at least 3 tokens) with ``method``; ``draft``: a
    draft causal LM, or a text head bound to ``target`` (:class:`~recspec.models.text_head.TextHeadDraft`)."""
    spec = check_request(method, options, draft is not None)
    if draft is not None:
        check_draft(target, draft)
    short = [i for i, prompt in enumerate(prompts) if len(prompt) < 3]
    if short:
        raise RecspecError(f"prompt {short[0]} has fewer than 3 tokens; the text decoders need at least 3")
    device = target.device
    generator = torch.Generator(device=device).manual_seed(options.seed)
    vocab = target.config.get_text_config().vocab_size
    texts: list[list[int]] = []
    stats: list[SpecStats] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in prompt_batches(prompts, pad_token_id, device, batch_size):
            space = FreeText(vocab, options.max_new_tokens, eos, device)
            part_texts, part_stats = spec.run(target, draft, batch, space, options, generator, eos)
            texts += part_texts
            if part_stats is not None:
                stats.append(part_stats)
    seconds = time.perf_counter() - started
    merged = None if not stats else type(stats[0]).cat(stats)
    return Generated(tokens=texts, stats=merged, seconds=seconds)


def _beam_sample_texts(width: int | None):
    def run(target, draft, batch: Prompts, space: FreeText, options: TextOptions, generator: torch.Generator,
            eos: int | None) -> tuple[list[list[int]], None]:
        scores, tokens = beam_sample(target, batch, space, options.beams if width is None else width, options.warp,
                                     generator)
        return best_texts(scores, tokens, eos), None
    return run


def _dsbd_texts(target, draft, batch: Prompts, space: FreeText, options: TextOptions, generator: torch.Generator,
                eos: int | None) -> tuple[list[list[int]], DSBDStats]:
    result = dsbd_batch(target, draft, batch, space, options.beams, options.dsbd(), generator, ends=space)
    return best_texts(result.scores, result.tokens, eos), result.stats


def _chain_texts(importance: bool):
    def run(target, draft, batch: Prompts, space: FreeText, options: TextOptions, generator: torch.Generator,
            eos: int | None) -> tuple[list[list[int]], ChainStats]:
        drafter = ChainDrafter(chain_draft(draft), options.warp, options.gamma, generator,
                               options.candidates if importance else None, options.draft_stop)
        verifier = ChainVerifier(options.warp, generator, options.lenience)
        prompts = [row[-length:] for row, length in zip(batch.input_ids.tolist(), batch.lengths.tolist())]
        texts = [generation.tokens for generation in generate_texts(
            target, prompts, options.max_new_tokens, frozenset() if eos is None else frozenset({eos}), drafter,
            verifier, pad_token_id=batch.pad_token_id)]
        verifier.stats.tokens += torch.tensor([float(len(text)) for text in texts])
        return texts, verifier.stats
    return run


def _check_candidates(options: TextOptions) -> None:
    if options.candidates < 1:
        raise RecspecError(f"the number of top-K candidates must be positive, got {options.candidates!r}")


def _check_beams(options: TextOptions) -> None:
    if options.beams < 1:
        raise RecspecError(f"the number of beams must be positive, got {options.beams!r}")


def _check_dsbd(options: TextOptions) -> None:
    _check_beams(options)
    options.dsbd().check(options.max_new_tokens - 1)


register(SAMPLE, TEXT, _beam_sample_texts(1), TextOptions, exact=True)
register(SPEC_SAMPLE, TEXT, _chain_texts(False), TextOptions, drafted=True, exact=True, takes=("draft_stop",))
register(TOPK_IMP, TEXT, _chain_texts(True), TextOptions, drafted=True, validate=_check_candidates)
register(BEAM_SAMPLE, TEXT, _beam_sample_texts(None), TextOptions, exact=True, validate=_check_beams)
register(DSBD, TEXT, _dsbd_texts, TextOptions, drafted=True, exact=True, validate=_check_dsbd)


def log_likelihood(model, prompts: Sequence[torch.Tensor], outputs: Sequence[Sequence[int]], pad_token_id: int,
                   batch_size: int = 4) -> torch.Tensor:
    """The model's mean log-probability per generated token of each output after its prompt
    (untempered, full vocabulary): float32 ``[N]`` (NaN for an empty output)."""
    means = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            pairs = list(zip(prompts[start:start + batch_size], outputs[start:start + batch_size]))
            width = max(len(output) for _, output in pairs)
            sequences = [torch.cat((prompt.long(), torch.tensor(output, dtype=torch.int64))) for prompt, output in pairs]
            batch = left_pad(sequences, pad_token_id, model.device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, **keep_logits_at(model, width + 1)).logits
            log_probs = next_log_probs(logits[:, -(width + 1):-1])  # [b, width, V]: predicting the last width tokens
            for row, (_, output) in enumerate(pairs):
                if not output:
                    means.append(float("nan"))
                    continue
                own = log_probs[row, width - len(output):]
                ids = torch.tensor(output, device=own.device)[:, None]
                means.append(float(own.gather(1, ids).mean()))
    return torch.tensor(means)
