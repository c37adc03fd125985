"""recspec.accel.lean_forward: a small Llama's forward in one function, bit for bit transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from recspec.decoding.prompts import left_pad
from recspec.decoding.scorer import prompt_rows
from recspec.decoding.tree import ancestor_matrix, node_depths, tree_attention_mask, tree_position_ids
from recspec.hub import returned_cache
from recspec.accel.packed_attention import additive_mask, use_packed_attention
from recspec.accel.lean_forward import LeanLlama, LeanOutput, drop_lean_forward, eligible, forward_of, use_lean_forward
from recspec.recommend import DecodeOptions, Recommender
from tests.test_cli import lab

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PAD = 60, 0


def llama(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=4, initializer_range=0.3, max_position_embeddings=128,
                    attn_implementation="sdpa")
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit (NaN where both are NaN: transformers' fully masked padding rows)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def same_caches(a: DynamicCache, b: DynamicCache) -> None:
    for mine, theirs in zip(a.layers, b.layers, strict=True):
        same(mine.keys, theirs.keys)
        same(mine.values, theirs.values)


def both(model: LlamaForCausalLM, lean, **kwargs) -> DynamicCache | None:
    """The same call through the model and through its lean forward, each with its own copy of
    ``cache`` (if any): equal logits, equal caches afterwards; returns the lean call's cache."""
    cache = kwargs.pop("cache", None)
    copies = [None, None] if cache is None else [DynamicCache(config=model.config) for _ in range(2)]
    if cache is not None:
        for copy in copies:
            for index, layer in enumerate(cache.layers):
                copy.update(layer.keys.clone(), layer.values.clone(), index)
    theirs = model(**kwargs, **({} if cache is None else {"cache": copies[0]}))
    mine = lean(**kwargs, **({} if cache is None else {"cache": copies[1]}))
    assert isinstance(mine, LeanOutput)
    same(mine.logits, theirs.logits)
    if kwargs.get("use_cache") or cache is not None:
        same_caches(mine.cache, returned_cache(theirs))
    return mine.cache


@pytest.mark.parametrize("seed,heads,width", [(1, 4, 64), (2, 2, 48), (3, 8, 64)])
def test_every_call_recspec_makes_is_transformers_bit_for_bit(seed: int, heads: int, width: int) -> None:
    """Left-padded prompts under a 2-D mask (and without padding: transformers' causal skip), one
    token and several after the cache under the 2-D mask, a tree of nodes under a 4-D additive
    mask, the last positions' logits only, and no cache at all."""
    model = llama(seed, num_attention_heads=heads, num_key_value_heads=heads, hidden_size=width)
    assert use_lean_forward(model)
    lean = forward_of(model)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in (5, 17, 11, 1)]
    batch = left_pad(prompts, PAD, torch.device("cpu"))
    cache = both(model, lean, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                 position_ids=batch.position_ids, use_cache=True)
    both(model, lean, input_ids=batch.input_ids[1:2, -17:], use_cache=True)  # no padding: causal skip
    grown = torch.cat((batch.attention_mask, torch.ones(4, 1, dtype=torch.long)), dim=1)
    next_token = torch.randint(1, VOCAB, (4, 1), generator=generator)
    cache = both(model, lean, input_ids=next_token, attention_mask=grown, position_ids=batch.lengths[:, None],
                 cache=cache, use_cache=True)
    four = torch.cat((batch.attention_mask, torch.ones(4, 4, dtype=torch.long)), dim=1)
    cache = both(model, lean, input_ids=torch.randint(1, VOCAB, (4, 3), generator=generator), attention_mask=four,
                 position_ids=batch.lengths[:, None] + 1 + torch.arange(3), cache=cache, use_cache=True,
                 logits_to_keep=2)
    both(model, lean, input_ids=torch.randint(1, VOCAB, (4, 2), generator=generator), cache=cache,
         use_cache=True)  # no mask, no positions: causal after the cache
    past = torch.cat((batch.attention_mask.bool(), torch.ones(4, 4, dtype=torch.bool)), dim=1)  # prompt, 1 + 3
    ancestors = ancestor_matrix(torch.tensor([[-1, -1, 0, 0, 2]]).expand(4, -1))  # five nodes, two roots
    both(model, lean, input_ids=torch.randint(1, VOCAB, (4, 5), generator=generator),
         attention_mask=tree_attention_mask(past, ancestors, model.dtype),
         position_ids=tree_position_ids(batch.lengths + 4, node_depths(ancestors)), cache=cache, use_cache=True)
    visible = prompt_rows(batch.attention_mask)
    both(model, lean, input_ids=batch.input_ids, attention_mask=additive_mask(visible, model.dtype)[:, None],
         position_ids=batch.position_ids, logits_to_keep=1)


def test_calls_it_does_not_serve_go_to_the_model() -> None:
    """Hidden states, training mode and other arguments run transformers' own forward; models it
    cannot match bit for bit get no lean forward."""
    model = llama(4)
    use_lean_forward(model)
    lean = forward_of(model)
    ids = torch.randint(1, VOCAB, (2, 6))
    out = lean(input_ids=ids, output_hidden_states=True)
    assert not isinstance(out, LeanOutput) and len(out.hidden_states) == 4
    assert not isinstance(lean(input_ids=ids, return_dict=True), LeanOutput)
    model.train()
    assert not isinstance(lean(input_ids=ids), LeanOutput)
    model.eval()
    assert isinstance(lean(input_ids=ids), LeanOutput)
    model.to(torch.bfloat16)  # after it was given one: transformers' forward, whose bits these are
    assert not isinstance(lean(input_ids=ids), LeanOutput)
    model.float()
    drop_lean_forward(model)
    assert forward_of(model) is model
    assert not eligible(llama(5, num_key_value_heads=2))  # grouped-query attention
    assert not eligible(llama(5, attention_bias=True))
    assert not eligible(llama(5, attn_implementation="eager"))
    assert not eligible(llama(5).to(torch.bfloat16))
    assert eligible(use_packed_attention(llama(5)))  # recspec's SDPA is transformers' for multi-head attention


def test_a_lean_forward_that_does_not_match_the_installed_transformers_is_not_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check at installation: a lean forward whose bits differ from the model's own (as after a
    transformers release that computes a Llama another way) leaves the model on its own forward."""
    model = llama(6)
    computed = LeanLlama.logits
    monkeypatch.setattr(LeanLlama, "logits", lambda self, *args: computed(self, *args) + 1e-6)
    assert not use_lean_forward(model) and forward_of(model) is model
    monkeypatch.setattr(LeanLlama, "logits", computed)
    assert not use_lean_forward(model)  # checked once per model
    assert use_lean_forward(llama(6)) and forward_of(model) is model


def test_trained_models_get_it_and_decode_the_same(trained_models: Path) -> None:
    """A model recspec loads gets the lean forward; every plain decoder and strict speculation
    return the same items and the same scores (bit for bit) with it as without it."""
    recommender = Recommender.load(trained_models / "target", draft_dir=trained_models / "draft")
    model = recommender.model
    assert forward_of(model) is not model and forward_of(recommender.draft) is not recommender.draft
    examples = recommender.examples("test", 40)
    runs = [("beam", 8, DecodeOptions()), ("tree-beam", 1, DecodeOptions()), ("tree-beam", 16, DecodeOptions()),
            ("tree-beam", 16, DecodeOptions(expand_root=True)), ("spec-strict", 16, DecodeOptions(draft_beams=16)),
            ("beam-sample", 16, DecodeOptions(seed=3))]
    lean = [recommender.recommend(examples, 10, name, batch, options).topk for name, batch, options in runs]
    drop_lean_forward(model)
    drop_lean_forward(recommender.draft)
    for (name, batch, options), mine in zip(runs, lean):
        theirs = recommender.recommend(examples, 10, name, batch, options).topk
        assert torch.equal(mine.items, theirs.items), name
        same(mine.scores, theirs.scores)


def test_bench_forward_times_both_and_checks_the_bits(trained_models: Path, tmp_path: Path) -> None:
    """`python -m benchmarks.lab forward`: every decoder both ways per batch size, the same bits, and the
    decoders it refuses before any work."""
    target, draft = str(trained_models / "target"), str(trained_models / "draft")
    result = lab("forward", "--target", target, "--draft", draft, "--decoder", "tree-beam",
                 "--decoder", "tree-beam+root", "--decoder", "spec-strict", "--batch-size", "1", "--batch-size",
                 "4", "--users", "8", "--repeats", "1", "--out", str(tmp_path), "--name", "fw")
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "fw.json").read_text())["rows"]
    assert [(r["decoder"], r["batch_size"]) for r in rows] == [
        (d, b) for b in (1, 4) for d in ("tree-beam", "tree-beam+root", "spec-strict")]
    assert all(r["same_bits"] and r["transformers_ms"] > 0 and r["lean_ms"] > 0 for r in rows)
    assert "| tree-beam+root | 4 |" in (tmp_path / "fw.md").read_text()
    for extra, message in ((["--decoder", "auto"], "(not: auto)"), (["--decoder", "beam+root"], "(not: beam+root)"),
                           (["--decoder", "spec-strict"], "needs a draft model")):
        result = lab("forward", "--target", target, "--out", str(tmp_path), *extra)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
