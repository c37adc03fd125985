"""Int8 products for a draft (:mod:`recspec.accel.int8`): close to the float32 product
within the rounding of per-row int8 weights and 8-bit activations on each row's own scale, the same
for a row whatever shares its call, the float32 product itself wherever int8 cannot serve, and a
quantized weight that follows its weight."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from recspec.accel.int8 import (Int8Forward, Int8Pack, int8_computes, int8_engine, int8_linear,
                                int8_serves, quantize_rows, use_int8_products)
from recspec.accel.small_rows import small_row_linear

#: The tests of the int8 path itself; the closeness test runs everywhere (float32 where int8 does not serve).
needs_int8 = pytest.mark.skipif(not int8_engine(), reason="no x86 / fbgemm / oneDNN quantized engine, or its 8-bit "
                                                          "products are wrong on this CPU (no VNNI)")


@pytest.mark.parametrize("rows", [1, 2, 4, 16, 200])
@pytest.mark.parametrize(("out", "inp"), [(64, 32), (300, 96), (8192, 576)])
def test_int8_product_is_close_to_float32(rows: int, out: int, inp: int) -> None:
    """Within 3% of the output's scale (a row's weights in steps of max|w| / 127, the activations
    in 256 steps), and on the same side of zero wherever the float32 output is large."""
    generator = torch.Generator().manual_seed(rows * out)
    weight = torch.randn(out, inp, generator=generator) * 0.05
    x = torch.randn(rows, inp, generator=generator)
    with torch.inference_mode():
        got = int8_linear(x[None], weight, None, Int8Pack())[0]
    expected = F.linear(x, weight)
    scale = float(expected.abs().max())
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert float((got - expected).abs().max()) < 0.03 * scale
    large = expected.abs() > 0.2 * scale
    assert bool((got.sign() == expected.sign())[large].all())


@needs_int8
def test_int8_serves_a_draft_on_the_cpu_only() -> None:
    assert int8_serves("cpu") and int8_serves(torch.device("cpu"))
    assert not int8_serves("cuda") and not int8_serves("cuda:1")


@needs_int8
def test_rows_are_quantized_with_their_own_scale() -> None:
    weight = torch.tensor([[1.0, -0.5, 0.25], [100.0, 50.0, -127.0]])
    quantized = quantize_rows(weight)
    torch.testing.assert_close(quantized.dequantize(), weight, rtol=0, atol=1.0 / 127 * 0.5 + 1e-6)
    assert quantized.int_repr()[1].tolist() == [100, 50, -127]


@needs_int8
def test_float32_wherever_int8_cannot_serve() -> None:
    """A gradient asked for, another dtype: the small-row float32 product, bit for bit, and the
    gradient flows."""
    weight = torch.randn(24, 16, requires_grad=True)
    x = torch.randn(3, 16)
    pack = Int8Pack()
    assert not int8_computes(x, weight, None)
    out = int8_linear(x, weight, None, pack)
    assert torch.equal(out, small_row_linear(x, weight)) and pack.packed is None
    out.sum().backward()
    assert weight.grad is not None
    with torch.inference_mode():
        assert int8_computes(x, weight, None)
        double = int8_linear(x.double(), weight.detach().double(), None, pack)
        assert double.dtype == torch.float64 and torch.equal(double, small_row_linear(x.double(), weight.double()))
        assert int8_linear(x[:0], weight, None, pack).shape == (0, 24)


@needs_int8
def test_a_quantized_weight_follows_its_weight() -> None:
    """Kept between calls, made again after an in-place change; a bias is added in float32; a copy
    starts without the packed weight."""
    weight, bias = torch.randn(40, 16), torch.randn(40)
    x = torch.randn(2, 16)
    pack = Int8Pack()
    with torch.inference_mode():
        first = int8_linear(x, weight, bias, pack)
        kept = pack.packed
        int8_linear(x, weight, bias, pack)
        assert pack.packed is kept
        torch.testing.assert_close(first, F.linear(x, weight, bias), rtol=0, atol=0.05 * float(first.abs().max()))
    weight.mul_(-1.0)
    with torch.inference_mode():
        flipped = int8_linear(x, weight, bias, pack)
    assert pack.packed is not kept
    torch.testing.assert_close(flipped - bias, -(first - bias), rtol=0, atol=0.05 * float(first.abs().max()))
    copied = copy.deepcopy(pack)
    assert copied.packed is None and copied.key is None


@needs_int8
def test_each_row_is_quantized_on_its_own_scale_whatever_shares_the_call() -> None:
    """Rows a million times apart in scale are each within 3% of their own output's scale (one
    scale over the call would round the small row to nothing), and a row's product is the same,
    bit for bit, alone or beside other rows."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 96, generator=generator) * 0.05
    x = torch.randn(5, 96, generator=generator) * torch.tensor([1.0, 1e-3, 1e3, 1.0, 0.1])[:, None]
    pack = Int8Pack()
    with torch.inference_mode():
        together = int8_linear(x, weight, None, pack)
        alone = torch.cat([int8_linear(row[None], weight, None, pack) for row in x])
    expected = F.linear(x, weight)
    error = (together - expected).abs().amax(dim=1) / expected.abs().amax(dim=1)
    assert float(error.max()) < 0.03
    assert torch.equal(together, alone)


@needs_int8
def test_int8_layers_compute_their_product_in_int8() -> None:
    """``use_int8_products`` gives a layer the int8 forward over its own weight and bias: close to
    the float32 layer, its quantized weight kept, and the float32 product under a gradient."""
    layer = torch.nn.Linear(64, 48)
    x = torch.randn(3, 64)
    expected = layer(x)
    use_int8_products([layer])
    assert isinstance(layer.forward, Int8Forward)
    with torch.inference_mode():
        got = layer(x)
    assert layer.forward.pack.packed is not None
    torch.testing.assert_close(got, expected.detach(), rtol=0, atol=0.03 * float(expected.detach().abs().max()))
    assert torch.equal(layer(x), small_row_linear(x, layer.weight, layer.bias))  # training: float32, with a gradient
