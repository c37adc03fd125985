"""The transformers drop-in (recspec.hf): ``custom_generate=trie_beam_search(...)`` returns what
transformers' own constrained beam search returns (sequences, order, ``sequences_scores``), and
:class:`TrieConstraint` constrains transformers' beam search as ``prefix_allowed_tokens_fn``
does; random models over an index and tokenizer made here, batches of left-padded prompts of
different lengths, the ``end_with_eos`` layout, and ``generate``'s logits processors; bad input
refused in one line (every setting of ``generate``: tests/test_dropin_contract.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from recspec.decoding import TopK
from recspec.decoding.prompts import left_pad
from recspec.errors import RecspecError
from recspec.hf import TrieConstraint, item_trie, trie_beam_search
from recspec.itemids.index import ItemIndex
from recspec.accel.lean_forward import forward_of
from recspec.models.tokenizer import build_tokenizer
from recspec.recommend import Recommender
from tests.test_beam import assert_same_ranking, random_codes
from tests.test_serve import models  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
PAD = 0


def peer(seed: int, per_level: list[int], items: int, users: int, kv_heads: int = 2):
    """An index of ``items`` random identifiers, its tokenizer, a random Llama over it, and
    ``users`` left-padded prompts of different lengths (input ids and attention mask)."""
    generator = torch.Generator().manual_seed(seed)
    digits, _ = random_codes(generator, per_level, items)
    digits = digits - digits.min(dim=0).values  # codes per level from 0
    index = ItemIndex.from_codes([f"item{i}" for i in range(items)], digits.numpy())
    tokenizer = build_tokenizer(index)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                                         initializer_range=0.3, max_position_embeddings=96,
                                         pad_token_id=PAD)).eval()
    lengths = torch.randint(2, 30, (users,), generator=generator)
    width = int(lengths.max())
    ids = torch.full((users, width), PAD, dtype=torch.int64)
    mask = torch.zeros(users, width, dtype=torch.int64)
    for row, n in enumerate(lengths.tolist()):  # test data: one prompt at a time
        ids[row, width - n:] = torch.randint(4, len(tokenizer), (n,), generator=generator)
        mask[row, width - n:] = 1
    return index, tokenizer, model, ids, mask


def constrained_generate(model, ids, mask, k: int, n: int, depth: int, **options):
    """transformers' beam search over the trie, as users call it (the reference)."""
    return model.generate(input_ids=ids, attention_mask=mask, num_beams=k, num_return_sequences=n,
                          max_new_tokens=depth, do_sample=False, pad_token_id=PAD,
                          return_dict_in_generate=True, output_scores=True, **options)


def trie_allowed(trie, width: int):
    """The reference constraint, the LC-Rec way: a ``prefix_allowed_tokens_fn`` giving the trie's
    children of the suffix generated after ``width`` prompt columns."""

    def allowed(batch_id: int, row: torch.Tensor) -> list[int]:
        tokens, real = trie.children(trie.walk(row[None, width:]))
        return tokens[0][real[0]].tolist()

    return allowed


def as_topk(out, width: int, users: int, n: int, trie) -> TopK:
    tokens = out.sequences[:, width:]
    return TopK(items=trie.items(trie.walk(tokens)).view(users, n), scores=out.sequences_scores.view(users, n).float(),
                tokens=tokens.reshape(users, n, -1))


@pytest.mark.parametrize("seed,per_level,items,k,n,penalty", [
    (1, [8, 8, 8], 300, 10, 10, 1.0),
    (2, [6, 6, 6, 6], 400, 5, 3, 1.0),   # fewer sequences returned than beams
    (3, [3, 10, 10], 250, 8, 8, 0.0),    # a first level narrower than K; no length penalty
    (4, [16, 16, 8], 900, 20, 20, 2.0),
])
def test_custom_generate_returns_what_constrained_generate_returns(seed, per_level, items, k, n, penalty) -> None:
    index, tokenizer, model, ids, mask = peer(seed, per_level, items, users=6)
    trie = item_trie(index, tokenizer)
    allowed = TrieConstraint(trie, ids.shape[1])
    reference = constrained_generate(model, ids, mask, k, n, trie.depth, length_penalty=penalty,
                                     prefix_allowed_tokens_fn=trie_allowed(trie, ids.shape[1]))
    with_processor = constrained_generate(model, ids, mask, k, n, trie.depth, length_penalty=penalty,
                                          logits_processor=LogitsProcessorList([allowed]))
    ours = constrained_generate(model, ids, mask, k, n, trie.depth, length_penalty=penalty,
                                custom_generate=trie_beam_search(index, tokenizer))
    ref = as_topk(reference, ids.shape[1], len(ids), n, trie)
    assert ours.sequences.shape == reference.sequences.shape
    assert torch.equal(ours.sequences[:, :ids.shape[1]], reference.sequences[:, :ids.shape[1]])  # the prompts
    assert (ref.items >= 0).all()
    assert_same_ranking(as_topk(ours, ids.shape[1], len(ids), n, trie), ref)
    assert_same_ranking(as_topk(with_processor, ids.shape[1], len(ids), n, trie), ref)
    plain = model.generate(input_ids=ids, attention_mask=mask, num_beams=k, num_return_sequences=n,
                           max_new_tokens=trie.depth, pad_token_id=PAD,
                           custom_generate=trie_beam_search(index, tokenizer, decoder="beam", batch_size=4))
    assert torch.equal(plain, ours.sequences)  # no dict asked: the sequences; beam in batches of 4 agrees
    root = constrained_generate(model, ids, mask, k, n, trie.depth, length_penalty=penalty,
                                custom_generate=trie_beam_search(index, tokenizer, decoder="tree-beam",
                                                                 expand_root=True, batch_size=4))
    assert_same_ranking(as_topk(root, ids.shape[1], len(ids), n, trie), ref)  # the first level in the prompt's call


@pytest.mark.parametrize("seed,per_level,items,k", [
    (3, [3, 10, 10], 250, 8),   # a first level narrower than K: beams filled as transformers fills them
    (2, [6, 6, 6, 6], 400, 5),
])
def test_generates_processors_apply_as_transformers_applies_them(seed, per_level, items, k) -> None:
    """A repetition penalty, no repeated bigrams and renormalised scores (each changes the
    answer: the prompts hold identifier tokens) give what constrained ``generate`` gives with
    them, also under a caller's own ``prefix_allowed_tokens_fn``."""
    index, tokenizer, model, ids, mask = peer(seed, per_level, items, users=6)
    trie = item_trie(index, tokenizer)
    allowed = trie_allowed(trie, ids.shape[1])
    settings = dict(repetition_penalty=1.5, no_repeat_ngram_size=2, renormalize_logits=True)
    plain = constrained_generate(model, ids, mask, k, k, trie.depth, prefix_allowed_tokens_fn=allowed)
    reference = constrained_generate(model, ids, mask, k, k, trie.depth, prefix_allowed_tokens_fn=allowed, **settings)
    assert not torch.allclose(plain.sequences_scores, reference.sequences_scores)
    for extra in ({}, dict(prefix_allowed_tokens_fn=allowed)):
        ours = constrained_generate(model, ids, mask, k, k, trie.depth, **extra, **settings,
                                    custom_generate=trie_beam_search(index, tokenizer))
        assert_same_ranking(as_topk(ours, ids.shape[1], len(ids), k, trie),
                            as_topk(reference, ids.shape[1], len(ids), k, trie))


def test_a_multi_head_model_is_called_through_the_lean_forward() -> None:
    """A float32 Llama with multi-head attention: the drop-in's decoders call it through the lean
    forward (``generate`` itself does not), with what constrained ``generate`` returns; a
    grouped-query model keeps its own forward."""
    index, tokenizer, model, ids, mask = peer(11, [8, 8, 8], 300, users=5, kv_heads=4)
    trie = item_trie(index, tokenizer)
    reference = constrained_generate(model, ids, mask, 8, 8, 3, logits_processor=LogitsProcessorList(
        [TrieConstraint(trie, ids.shape[1])]))
    assert forward_of(model) is model
    ours = constrained_generate(model, ids, mask, 8, 8, 3, custom_generate=trie_beam_search(index, tokenizer))
    assert forward_of(model) is not model
    assert_same_ranking(as_topk(ours, ids.shape[1], 5, 8, trie), as_topk(reference, ids.shape[1], 5, 8, trie))
    _, _, grouped, _, _ = peer(12, [8, 8, 8], 300, users=1)
    constrained_generate(grouped, ids, mask, 8, 8, 3, custom_generate=trie_beam_search(index, tokenizer))
    assert forward_of(grouped) is grouped


def test_speculative_drop_in_and_eos_closed_identifiers() -> None:
    index, tokenizer, model, ids, mask = peer(5, [8, 8, 8], 300, users=4)
    _, _, draft, _, _ = peer(6, [8, 8, 8], 300, users=1)  # another random model over the same tokenizer
    trie = item_trie(index, tokenizer, end_with_eos=True)
    assert trie.depth == 4
    reference = constrained_generate(model, ids, mask, 6, 6, 5, logits_processor=LogitsProcessorList(
        [TrieConstraint(trie, ids.shape[1])]), eos_token_id=tokenizer.eos_token_id)
    spec = constrained_generate(model, ids, mask, 6, 6, 5, eos_token_id=tokenizer.eos_token_id,
                                custom_generate=trie_beam_search(index, tokenizer, draft=draft, end_with_eos=True,
                                                                 decoder="spec-strict", draft_beams=12))
    assert (reference.sequences[:, -1] == tokenizer.eos_token_id).all()
    assert_same_ranking(as_topk(spec, ids.shape[1], len(ids), 6, trie), as_topk(reference, ids.shape[1], len(ids), 6,
                                                                                 trie))


def test_auto_times_both_on_the_first_batch_and_keeps_the_faster() -> None:
    """``auto`` with a draft: the first call for a K and batch size decodes its first batch by
    both candidates (timed), the rest by the faster; every call returns the reference's items,
    the second call reuses the choice; without a draft it is ``tree-beam``, untimed."""
    index, tokenizer, model, ids, mask = peer(9, [8, 8, 8], 300, users=6)
    _, _, draft, _, _ = peer(10, [8, 8, 8], 300, users=1)
    trie = item_trie(index, tokenizer)
    reference = as_topk(constrained_generate(model, ids, mask, 6, 6, 3, logits_processor=LogitsProcessorList(
        [TrieConstraint(trie, ids.shape[1])])), ids.shape[1], 6, 6, trie)
    auto = trie_beam_search(index, tokenizer, draft=draft, draft_beams=12, batch_size=4)
    for _ in range(2):  # the first call probes on users 0-3 and decodes 4-5 by the choice; the second reuses it
        out = constrained_generate(model, ids, mask, 6, 6, 3, custom_generate=auto)
        assert_same_ranking(as_topk(out, ids.shape[1], 6, 6, trie), reference)
        [(key, choice)] = auto.choices.items()
        assert key == ("cpu", 6, 4) and choice.decoder in ("tree-beam", "spec-strict")
        assert set(choice.ms_per_user) == {"tree-beam", "spec-strict"} and choice.reason.startswith(
            f"auto: {choice.decoder} (timed on the first 4 prompt(s) at K=6")
    plain = trie_beam_search(index, tokenizer)
    out = constrained_generate(model, ids, mask, 6, 6, 3, custom_generate=plain)
    assert_same_ranking(as_topk(out, ids.shape[1], 6, 6, trie), reference)
    assert plain.choices[("cpu", 6, 6)].decoder == "tree-beam" and plain.choices[("cpu", 6, 6)].ms_per_user == {}


def test_bad_input_is_refused_before_any_work(tmp_path) -> None:
    index, tokenizer, model, ids, mask = peer(7, [4, 4, 4], 40, users=2)
    other = ItemIndex.from_codes(["x"], torch.tensor([[99, 0, 0]]).numpy())
    with pytest.raises(RecspecError, match=r"lacks identifier token\(s\) <a_99>"):
        trie_beam_search(other, tokenizer)
    with pytest.raises(RecspecError, match="spec-strict needs a draft"):
        trie_beam_search(index, tokenizer, decoder="spec-strict")
    with pytest.raises(RecspecError, match="a draft is used by auto and spec-strict only, not by beam"):
        trie_beam_search(index, tokenizer, draft=model, decoder="beam")
    with pytest.raises(RecspecError, match="batch_size must be at least 1"):
        trie_beam_search(index, tokenizer, batch_size=0)
    with pytest.raises(RecspecError, match="exact decoders"):
        trie_beam_search(index, tokenizer, decoder="beam-sample")
    with pytest.raises(RecspecError, match="expand_root is an option of decoder='tree-beam', not of 'auto'"):
        trie_beam_search(index, tokenizer, expand_root=True)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    with pytest.raises(RecspecError, match="the draft scores 8 tokens"):
        trie_beam_search(index, tokenizer, draft=small)
    other_tokenizer = peer(8, [4, 4, 5], 40, users=1)[1]  # one more code at the last level: another vocabulary
    with pytest.raises(RecspecError, match="must share a vocabulary"):
        trie_beam_search(index, tokenizer, draft=model, draft_tokenizer=other_tokenizer)
    drop_in = trie_beam_search(index, tokenizer)
    with pytest.raises(RecspecError, match="identifiers take 3 new tokens; generate allows 2"):
        model.generate(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=4, max_new_tokens=2,
                       pad_token_id=PAD, custom_generate=drop_in)
    with pytest.raises(RecspecError, match="does not support output_logits"):
        model.generate(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=4, max_new_tokens=3,
                       pad_token_id=PAD, custom_generate=drop_in, output_logits=True, return_dict_in_generate=True)
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=4, max_new_tokens=3,
                         pad_token_id=PAD, custom_generate=drop_in, return_dict_in_generate=True)
    assert out.sequences_scores is None and out.sequences.shape == (8, ids.shape[1] + 3)  # as transformers


def test_drop_in_on_a_trained_recommender(models) -> None:  # noqa: F811
    """The MovieLens-trained target of tests/test_serve.py and its own tokenizer and index: the
    drop-in and transformers' constrained beam search agree on 24 real test prompts."""
    target, _ = models
    recommender = Recommender.load(target)
    prompts = left_pad(recommender.encoder.prompts(recommender.examples("test", 24)), recommender.encoder.pad_id,
                       torch.device("cpu"))
    trie, width = recommender.trie, prompts.input_ids.shape[1]
    options = dict(num_beams=10, num_return_sequences=10, max_new_tokens=trie.depth, do_sample=False,
                   pad_token_id=recommender.encoder.pad_id, output_scores=True, return_dict_in_generate=True)
    reference = recommender.model.generate(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                                           logits_processor=LogitsProcessorList([TrieConstraint(trie, width)]),
                                           **options)
    ours = recommender.model.generate(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                                      custom_generate=trie_beam_search(recommender.index, recommender.tokenizer),
                                      **options)
    assert_same_ranking(as_topk(ours, width, 24, 10, trie), as_topk(reference, width, 24, 10, trie))
