"""Linear layers over a few rows on the CPU, computed as ``W @ x.T`` over row-major rows.

On the CPUs this project runs on (MKL, AVX2, fp32), ``torch.nn.functional.linear`` with 2 to
128 input rows takes a slow path: SmolLM2's output layer costs 24 ms for 2 rows against 10 ms for
one row and 3.7 ms for the same product written ``W @ x.T`` (BENCHMARKS.md, knowledge section).
One row is no better: a matrix-vector product streams the weights at a third of the speed of the
same product over two rows (the output layer: 10 ms against 3.7 ms), so one row is computed as two.
The product is fast only while ``x`` is row-major (``x.T`` a transposed view); over a column-major
``x`` the kernel is 2-4x slower, and so is the SDPA attention over queries in that layout (it
falls back from the flash kernel to the math one). ``(W @ x.T).T`` itself is column-major, so the
result is made row-major again: a copy of ``rows x out`` floats, against a 1.2-1.7x slower call
without it (BENCHMARKS.md "Row-major products").

:func:`use_small_row_products` gives every ``nn.Linear`` of a model a forward that computes
1..128 rows on the CPU that way: the same product with another summation order (float noise of
order 1e-6), the fast path for everything else. Row counts the matrix kernels handle slowly are
padded with zero rows to one they handle fast (:func:`padded_rows`).
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn
from torch.nn import functional as F

MAX_SMALL_ROWS = 128

#: The version of the small-row forward. Kept timing records (:mod:`recspec.calibration`) carry it,
#: so a change to how calls are computed has them measured again: 2 made products row-major and one
#: row two (1.2-1.7x faster calls of 1-5 rows than 1).
PRODUCTS_VERSION = 2


def padded_rows(rows: int) -> int:
    """The row count to compute ``rows`` (1..128) rows with (one row is computed as two in any
    case). ``W @ x.T`` over ``n`` columns is fast when ``n`` is a multiple of 8, fastest at 16,
    and up to twice as slow in between (SmolLM2's 1536 x 576 product: 0.25 ms for 16 rows, 0.49
    ms for 14, 0.63 ms for 15). Whole calls gain from padding only where the gap is wide: 10..15
    rows are computed as 16 and 21..31 as the next multiple of 8; measured on this project's CPU,
    where padding fewer rows or more cost up to 12% (`recspec bench rows`, BENCHMARKS.md "Row
    counts")."""
    if 10 <= rows <= 15:
        return 16
    if 21 <= rows <= 31:
        return -(-rows // 8) * 8
    return rows


def pads_rows(model: nn.Module) -> bool:
    """Whether calls of ``model`` compute :func:`padded_rows` rows: it sits on the CPU and its
    linear layers have the padded small-row forward (:func:`use_small_row_products`)."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return bool(linears) and all(getattr(module.forward, "__func__", None) is _small_row_forward
                                 and module.weight.device.type == "cpu" for module in linears)


def small_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     pad: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape ``[..., in]`` and ``weight`` ``[out, in]``;
    1..128 rows on the CPU as ``(W @ x.T).T`` over row-major rows (one row as two), over
    :func:`padded_rows` rows with ``pad`` (zero rows added, their outputs dropped); the result
    row-major, shape ``[..., out]``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not 1 <= rows <= MAX_SMALL_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = max(padded_rows(rows) if pad else rows, 2)  # the concatenation is row-major too: one copy at most
    flat = torch.cat((flat, flat.new_zeros(padded - rows, flat.shape[1]))) if padded > rows else flat.contiguous()
    out = torch.mm(weight, flat.T)[:, :rows].T.contiguous().view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _small_row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """:func:`small_row_linear` with the layer's weight and bias."""
    return small_row_linear(x, self.weight, self.bias)


def _unpadded_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """:func:`small_row_linear` with the layer's weight and bias, rows not padded."""
    return small_row_linear(x, self.weight, self.bias, pad=False)


def use_small_row_products(model: nn.Module, pad: bool = True) -> nn.Module:
    """Give every ``nn.Linear`` of ``model`` the small-row forward (in place; ``pad=False``: without
    :func:`padded_rows`, what `recspec bench rows` compares against); returns ``model``."""
    forward = _small_row_forward if pad else _unpadded_forward
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = MethodType(forward, module)
    return model
