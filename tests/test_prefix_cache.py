"""Prefix caching (recspec.decoding.prefix) on the real SmolLM2: a prompt prefix every request
shares is computed once per model and not fed again, and every decoder returns what it returns
without it (items equal, scores up to float noise), on prompts that start with a chat prefix."""

from __future__ import annotations

import pytest
import torch

from recspec.decoding.prefix import MIN_SHARED, open_cache, share_prefix, shared_columns
from recspec.decoding.prompts import left_pad
from recspec.decoding.scorer import forward_features, forward_opened, prefill, prefill_features, prompt_and_tree
from recspec.decoding.speculative_beam import SpecConfig, speculative_beam_search
from recspec.itemids.trie import ItemTrie
from recspec.models.layer_draft import keep_first_layers
from recspec.recommend import BEAM_DECODERS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SYSTEM = ("You are a recommender system. Read what the user says and answer with the one thing they "
          "would like most, in a few words.")
USERS = ["My favourite films are", "A good book to read on holiday is", "Recommend me a song:",
         "The best pizza topping is", "Users who bought running shoes also bought", "I would like to watch",
         "After a long day I like to", "For my sister's birthday I will buy her", "The next series I will start is",
         "On rainy Sundays we usually cook", "My dog's favourite toy is", "The album I play most this year is"]


@pytest.fixture(scope="module")
def parts(smollm2_dir):
    """SmolLM2's tokenizer, its first 4 layers as a target and its first one as a draft, chat prompts
    (one system message, then each user's text), the chat prefix and a trie of word-token items."""
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    tokenizer = load_tokenizer("smollm2")
    target, draft = load_causal_lm("smollm2"), load_causal_lm("smollm2")
    keep_first_layers(target, 4)
    keep_first_layers(draft, 1)
    prompts = [torch.tensor(tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]) for text in USERS]
    shortest = min(len(prompt) for prompt in prompts)
    heads = torch.stack([prompt[:shortest] for prompt in prompts])
    same = (heads == heads[0]).all(dim=0).long().cumprod(dim=0)  # the longest prefix every prompt has
    prefix = prompts[0][:int(same.sum())].tolist()
    words = torch.arange(300, 3300)
    codes = torch.unique(words[torch.randint(0, len(words), (400, 3), generator=torch.Generator().manual_seed(0))],
                         dim=0)
    return tokenizer, target, draft, prompts, prefix, ItemTrie(codes, len(tokenizer))


def test_left_pad_keeps_the_shared_prefix_in_front() -> None:
    prompts = [torch.tensor([7, 8, 9, 1, 2]), torch.tensor([7, 8, 9, 3]), torch.tensor([7, 8, 9, 4, 5, 6])]
    batch = left_pad(prompts, 0, torch.device("cpu"), shared=3)
    assert batch.input_ids.tolist() == [[7, 8, 9, 0, 1, 2], [7, 8, 9, 0, 0, 3], [7, 8, 9, 4, 5, 6]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 3, 4], [0, 1, 2, 0, 0, 3], [0, 1, 2, 3, 4, 5]]
    assert batch.lengths.tolist() == [5, 4, 6] and batch.shared == 3
    plain = left_pad(prompts, 0, torch.device("cpu"))
    assert plain.shared == 0 and plain.input_ids.tolist()[1] == [0, 0, 7, 8, 9, 3]


def test_a_prefix_is_shared_only_where_every_prompt_starts_with_it(parts) -> None:
    _, target, _, prompts, prefix, _ = parts
    assert len(prefix) >= MIN_SHARED  # the chat prefix: system message and the user turn's opening
    try:
        assert not share_prefix(target, prefix[:MIN_SHARED - 1])  # too short to pay
        assert shared_columns(target, prompts) == 0
        assert share_prefix(target, prefix)
        assert shared_columns(target, prompts) == len(prefix)
        other = torch.cat((torch.tensor([prefix[0] + 1]), prompts[0][1:]))
        assert shared_columns(target, [*prompts, other]) == 0  # one prompt does not start with it
        assert shared_columns(target, [*prompts, torch.tensor(prefix)]) == 0  # nothing after it
        unshared = left_pad(prompts, 0, target.device)
        assert open_cache(target, unshared).skip == 0  # laid out without shared columns: fed whole
    finally:
        share_prefix(target, ())


def test_prefill_from_the_stored_prefix_equals_the_whole_prompt(parts) -> None:
    """Log-probs, cache and features of a prefill that starts from the stored prefix equal those
    of the whole prompt fed (same layout), and only the suffix columns reach the model."""
    _, target, _, prompts, prefix, _ = parts
    shared = left_pad(prompts, 0, target.device, shared=len(prefix))
    fed: list[int] = []
    hook = target.model.embed_tokens.register_forward_hook(lambda module, args, out: fed.append(args[0].shape[1]))
    try:
        with torch.inference_mode():
            whole_log_probs, whole_cache, whole_features = prefill_features(target, shared, layers=(2,))
            assert share_prefix(target, prefix)
            fed.clear()
            log_probs, cache, features = prefill_features(target, shared, layers=(2,))
            assert fed == [len(prefix), shared.input_ids.shape[1] - len(prefix)]  # the prefix once, then suffixes
            fed.clear()
            assert torch.equal(prefill(target, shared)[0], prefill(target, shared)[0])
            assert fed == [shared.input_ids.shape[1] - len(prefix)] * 2  # stored: never fed again
            torch.testing.assert_close(log_probs, whole_log_probs, atol=1e-4, rtol=0)
            real = shared.attention_mask.bool()
            torch.testing.assert_close(features[real], whole_features[real], atol=1e-4, rtol=0)
            for ours, theirs in zip(cache.layers, whole_cache.layers):
                torch.testing.assert_close(ours.keys.transpose(1, 2)[real], theirs.keys.transpose(1, 2)[real],
                                           atol=1e-4, rtol=0)
                torch.testing.assert_close(ours.values.transpose(1, 2)[real],
                                           theirs.values.transpose(1, 2)[real], atol=1e-4, rtol=0)
            # the first speculative round's call: the prompt and a tree after it, features of every column
            tokens = torch.tensor([[400, 401, 402]] * len(prompts))
            width = shared.input_ids.shape[1]
            tree_visible = torch.cat((real[:, None, :].expand(-1, 3, -1), torch.eye(3, dtype=torch.bool).expand(
                len(prompts), -1, -1) | torch.tensor([[False] * 3, [True, False, False], [True, True, False]])),
                dim=2)
            positions = shared.lengths[:, None] + torch.tensor([0, 1, 2])
            block = prompt_and_tree(shared.input_ids, shared.attention_mask, shared.position_ids, tokens,
                                    tree_visible, positions)
            logits, opened_features = forward_opened(target, open_cache(target, shared), *block, True, (2,))
            share_prefix(target, ())
            whole_logits, full_features = forward_features(target, open_cache(target, shared).cache, *block[:3],
                                                           keep_last=block[3], all_features=True, layers=(2,))
            torch.testing.assert_close(logits, whole_logits, atol=1e-4, rtol=0)
            assert opened_features.shape == full_features.shape and opened_features.shape[1] == width + 3
            torch.testing.assert_close(opened_features[:, -4:], full_features[:, -4:], atol=1e-4, rtol=0)
    finally:
        hook.remove()
        share_prefix(target, ())


def test_every_decoder_returns_the_same_items_from_the_stored_prefix(parts) -> None:
    """hf, beam, tree-beam and strict speculative beam search (the target's own layers as a
    draft, and the target as its own oracle draft) over chat prompts at K = 1 and 10: with the
    prefix stored, the items of each equal its items without (and beam's), scores up to noise."""
    tokenizer, target, draft, prompts, prefix, trie = parts
    pad = tokenizer.pad_token_id

    def run(k: int) -> dict[str, object]:
        results = {name: decode(target, prompts, trie, k, pad, 4) for name, decode in BEAM_DECODERS.items()}
        for name, pair, n in (("spec draft", draft, 2 * k), ("spec oracle", target, k)):
            results[name] = speculative_beam_search(target, pair, prompts, trie, k, pad, SpecConfig(draft_beams=n),
                                                    batch_size=4).topk
        return results

    try:
        for k in (1, 10):
            plain = run(k)
            assert share_prefix(target, prefix) and share_prefix(draft, prefix)
            stored = run(k)
            share_prefix(target, ())
            share_prefix(draft, ())
            for name, topk in stored.items():
                assert torch.equal(topk.items, plain[name].items), (name, k)
                assert torch.equal(topk.items, plain["beam"].items), (name, k)
                torch.testing.assert_close(topk.scores, plain[name].scores, atol=1e-4, rtol=0)
    finally:
        share_prefix(target, ())
        share_prefix(draft, ())
