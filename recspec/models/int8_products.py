"""Int8 products for a draft on the CPU: a faster draft, never a different target.

A text head's drafting step is bound by reading its weights, as a target call is; the largest
of them are the output rows of its draft vocabulary (8,192 x 576, 19 MB in float32 for the
SmolLM2 head). Quantized to int8 per row they are a quarter of the bytes, and the quantized
engine's dynamic linear (activations quantized per call over 8 bits, int8 products, float32 out)
computes a 1-4 row product over them in 60-90 us alone and about 240 us inside a drafting step,
against 470-1,000 us in float32: a step of the head takes 1.9 ms instead of 2.5 (BENCHMARKS.md
"Int8 draft logits"). The head's own layers stay float32: quantizing their activations (the
target's features, with outlier dimensions) cost the head's acceptance 0.68 -> 0.61, the logits
0.6805 -> 0.6792.

Only a draft may use it: the draft's distribution ``q`` changes by the rounding, which
speculative decoding's verification corrects (exact decoders' outputs are the target's whatever
``q`` is); the target's products stay float32.

:func:`int8_linear` computes a product in int8 with the weight kept quantized in an
:class:`Int8Pack` (made at the first call and again when the weight changes). Where int8 cannot
serve a product (not on the CPU, not float32, a gradient asked for, no x86 / fbgemm / oneDNN
quantized engine) the small-row float32 product computes it.
"""

from __future__ import annotations

import warnings

import torch

from recspec.models.small_rows import KeptWeight, needs_grad, small_row_linear

#: The quantized engines whose dynamic linear takes per-row int8 weights on x86 CPUs.
INT8_ENGINES = ("x86", "fbgemm", "onednn")


def int8_engine() -> bool:
    """Whether this build computes int8 dynamic linears here: its current quantized engine is one of
    :data:`INT8_ENGINES` and it has the ops (torch has deprecated quantized tensors; a build
    without them computes every product in float32)."""
    ops = torch.ops.quantized
    return torch.backends.quantized.engine in INT8_ENGINES and all(
        hasattr(ops, name) for name in ("linear_prepack", "linear_dynamic"))


def int8_serves(device: torch.device | str) -> bool:
    """Whether a draft on ``device`` computes its int8 products in int8: the CPU, with
    :func:`int8_engine`."""
    return torch.device(device).type == "cpu" and int8_engine()


def int8_computes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`int8_linear` computes ``x @ weight.T`` in int8: float32 on the CPU, an int8
    engine, no gradient asked for."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and not needs_grad(x, weight, bias)
            and int8_serves(x.device))


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
    dynamic linear (an opaque object; :class:`~recspec.models.small_rows.KeptWeight`)."""

    def make(self, weight: torch.Tensor) -> torch.ScriptObject:
        return torch.ops.quantized.linear_prepack(quantize_rows(weight), None)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: Int8Pack) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[..., in]`` and ``weight`` ``[out, in]``: in int8 where
    :func:`int8_computes` (``weight`` kept quantized in ``pack``; ``x`` quantized per call), else
    the float32 small-row product; returns ``[..., out]`` float32."""
    if not int8_computes(x, weight, bias) or x.numel() == 0:
        return small_row_linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    # reduce_range=False: 8-bit activations (7 bits cost the head's acceptance 0.68 -> 0.21, its layers in int8)
    out = torch.ops.quantized.linear_dynamic(flat, pack.of(weight), False).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias
