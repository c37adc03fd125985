"""The drop-in never silently differs from transformers' ``generate`` (recspec.dropin_contract):
every setting that changes transformers' constrained beam search is honoured (the same items,
order and ``sequences_scores`` as ``generate`` with ``num_beams`` and a ``prefix_allowed_tokens_fn``
over the item trie, the LC-Rec way, given the same setting) or refused in one line naming it. On
the MovieLens-trained target over 32 test users; each honoured setting is also checked to change
transformers' own answer, so that agreeing with it means something."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (LlamaForCausalLM, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, WatermarkingConfig)
from transformers.generation import GenerateDecoderOnlyOutput

from recspec.decoding.prompts import Prompts, left_pad
from recspec.errors import RecspecError
from recspec.hf import trie_beam_search
from recspec.hub import eos_token_ids
from recspec.recommend import Recommender
from tests.test_beam import assert_same_ranking
from tests.test_hf_dropin import as_topk

pytestmark = pytest.mark.usefixtures("one_thread")
USERS, K = 32, 10


class Peer:
    """The trained target, its tokenizer, index and trie, ``USERS`` left-padded test prompts,
    and the first tokens of two users' best items under plain constrained ``generate``."""

    def __init__(self, folder: Path) -> None:
        recommender = Recommender.load(folder)
        self.model, self.tokenizer, self.index, self.trie = (recommender.model, recommender.tokenizer,
                                                             recommender.index, recommender.trie)
        self.pad = recommender.encoder.pad_id
        self.prompts: Prompts = left_pad(recommender.encoder.prompts(recommender.examples("test", USERS)), self.pad,
                                         torch.device("cpu"))
        self.width = self.prompts.input_ids.shape[1]
        self.plain = self.generate(prefix_allowed_tokens_fn=self.allowed)
        best = self.plain.sequences[::K, self.width:]  # [USERS, L]: each user's best item
        self.first, self.pair = int(best[0, 0]), best[1, :2].tolist()

    def allowed(self, batch_id: int, row: torch.Tensor) -> list[int]:
        """The reference constraint, as LC-Rec writes it: the trie's children of the generated suffix."""
        tokens, real = self.trie.children(self.trie.walk(row[None, self.width:]))
        return tokens[0][real[0]].tolist()

    def generate(self, model=None, users: int = USERS, **arguments):
        """``generate`` over the first ``users`` prompts with K beams, returning K sequences and their scores."""
        settings = dict(num_beams=K, num_return_sequences=K, max_new_tokens=self.trie.depth, do_sample=False,
                        pad_token_id=self.pad, output_scores=True, return_dict_in_generate=True)
        return (model or self.model).generate(input_ids=self.prompts.input_ids[:users],
                                              attention_mask=self.prompts.attention_mask[:users],
                                              **{**settings, **arguments})

    def assert_same(self, ours, reference, users: int = USERS) -> None:
        """The same items in the same order (near ties aside) and the same sequence scores."""
        assert ours.sequences.shape == reference.sequences.shape
        assert torch.equal(ours.sequences[:, :self.width], reference.sequences[:, :self.width])
        ref = as_topk(reference, self.width, users, K, self.trie)
        assert (ref.items >= 0).all()
        assert_same_ranking(as_topk(ours, self.width, users, K, self.trie), ref)


@pytest.fixture(scope="module")
def peer(trained_models: Path) -> Peer:
    return Peer(trained_models / "target")


class RandomBias(LogitsProcessor):
    """A caller's own processor: a fixed random bias per token."""

    def __init__(self, vocab: int) -> None:
        self.bias = 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(0))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores + self.bias[:scores.shape[1]]


#: Each honoured setting, built from the peer (tokens of its best items), and whether it changes
#: transformers' answer on these users.
HONOURED: dict[str, tuple[Callable[[Peer], dict], bool]] = {
    "repetition_penalty": (lambda p: dict(repetition_penalty=1.5), True),
    "no_repeat_ngram_size": (lambda p: dict(no_repeat_ngram_size=2), True),
    "encoder_repetition_penalty": (lambda p: dict(encoder_repetition_penalty=1.5), True),
    "encoder_no_repeat_ngram_size": (lambda p: dict(encoder_no_repeat_ngram_size=2), True),
    "bad_words_ids": (lambda p: dict(bad_words_ids=[[p.first], p.pair]), True),
    "sequence_bias": (lambda p: dict(sequence_bias={(p.first,): -1.0, tuple(p.pair): 2.0}), True),
    "suppress_tokens": (lambda p: dict(suppress_tokens=[p.first]), True),
    "begin_suppress_tokens": (lambda p: dict(begin_suppress_tokens=[p.first]), True),
    "renormalize_logits": (lambda p: dict(renormalize_logits=True), True),
    "watermarking_config": (lambda p: dict(watermarking_config=WatermarkingConfig(bias=3.0)), True),
    "logits_processor": (lambda p: dict(logits_processor=LogitsProcessorList([RandomBias(len(p.tokenizer))])), True),
    "length_penalty": (lambda p: dict(length_penalty=2.0), True),
    "several_at_once": (lambda p: dict(repetition_penalty=1.3, no_repeat_ngram_size=3, renormalize_logits=True,
                                       logits_processor=LogitsProcessorList([RandomBias(len(p.tokenizer))])), True),
    # applied as transformers applies them, and without effect here (no end-of-sequence token in an identifier)
    "remove_invalid_values": (lambda p: dict(remove_invalid_values=True), False),
    "min_length": (lambda p: dict(min_length=p.width + 2), False),
    "min_new_tokens": (lambda p: dict(min_new_tokens=2), False),
    "exponential_decay_length_penalty": (lambda p: dict(exponential_decay_length_penalty=(1, 1.5)), False),
}


@pytest.mark.parametrize("name", list(HONOURED))
def test_an_honoured_setting_gives_what_constrained_generate_gives(peer: Peer, name: str) -> None:
    make, changes = HONOURED[name]
    reference = peer.generate(prefix_allowed_tokens_fn=peer.allowed, **make(peer))
    moved = (reference.sequences != peer.plain.sequences).any() or not torch.allclose(
        reference.sequences_scores, peer.plain.sequences_scores)
    assert bool(moved) == changes
    peer.assert_same(peer.generate(custom_generate=trie_beam_search(peer.index, peer.tokenizer), **make(peer)),
                     reference)


def test_a_callers_prefix_allowed_tokens_fn_and_the_beam_decoder(peer: Peer) -> None:
    """A caller who keeps their own ``prefix_allowed_tokens_fn`` (here: no item starting with one
    token) gets it applied over the trie's; ``decoder="beam"`` and ``expand_root`` agree."""

    def stricter(batch_id: int, row: torch.Tensor) -> list[int]:
        allowed = peer.allowed(batch_id, row)
        return [token for token in allowed if token != peer.first] if len(row) == peer.width else allowed

    reference = peer.generate(prefix_allowed_tokens_fn=stricter)
    assert not torch.equal(reference.sequences, peer.plain.sequences)
    for drop_in in (trie_beam_search(peer.index, peer.tokenizer, decoder="beam"),
                    trie_beam_search(peer.index, peer.tokenizer, decoder="tree-beam", expand_root=True)):
        peer.assert_same(peer.generate(custom_generate=drop_in, prefix_allowed_tokens_fn=stricter,
                                       repetition_penalty=1.2),
                         peer.generate(prefix_allowed_tokens_fn=stricter, repetition_penalty=1.2))


def test_the_checkpoints_generation_config_is_honoured(peer: Peer, tmp_path: Path) -> None:
    """``repetition_penalty`` and ``no_repeat_ngram_size`` in the folder's ``generation_config.json``
    (as some checkpoints ship them) apply to the drop-in as to ``generate``, unasked."""
    peer.model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 1.4,
                                                                 "no_repeat_ngram_size": 2}))
    model = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert model.generation_config.repetition_penalty == 1.4
    reference = peer.generate(model, prefix_allowed_tokens_fn=peer.allowed)
    assert not torch.equal(reference.sequences, peer.plain.sequences)
    peer.assert_same(peer.generate(model, custom_generate=trie_beam_search(peer.index, peer.tokenizer)), reference)


class StopAt(StoppingCriteria):
    """Stops a beam whose newest token is ``token`` (and counts its calls)."""

    def __init__(self, token: int) -> None:
        self.token, self.calls = token, 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.calls += 1
        return input_ids[:, -1] == self.token


def test_stopping_criteria_are_asked_and_a_cut_identifier_is_refused(peer: Peer) -> None:
    """A criterion that can only fire on an identifier's last token changes nothing and is asked
    at every step; one that stops beams after their first token (transformers then returns cut
    sequences, which are no items) is refused, and so is an ``eos_token_id`` that is an inner
    identifier token."""
    last = int(peer.plain.sequences[0, -1])
    criterion = StopAt(last)
    reference = peer.generate(prefix_allowed_tokens_fn=peer.allowed,
                              stopping_criteria=StoppingCriteriaList([StopAt(last)]))
    peer.assert_same(peer.generate(custom_generate=trie_beam_search(peer.index, peer.tokenizer),
                                   stopping_criteria=StoppingCriteriaList([criterion])), reference)
    assert criterion.calls == peer.trie.depth - 1  # after every step but the last
    cut = peer.generate(prefix_allowed_tokens_fn=peer.allowed,
                        stopping_criteria=StoppingCriteriaList([StopAt(peer.first)]))
    assert (as_topk(cut, peer.width, USERS, K, peer.trie).items < 0).any()  # transformers' answer holds non-items
    drop_in = trie_beam_search(peer.index, peer.tokenizer)
    with pytest.raises(RecspecError, match=r"stopping criteria \(MaxLengthCriteria, EosTokenCriteria, StopAt\) stop a "
                                           r"beam after 1 of an identifier's 3 tokens"):
        peer.generate(custom_generate=drop_in, stopping_criteria=StoppingCriteriaList([StopAt(peer.first)]))
    with pytest.raises(RecspecError, match=r"stopping criteria \(MaxLengthCriteria, EosTokenCriteria\) stop a beam"):
        peer.generate(custom_generate=drop_in, eos_token_id=peer.first)


def test_greedy_search(peer: Peer) -> None:
    """``num_beams=1``: transformers' greedy search over the trie, its output type included."""
    settings = dict(num_beams=1, num_return_sequences=1, output_scores=False)
    reference = peer.generate(prefix_allowed_tokens_fn=peer.allowed, **settings)
    ours = peer.generate(custom_generate=trie_beam_search(peer.index, peer.tokenizer), **settings)
    assert type(ours) is type(reference) is GenerateDecoderOnlyOutput
    assert torch.equal(ours.sequences, reference.sequences)


#: Each refused setting (``generate`` arguments, ``trie_beam_search`` options) and the line that names it.
REFUSED: dict[str, tuple[Callable[[Peer], dict], dict, str]] = {
    "do_sample": (lambda p: dict(do_sample=True), {}, r"does not support do_sample=True \(it samples"),
    "num_beam_groups": (lambda p: dict(num_beam_groups=2, diversity_penalty=0.5), {},
                        r"does not support num_beam_groups=2 \(group"),
    "constraints": (lambda p: dict(force_words_ids=[[p.first]]), {}, r"does not support force_words_ids="),
    "guidance_scale": (lambda p: dict(guidance_scale=1.5), {}, r"does not support guidance_scale=1.5"),
    "max_time": (lambda p: dict(max_time=60.0), {}, r"does not support max_time=60.0 \(it stops on the clock"),
    "dola_layers": (lambda p: dict(dola_layers="low"), {}, r"does not support dola_layers='low' \(DoLa"),
    "output_logits": (lambda p: dict(output_logits=True), {}, r"does not support output_logits=True"),
    "output_attentions": (lambda p: dict(output_attentions=True), {}, r"does not support output_attentions=True"),
    "output_hidden_states": (lambda p: dict(output_hidden_states=True), {},
                             r"does not support output_hidden_states=True"),
    "greedy_output_scores": (lambda p: dict(num_beams=1, num_return_sequences=1), {},
                             r"does not support output_scores=True \(greedy search returns per-step scores"),
    "penalty_alpha": (lambda p: dict(num_beams=1, num_return_sequences=1, output_scores=False, penalty_alpha=0.6,
                                     top_k=4), {}, r"does not support penalty_alpha=0.6 \(contrastive search"),
    "greedy_processors": (lambda p: dict(num_beams=1, num_return_sequences=1, output_scores=False,
                                         repetition_penalty=1.2), {},
                          r"num_beams=1: greedy search applies the logits processors "
                          r"\(RepetitionPenaltyLogitsProcessor\) to raw logits"),
    "forced_eos_token_id": (lambda p: dict(forced_eos_token_id=p.tokenizer.eos_token_id), {},
                            r"logits processors \(ForcedEOSTokenLogitsProcessor\) leave fewer than "
                            r"num_return_sequences=10 items for prompt\(s\) \[0, 1, 2, 3"),
    "max_new_tokens": (lambda p: dict(max_new_tokens=p.trie.depth - 1), {},
                       r"identifiers take 3 new tokens; generate allows 2 \(raise max_new_tokens\)"),
    "batch_size": (lambda p: dict(no_repeat_ngram_size=2), dict(batch_size=2),
                   r"batch_size=2 with generate's logits processors or stopping criteria "
                   r"\(NoRepeatNGramLogitsProcessor\)"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_setting_is_one_line_naming_it(peer: Peer, name: str) -> None:
    make, options, message = REFUSED[name]
    drop_in = trie_beam_search(peer.index, peer.tokenizer, **options)
    with pytest.raises(RecspecError, match=message):
        peer.generate(users=4, custom_generate=drop_in, **make(peer))


def test_speculation_refuses_processors(peer: Peer, trained_models: Path) -> None:
    """``spec-strict`` verifies drafts against the model's own log-probs: with processors it is
    refused; ``auto`` with the same draft runs ``tree-beam`` under them instead."""
    draft = Recommender.load(trained_models / "draft").model
    with pytest.raises(RecspecError, match=r"decoder='spec-strict' does not apply generate's logits processors"):
        peer.generate(users=4, custom_generate=trie_beam_search(peer.index, peer.tokenizer, draft=draft,
                                                                decoder="spec-strict"), repetition_penalty=1.3)
    reference = peer.generate(prefix_allowed_tokens_fn=peer.allowed, repetition_penalty=1.3)
    peer.assert_same(peer.generate(custom_generate=trie_beam_search(peer.index, peer.tokenizer, draft=draft),
                                   repetition_penalty=1.3), reference)


@pytest.mark.parametrize(("value", "ids"), [(None, []), (7, [7]), ([3, 9], [3, 9]), ((4,), [4])])
def test_one_reading_of_an_eos_token_id(value, ids: list[int]) -> None:
    """``eos_token_id`` (none, one id, or several) read one way wherever it is read."""
    assert eos_token_ids(value) == ids
