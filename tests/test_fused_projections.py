"""Fused sibling projections (:mod:`recspec.accel.fused`): the same outputs as each
sibling alone (bit for bit on the real SmolLM2), one product per group where recspec's kernel or
oneDNN's packed product computes the rows, each sibling alone everywhere else (1-2 rows without the
kernel, another input, a gradient), a weight changed in place taken up, and a copy of the model that works."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from recspec.accel.fused import FusedProjections, use_fused_projections
from recspec.accel.int8 import int8_engine, use_int8_products
from recspec.accel.kernel import available
from recspec.accel.small_rows import PACKED_ROWS, use_small_row_products
from recspec.hub import with_cache

pytestmark = pytest.mark.usefixtures("one_thread")


def small_gqa_llama(bias: bool = False) -> LlamaForCausalLM:
    """A two-layer random Llama with grouped-query attention (4 query heads over 2 key/value
    heads: q, k and v of different widths), optionally with projection biases."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=bias, mlp_bias=bias,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def groups(model: nn.Module) -> list[FusedProjections]:
    found = {id(layer.forward.func): layer.forward.func for layer in model.modules()
             if isinstance(layer, nn.Linear) and isinstance(getattr(layer.forward, "func", None), FusedProjections)}
    return list(found.values())


def logits_after_prefix(model, prefix: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The logits of ``new`` (int64 ``[1, n]``) after ``prefix`` in the model's cache: float32 ``[n, V]``."""
    cache = DynamicCache(config=model.config)
    model(prefix, **with_cache(model, cache), use_cache=True)
    return model(new, **with_cache(model, cache), use_cache=True).logits[0]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fused_siblings_give_each_siblings_output(bias: bool) -> None:
    """Every group of a random Llama (q, k, v and gate, up per layer) is fused; logits over 1..20 new
    rows equal the unfused model's, and over 3 or more rows the groups computed one product each
    (their other siblings' outputs taken from it)."""
    model = use_small_row_products(small_gqa_llama(bias))
    reference = copy.deepcopy(model)
    use_fused_projections(model)
    assert len(groups(model)) == 2 * model.config.num_hidden_layers
    prefix = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for rows in (1, 2, PACKED_ROWS, 5, 20):
            new = torch.randint(0, 40, (1, rows), generator=torch.Generator().manual_seed(rows))
            fused = logits_after_prefix(model, prefix, new)
            torch.testing.assert_close(fused, logits_after_prefix(reference, prefix, new), rtol=1e-5, atol=1e-5)
            # a fused call leaves nothing behind: every kept output was taken by its sibling
            assert all(group.kept is None or not group.kept[1] for group in groups(model))


def test_one_product_where_a_packed_kernel_computes_each_sibling_alone_elsewhere() -> None:
    """Over 3 rows the first sibling's call computes the group and its siblings' calls on the same
    tensor take their outputs; over 2 rows too where recspec's kernel serves (oneDNN's packed product
    starts at 3); on another tensor or with a gradient each computes alone (and the gradient reaches
    every weight)."""
    model = use_fused_projections(use_small_row_products(small_gqa_llama()))
    attention = model.model.layers[0].self_attn
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    group = q.forward.func
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        expected = [x @ layer.weight.T for layer in (q, k, v)]
        out = q(x)
        assert group.kept is not None and group.kept[0] is x and sorted(group.kept[1]) == [1, 2]
        other = x.clone()
        torch.testing.assert_close(k(other), expected[1])  # another tensor: k alone, the kept outputs stay
        assert sorted(group.kept[1]) == [1, 2]
        for got, want in zip((out, k(x), v(x)), expected):
            torch.testing.assert_close(got, want)
        assert not group.kept[1]
        two = torch.randn(2, 32)
        q(two)
        assert (group.kept[0] is two) == available()  # 2 rows: fused by the kernel only
        for layer in (k, v):
            layer(two)
    x.requires_grad_()
    loss = sum(layer(x).square().sum() for layer in (q, k, v))
    loss.backward()
    assert all(layer.weight.grad is not None and bool(layer.weight.grad.abs().sum() > 0) for layer in (q, k, v))


def test_a_weight_changed_in_place_is_taken_up_and_a_copy_works() -> None:
    """The packed concatenation follows its weights (an in-place change of one sibling, as an optimiser
    step does), and a deep copy of a fused model computes what the model does."""
    model = use_fused_projections(use_small_row_products(small_gqa_llama()))
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        attention.q_proj(x)  # packs the concatenation
        attention.v_proj.weight.mul_(2.0)
        attention.q_proj(x)  # packs it again
        torch.testing.assert_close(attention.v_proj(x), x @ attention.v_proj.weight.T)
        copied = copy.deepcopy(model)  # the original's group holds its last outputs; the copy's none
        modules = set(copied.modules())
        assert len(groups(copied)) == len(groups(model)) and all(
            group.kept is None and all(layer in modules for layer in group.layers) for group in groups(copied))
        new, prefix = torch.randint(0, 40, (1, 5)), torch.randint(0, 40, (1, 6))
        torch.testing.assert_close(logits_after_prefix(copied, prefix, new), logits_after_prefix(model, prefix, new))


def test_smollm2_calls_over_three_or_more_rows_are_bit_identical(smollm2_dir) -> None:
    """The real SmolLM2 as recspec loads it (fused) against the same model loaded again and unfused:
    the 40-token prefix (fused over 40 rows) and one call over 3, 6 and 16 new rows give the same
    logits bit for bit (recspec's kernel and oneDNN sum every output column alike whatever columns
    share the product), and over 1 and 2 rows too (fused by the kernel, alone without it). (A deep copy is not the reference: MKL's sums over 1-2
    rows move by 2e-5 with the weights' alignment in memory.)"""
    from recspec.models.hf import load_causal_lm

    model = load_causal_lm(smollm2_dir)
    assert len(groups(model)) == 2 * model.config.num_hidden_layers
    reference = use_small_row_products(load_causal_lm(smollm2_dir))
    assert not groups(reference)
    prefix = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for rows in (1, 2, 3, 6, 16):
            new = torch.randint(0, 49152, (1, rows), generator=torch.Generator().manual_seed(rows))
            assert torch.equal(logits_after_prefix(model, prefix, new), logits_after_prefix(reference, prefix, new))


class Siblings(nn.Module):
    """Three linear layers over one input, called one after another on the same tensor (as a
    head's attention calls q, k and v)."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.q, self.k, self.v = nn.Linear(48, 64, bias=bias), nn.Linear(48, 16, bias=bias), nn.Linear(48, 16, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.q(x), self.k(x), self.v(x)), dim=-1)


@pytest.mark.skipif(not int8_engine(), reason="no int8 engine, or its 8-bit products are wrong on this CPU")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_int8_siblings_fused_give_each_siblings_int8_output_bit_for_bit(bias: bool) -> None:
    """Int8 siblings (a draft's) fused: over 1..20 rows the same bits as each sibling's own int8
    product (per-row activation and weight scales: a column does not depend on its neighbours),
    from one product (the group's other outputs kept and taken); under a gradient each sibling alone."""
    model = Siblings(bias)
    use_int8_products([model.q, model.k, model.v])
    reference = copy.deepcopy(model)
    use_fused_projections(model, (("q", "k", "v"),), int8=True)
    group = groups(model)
    assert len(group) == 1 and group[0].int8
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 2, 3, 8, 20):
            x = torch.randn(2, rows, 48, generator=generator) * torch.linspace(0.1, 10, rows)[None, :, None]
            assert torch.equal(model(x), reference(x))
            assert group[0].kept is not None and group[0].kept[0] is x and not group[0].kept[1]
    x = torch.randn(3, 48, requires_grad=True)
    torch.testing.assert_close(model(x), reference(x))  # float32 products, each sibling alone
    assert group[0].kept[0] is not x


@pytest.mark.skipif(not int8_engine(), reason="no int8 engine, or its 8-bit products are wrong on this CPU")
def test_an_int8_text_heads_siblings_are_fused() -> None:
    """An int8 text head binding computes q, k, v and gate, up as one int8 product each, and its step
    is the unfused int8 head's, bit for bit."""
    from recspec.accel.int8 import Int8Forward
    from recspec.models.text_head import TextHeadDraft, new_text_head
    from tests.test_speculative import small_llama

    target = small_llama(12, seed=0, width=16, init=0.5).requires_grad_(False)
    bound = TextHeadDraft(new_text_head(target, None, seed=2), target, int8=True)
    assert bound.int8 and len(groups(bound.head)) == 2
    plain = copy.deepcopy(bound.head)
    for layer in plain.decoder_linears():
        layer.forward = Int8Forward(layer)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 5, 16, generator=generator)
    tokens = torch.randint(0, 12, (1, 5), generator=generator)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    with torch.inference_mode():
        fused = bound.step(features, tokens, torch.arange(5)[None], visible)
        alone = plain(features, bound.embed(tokens), torch.arange(5)[None], visible)
    assert all(torch.equal(a, b) for a, b in zip(fused, alone))
