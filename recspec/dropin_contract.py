"""The drop-in's side of transformers' ``generate`` contract: what a ``custom_generate`` callable
is handed, honoured exactly or refused in one line (:mod:`recspec.hf`).

``generate`` prepares a ``generation_config`` (the call's arguments over the checkpoint's
``generation_config.json``), a ``LogitsProcessorList`` built from it plus the caller's
``logits_processor`` (and ``prefix_allowed_tokens_fn``), and a ``StoppingCriteriaList`` (its
length and end-of-sequence criteria plus the caller's ``stopping_criteria``), then hands them to the
callable. Transformers' beam search applies the processors to each step's float32 log-probs of
all ``B * K`` running beams (``K`` copies of each prompt at the first step) and asks the criteria,
after each step, whether a kept beam is finished.

**Processors** (:class:`ProcessedSelect`). recspec's beam loop is given the same: each step's
log-probs of the ``K`` beams of every user, with the rows transformers would pass (the prompt
as ``generate`` expanded it, then the beam's tokens), masked to the trie (``-inf`` outside it,
as the reference's ``prefix_allowed_tokens_fn`` does), then processed by the list in its order;
the step keeps the best ``K`` as before. Transformers places the prefix constraint after
sequence bias, bad words, the (encoder) repetition penalties, the (encoder) no-repeat n-grams
and the minimum lengths, and before everything else (forced tokens, invalid-value removal, the
length decay, suppressed tokens, the caller's processors, watermarking, ``renormalize_logits``).
Masking first is the same thing: every processor placed before the constraint maps ``-inf`` to
``-inf`` and acts token by token, so it commutes with the mask, and classifier-free guidance,
the one processor that would not, is refused (:func:`refuse_unsupported`).

**Stopping criteria.** A beam a criterion stops inside an identifier would be returned by
transformers as a cut sequence, which is no item: the criteria are asked after every step but
the last, as transformers asks them (``scores`` the processed per-step log-probs when
``output_scores`` and ``return_dict_in_generate``, else None), and a live beam stopped early is
refused in one line. The length and end-of-sequence criteria ``generate`` always adds can only
stop a beam early if an end-of-sequence id is an identifier's inner token
(:func:`needs_checking`); without that and without processors the decoders run unchanged.
"""

from __future__ import annotations

import torch
from transformers import EosTokenCriteria, GenerationConfig, LogitsProcessorList, MaxLengthCriteria, \
    StoppingCriteriaList

from recspec.decoding.beams import Beams, TopK, select_top_k
from recspec.errors import RecspecError
from recspec.hub import eos_token_ids
from recspec.itemids.trie import ItemTrie

#: Per-step outputs the drop-in does not keep (it returns items and their scores).
PER_STEP_OUTPUTS = ("output_logits", "output_attentions", "output_hidden_states")


def refuse_unsupported(config: GenerationConfig) -> None:
    """One line naming every setting of ``config`` (the call's or the checkpoint's) that would
    make transformers decode otherwise than exact trie-constrained beam (or greedy) search, or
    return what the drop-in does not keep."""
    greedy = config.num_beams == 1
    refused = {
        "do_sample": (config.do_sample is True, "it samples; the drop-in is exact search"),
        "num_beam_groups": ((config.num_beam_groups or 1) > 1, "group (diverse) beam search"),
        "constraints": (config.constraints is not None, "constrained beam search"),
        "force_words_ids": (config.force_words_ids is not None, "constrained beam search"),
        "guidance_scale": (config.guidance_scale not in (None, 1),
                           "classifier-free guidance runs the model inside a processor"),
        "dola_layers": (config.dola_layers is not None, "DoLa decoding"),
        "penalty_alpha": (greedy and (config.penalty_alpha or 0) > 0 and (config.top_k or 0) > 1,
                          "contrastive search"),
        "max_time": (config.max_time is not None, "it stops on the clock, so the answer would depend on timing"),
        "output_scores": (greedy and bool(config.output_scores),
                          "greedy search returns per-step scores, which the drop-in does not keep"),
        **{name: (bool(getattr(config, name)), "the drop-in returns items and their scores only")
           for name in PER_STEP_OUTPUTS},
    }
    named = [f"{name}={getattr(config, name)!r} ({why})" for name, (asked, why) in refused.items() if asked]
    if named:
        raise RecspecError(f"trie_beam_search does not support {'; '.join(named)}")


def check_length(config: GenerationConfig, width: int, trie: ItemTrie) -> None:
    """Refuse a ``max_length`` (``max_new_tokens`` past the ``width`` prompt columns) shorter than
    an identifier. A longer one is taken as a bound: the sequences end with the item, where
    transformers' constrained search, with nothing to allow past an item, raises (its
    ``prefix_allowed_tokens_fn``) or returns ``-inf`` continuations (a mask) unless identifiers end
    with its ``eos_token_id``."""
    allowed = config.max_length - width
    if allowed < trie.depth:
        raise RecspecError(f"identifiers take {trie.depth} new tokens; generate allows {allowed} "
                           f"(raise max_new_tokens)")


def needs_checking(criteria: StoppingCriteriaList, config: GenerationConfig, trie: ItemTrie) -> bool:
    """Whether ``criteria`` may stop a beam inside an identifier: any criterion but the length
    and end-of-sequence ones ``generate`` adds, or an end-of-sequence id of ``config`` that is an
    identifier's inner token (the length was checked by :func:`check_length`)."""
    if any(type(criterion) not in (MaxLengthCriteria, EosTokenCriteria) for criterion in criteria):
        return True
    inner = torch.arange(1, trie.num_nodes - trie.num_items, device=trie.device)  # every prefix but root and leaves
    eos = torch.tensor(eos_token_ids(config.eos_token_id), device=trie.device)
    return bool(torch.isin(trie.last_token(inner), eos).any())


def mask_outside(trie: ItemTrie, nodes: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` float ``[N, V]`` with ``-inf`` wherever a token does not continue ``nodes[n]``
    (int64 ``[N]``) towards an item (every token for node ``-1`` and for leaves); ``V`` may exceed
    the trie's vocabulary (a model's padded output layer)."""
    allowed = trie.allowed_mask(nodes)
    if allowed.shape[1] < scores.shape[1]:
        allowed = torch.nn.functional.pad(allowed, (0, scores.shape[1] - allowed.shape[1]))
    return scores.masked_fill(~allowed[:, :scores.shape[1]], -torch.inf)


class ProcessedSelect:
    """A beam step (``select`` of :func:`~recspec.decoding.beam_search.beam_decode`) as
    transformers' beam search takes it under ``generate``'s processors and criteria (module doc).

    ``rows``: int64 ``[B * K, W]``, the prompts as ``generate`` expanded them (user ``b``'s ``K``
    copies at rows ``b * K ..``); ``criteria``: None where :func:`needs_checking` says none can
    fire early; ``keep_scores``: keep the processed log-probs of every step for the criteria
    (``output_scores`` with ``return_dict_in_generate``), as transformers passes them."""

    def __init__(self, rows: torch.Tensor, processors: LogitsProcessorList, criteria: StoppingCriteriaList | None,
                 keep_scores: bool) -> None:
        self.rows, self.processors, self.criteria = rows, processors, criteria
        self.scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None

    def __call__(self, beams: Beams, log_probs: torch.Tensor, trie: ItemTrie, k: int) -> Beams:
        """``log_probs`` float32 ``[B, S, V]`` after each of the ``S`` beams (``S = 1`` at the
        first step, where transformers scores ``K`` copies of the prompt): the ``k`` best
        continuations by the processed scores."""
        batch, width, vocab = log_probs.shape
        rows = self.rows.to(log_probs.device)
        nodes, tokens = filled(beams, k)
        sequences = torch.cat((rows, tokens.reshape(batch * k, -1)), dim=1)
        scores = mask_outside(trie, nodes.reshape(-1), log_probs.expand(batch, k, vocab).reshape(batch * k, vocab))
        scores = self.processors(sequences, scores)
        if self.scores is not None:
            self.scores += (scores,)
        chosen = select_top_k(beams, scores.reshape(batch, k, vocab)[:, :width], trie, k)
        self.check_stops(chosen, rows, trie)
        return chosen

    def check_stops(self, chosen: Beams, rows: torch.Tensor, trie: ItemTrie) -> None:
        """Refuse a live beam of ``chosen`` (``[B, K]``, ``d`` tokens each) that a criterion stops
        before its identifier's last token."""
        batch, k, depth = chosen.tokens.shape
        if self.criteria is None or depth == trie.depth:
            return
        stopped = self.criteria(torch.cat((rows, filled(chosen, k)[1].reshape(batch * k, depth)), dim=1), self.scores)
        if (stopped.view(batch, k) & chosen.scores.isfinite()).any():
            names = ", ".join(type(criterion).__name__ for criterion in self.criteria)
            raise RecspecError(f"the stopping criteria ({names}) stop a beam after {depth} of an identifier's "
                               f"{trie.depth} tokens, where transformers would return the cut sequence, which is no "
                               f"item: the drop-in returns whole items only")


def filled(beams: Beams, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nodes ``[B, k]`` and tokens ``[B, k, d]`` of ``beams`` (``[B, S]``, ``S`` 1 or ``k``) as
    transformers' ``k`` running beams hold them: the first step's one prefix copied ``k`` times, and
    a dead filler (a user with fewer than ``k`` candidates) holding the user's best prefix, as
    transformers' fillers hold real prefixes scored about ``-1e9``, so that a processor (a caller's
    ``prefix_allowed_tokens_fn``) only ever sees prefixes of items; the fillers stay dead."""
    batch, _, depth = beams.tokens.shape
    nodes, tokens = beams.nodes.expand(batch, k), beams.tokens.expand(batch, k, depth)
    dead = nodes < 0
    return torch.where(dead, nodes[:, :1], nodes), torch.where(dead[:, :, None], tokens[:, :1], tokens)


def check_items(topk: TopK, n: int, processors: LogitsProcessorList) -> None:
    """Refuse a result in which ``processors`` left a prompt fewer than ``n`` items (transformers
    would fill its output with sequences that are no items, scored ``-inf``)."""
    short = (~topk.scores[:, :n].isfinite()).any(dim=1).nonzero()[:, 0].tolist()
    if short:
        names = ", ".join(type(processor).__name__ for processor in processors)
        raise RecspecError(f"generate's logits processors ({names}) leave fewer than num_return_sequences={n} "
                           f"items for prompt(s) {short[:10]}: transformers would return sequences that are no items")


def pad_token_id(config: GenerationConfig, tokenizer) -> int:
    """The id the drop-in pads prompts with (any: padding is masked): ``generate``'s
    ``pad_token_id``, else the tokenizer's, else 0."""
    for pad in (config.pad_token_id, tokenizer.pad_token_id):
        if pad is not None:
            return int(pad)
    return 0
