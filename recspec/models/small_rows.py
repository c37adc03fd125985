"""Linear layers over a few rows on the CPU, computed as ``W @ x.T``.

On the CPUs this project runs on (MKL, AVX2, fp32), ``torch.nn.functional.linear`` with 2 to
128 input rows takes a slow path: SmolLM2's output layer costs 24 ms for 2 rows against 10 ms for
one row and 7 ms for the same product written ``W @ x.T`` (BENCHMARKS.md, knowledge section).
Exactly those row counts are what tree-attention calls feed a model (LASER / ReSD drafts of 2-64
nodes, prompt lookup, the text decoders' drafts), while plain decoding feeds one row, so the slow
path taxes every speculative method and no baseline step.

:func:`use_small_row_products` gives every ``nn.Linear`` of a model a forward that computes
2..128 rows on the CPU as ``(W @ x.T).T``: the same product with another summation order (float
noise of order 1e-6), the fast path for everything else.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn
from torch.nn import functional as F

MAX_SMALL_ROWS = 128


def small_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape ``[..., in]`` and ``weight`` ``[out, in]``;
    2..128 rows on the CPU as ``(W @ x.T).T`` (shape ``[..., out]``)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not 2 <= rows <= MAX_SMALL_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _small_row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """:func:`small_row_linear` with the layer's weight and bias."""
    return small_row_linear(x, self.weight, self.bias)


def use_small_row_products(model: nn.Module) -> nn.Module:
    """Give every ``nn.Linear`` of ``model`` the small-row forward (in place); returns ``model``."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = MethodType(_small_row_forward, module)
    return model
