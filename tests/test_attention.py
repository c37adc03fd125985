"""Packed grouped-query attention (:mod:`recspec.accel.packed_attention`) on the real SmolLM2: the
same logits as transformers' own SDPA attention for verifying calls over a cache (tree masks, several
rows, batches), the cases it leaves to transformers, and a saved model that loads anywhere."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from recspec.accel import packed_attention as attention
from recspec.accel.packed_attention import PACKED_SDPA, packs, use_packed_attention
from recspec.decoding.cache import gather_positions
from recspec.models.hf import load_causal_lm
from recspec.hub import with_cache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(smollm2_dir):
    """SmolLM2 as recspec loads it (packed) and a copy on transformers' SDPA attention."""
    packed = load_causal_lm(smollm2_dir)
    plain = copy.deepcopy(packed)
    plain.set_attn_implementation("sdpa")
    return packed, plain


def tree_call(model, past: torch.Tensor, new: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, n, V]`` of one call over ``new`` ``[b, n]`` after a cache of ``past`` ``[b, P]``,
    node ``i`` seeing the cache and the nodes ``visible[b, i]`` (bool ``[b, n, n]``)."""
    batch, count = new.shape
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=past, **with_cache(model, cache), use_cache=True)
        seen = torch.cat((torch.ones(batch, count, past.shape[1], dtype=torch.bool), visible), dim=2)
        mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[:, None]
        depth = visible.sum(dim=2) - 1  # a node's position: the cache, then its ancestors
        out = model(input_ids=new, attention_mask=mask, position_ids=past.shape[1] + depth, **with_cache(model, cache),
                    use_cache=True)
        gather_positions(cache, torch.arange(past.shape[1])[None].expand(batch, -1))
    return out.logits


@pytest.mark.parametrize("batch,count", [(1, 2), (1, 5), (2, 7), (1, 16), (3, 33)])
def test_packed_verifying_calls_are_transformers_attention(models, batch, count, monkeypatch) -> None:
    packed, plain = models
    decided: list[bool] = []
    monkeypatch.setattr(attention, "packs", lambda *args: decided.append(packs(*args)) or decided[-1])
    assert packed.config._attn_implementation == PACKED_SDPA and plain.config._attn_implementation == "sdpa"
    generator = torch.Generator().manual_seed(count)
    vocab = packed.config.vocab_size
    past = torch.randint(0, vocab, (batch, 40), generator=generator)
    new = torch.randint(0, vocab, (batch, count), generator=generator)
    # a random tree per row: node i's parent is some node before it (or the cache)
    parents = [[-1] + [int(torch.randint(-1, i, (), generator=generator)) for i in range(1, count)]
               for _ in range(batch)]
    visible = torch.zeros(batch, count, count, dtype=torch.bool)
    for b, row in enumerate(parents):
        for i, parent in enumerate(row):
            visible[b, i, i] = True
            if parent >= 0:
                visible[b, i] |= visible[b, parent]
    ours, theirs = tree_call(packed, past, new, visible), tree_call(plain, past, new, visible)
    layers = packed.config.num_hidden_layers
    assert decided == [False] * layers + [True] * layers  # the cache's causal prefill, then the packed call
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(dim=-1), theirs.argmax(dim=-1))


def test_what_is_left_to_transformers(models) -> None:
    packed, _ = models
    layer = packed.model.layers[0].self_attn
    query = torch.zeros(1, 9, 4, 64)
    mask = torch.zeros(1, 1, 4, 10)
    assert packs(layer, query, mask)
    assert not packs(layer, query[:, :, :1], mask[:, :, :1])  # one row: transformers packs it itself
    assert not packs(layer, query, None)  # a causal prefill without a mask
    assert not packs(layer, query, mask.expand(1, 9, 4, 10))  # a mask per head
    layer.train()
    assert not packs(layer, query, mask)  # training: attention dropout, transformers' path
    layer.eval()


def test_other_attention_is_left_as_it_is_and_saved_models_load_anywhere(models, tmp_path) -> None:
    packed, _ = models
    eager = copy.deepcopy(packed)
    eager.set_attn_implementation("eager")
    assert use_packed_attention(eager).config._attn_implementation == "eager"
    packed.save_pretrained(tmp_path)
    assert PACKED_SDPA not in json.loads((tmp_path / "config.json").read_text()).values()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # plain transformers, nothing registered needed
    assert reloaded.config._attn_implementation == "sdpa"
