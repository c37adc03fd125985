"""Int8 products for a draft on the CPU: a faster draft, never a different target.

A text head's drafting step is bound by reading its weights, as a target call is. Quantized to
int8 per row its weights are a quarter of the bytes, and the quantized engine's dynamic linear
(activations quantized per call over 8 bits, int8 products, float32 out) computes a 1-4 row
product in a fraction of the float32 time, the draft logits (8,192 x 576) most of all, so a
drafting step with the draft logits and the head's decoder layer in int8 costs well under its
float32 one.

**Per-row activation scales.** The engine quantizes a product's activations with one scale over
all its rows. A head reads the target's features, whose rows differ in scale (outlier dimensions
at some positions): one scale over 355 prompt positions cost the head's acceptance 0.68 -> 0.61.
:func:`int8_linear` therefore divides each row by its largest magnitude before the product and
multiplies its output row back (``(x / m) W^T m = x W^T``), and adds a row ``[1, -1, 0, ...]``
that pins the call's range to ``[-1, 1]``: every row is quantized on its own scale, the same
whatever other rows share the call (a request's draft does not depend on its batch). With the
decoder layer and logits in int8 the held-out acceptance is 0.6451 against 0.6472 in float32 and
0.6428 with int8 logits alone. The head's input projection stays float32: its input joins the
target's features with a token embedding of another scale (in int8 with the rest: 0.6307).

Only a draft may use it: the draft's distribution ``q`` changes by the rounding, which
speculative decoding's verification corrects (exact decoders' outputs are the target's whatever
``q`` is); the target's products stay float32.

:func:`int8_linear` computes a product in int8 with the weight kept quantized in an
:class:`Int8Pack` (made at the first call and again when the weight changes);
:func:`use_int8_products` gives linear layers that forward. Where int8 cannot serve a product
(not on the CPU, not float32, a gradient asked for, no x86 / fbgemm / oneDNN quantized engine) the
small-row float32 product computes it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from recspec.accel.policy import unfit
from recspec.accel.small_rows import KeptWeight, needs_grad, small_row_linear

#: The quantized engines whose dynamic linear takes per-row int8 weights on x86 CPUs.
INT8_ENGINES = ("x86", "fbgemm", "onednn")

#: What a draft's int8 products are, recorded where the draft shapes a text (relaxed knowledge
#: stores): 1 was the draft logits with one activation scale per call, 2 the logits and the head's
#: decoder layer with per-row scales.
INT8_PRODUCTS_VERSION = 2


#: The largest relative error (Frobenius) of :func:`int8_products_hold`'s check product that
#: counts as right: exact 8-bit arithmetic gives 0.0003 there (simulated in float), the saturating
#: kernels of an AVX2-only CPU 0.55 (measured).
CHECK_TOLERANCE = 0.03


def int8_engine() -> bool:
    """Whether this build computes int8 dynamic linears here, and computes them right: its current
    quantized engine is one of :data:`INT8_ENGINES`, it has the ops (torch has deprecated quantized
    tensors; a build without them computes every product in float32), and
    :func:`int8_products_hold` on this CPU."""
    ops = torch.ops.quantized
    return (torch.backends.quantized.engine in INT8_ENGINES
            and all(hasattr(ops, name) for name in ("linear_prepack", "linear_dynamic"))
            and int8_products_hold(torch.backends.quantized.engine))


@functools.cache
def int8_products_hold(engine: str) -> bool:
    """Whether quantized ``engine``'s 8-bit dynamic linear is right on this CPU, by one seeded check
    product against float32 (once per engine and process). x86 CPUs without VNNI add pairs of
    u8 x s8 products in saturating 16-bit lanes, which the full 8-bit activations used here
    overflow: on an AVX2-only EPYC the products were 20-40% off (measured), so there every product
    stays float32. The check's operands are all in [0.5, 1], so that every pair of products is
    large and of one sign: where the lanes saturate, they all do."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.rand(64, 256, generator=generator) * 0.5 + 0.5
    x = torch.rand(8, 256, generator=generator) * 0.5 + 0.5
    with torch.inference_mode():
        got = int8_rows(x, torch.ops.quantized.linear_prepack(quantize_rows(weight), None))
    expected = x @ weight.T
    return float((got - expected).norm() / expected.norm()) < CHECK_TOLERANCE


def int8_serves(device: torch.device | str) -> bool:
    """Whether a draft on ``device`` computes its int8 products in int8: accel applies there (the
    CPU, switched on: :func:`~recspec.accel.policy.unfit`), with :func:`int8_engine`."""
    return unfit(device) is None and int8_engine()


def int8_computes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`int8_linear` computes ``x @ weight.T`` in int8: float32 on the CPU, an int8
    engine, no gradient asked for, at least two input features."""
    return (x.dtype == torch.float32 and x.shape[-1] > 1 and weight.dtype == torch.float32
            and not needs_grad(x, weight, bias) and x.device.type == "cpu" and int8_engine())


def quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (float32) as a per-row symmetric ``qint8`` tensor: row ``i`` in
    steps of ``max |weight[i]| / 127``."""
    scales = (weight.abs().amax(dim=1).double() / 127).clamp(min=1e-12)
    with warnings.catch_warnings():  # the deprecation of quantized tensors (int8_engine checks the ops exist)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
        return torch.quantize_per_channel(weight, scales, torch.zeros(len(weight), dtype=torch.int64), 0,
                                          torch.qint8)


class Int8Pack(KeptWeight):
    """A weight quantized per row (:func:`quantize_rows`) and packed for the quantized engine's
    dynamic linear (an opaque object; :class:`~recspec.accel.small_rows.KeptWeight`)."""

    def make(self, weight: torch.Tensor) -> torch.ScriptObject:
        return torch.ops.quantized.linear_prepack(quantize_rows(weight), None)

    def linear(self, flat: torch.Tensor, *weights: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_rows(flat, self.of(*weights), bias)


@functools.lru_cache(maxsize=32)
def pin_row(width: int, device: torch.device) -> torch.Tensor:
    """float32 ``[1, width]``, ``[1, -1, 0, ...]``: the row :func:`int8_linear` adds to a call so
    that its activations' range is ``[-1, 1]`` whatever rows share it (made once per width and
    device; never written to)."""
    pin = torch.zeros(1, width, device=device)
    pin[0, :2] = torch.tensor([1.0, -1.0])
    return pin


def int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: Int8Pack) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[..., in]`` and ``weight`` ``[out, in]``: in int8 where
    :func:`int8_computes` (``weight`` kept quantized in ``pack``; each row of ``x`` quantized on its
    own scale, module doc), else the float32 small-row product; returns ``[..., out]`` float32."""
    if not int8_computes(x, weight, bias) or x.numel() == 0:
        return small_row_linear(x, weight, bias)
    return pack.linear(x.reshape(-1, x.shape[-1]), weight, bias=bias).view(*x.shape[:-1], weight.shape[0])


def int8_rows(flat: torch.Tensor, packed: torch.ScriptObject, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``flat @ W.T + bias`` in int8 for ``flat`` float32 ``[rows, in]`` (at least one row) and ``W``
    kept in ``packed`` (:class:`Int8Pack`), each row quantized on its own scale (module doc):
    ``[rows, out]``."""
    largest = flat.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(flat.dtype).tiny)
    # reduce_range=False: 8-bit activations (7 bits cost the head's acceptance 0.68 -> 0.21, its layers in int8)
    out = torch.ops.quantized.linear_dynamic(torch.cat((flat / largest, pin_row(flat.shape[1], flat.device))),
                                             packed, False)
    out = out[:-1].mul_(largest)
    return out if bias is None else out + bias


class Int8Forward:
    """The forward :func:`use_int8_products` gives a linear layer: :func:`int8_linear` with the
    layer's weight and bias, the weight kept quantized in the layer's own :class:`Int8Pack`."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer, self.pack = layer, Int8Pack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.layer.weight, self.layer.bias, self.pack)


def use_int8_products(layers: Iterable[nn.Linear]) -> None:
    """Give each of ``layers`` (a draft's linear layers, in place) the int8 forward
    (:class:`Int8Forward`); a quantized copy of each weight (a quarter of its bytes) is made at its
    first call."""
    for layer in layers:
        layer.forward = Int8Forward(layer)
