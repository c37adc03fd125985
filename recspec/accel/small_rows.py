"""Linear layers over a few rows on the CPU: matrix products chosen by the number of rows.

**recspec's kernel, 1..128 rows** (:mod:`recspec.accel.kernel`, products version 6): where it
builds (x86-64 with AVX2, a C++ compiler), every float32 product over 1 to 128 rows without a
gradient runs it over the weight kept in panels (:class:`RowPanels`, a second copy of the weight,
made at its first call). It streams the weight once, in order, at the memory's speed: SmolLM2's
products cost the same over 1 to 6 rows, less than MKL's product over 1-2 rows and oneDNN's packed
product over 3-6. Each row's output is the same bits whatever rows share the call. Where the
kernel is not built, the two torch kernels below serve as before.

On the CPUs this project runs on (fp32, 2 threads), ``torch.nn.functional.linear`` with 2 to 128
input rows takes a slow path: SmolLM2's output layer costs several times what the same product
written ``W @ x.T`` costs. Two kernels do better, each over its own range of rows:

* **1..2 rows: MKL's** ``W @ x.T`` over row-major rows (and 3..6 rows where no packed weight is
  kept). One row is computed as two: a matrix-
  vector product streams the weights at a third of the speed of the same product over two rows.
  The product is fast only while ``x`` is row-major (``x.T`` a transposed view); over a
  column-major ``x`` it is several times slower, and so is the SDPA
  attention over queries in that layout (it falls back from the flash kernel to the math one).
  ``(W @ x.T).T`` itself is column-major, so the result is made row-major again.
* **3..128 rows: oneDNN's** linear (``torch.ops.mkldnn._linear_pointwise``, the kernel
  ``torch.compile`` lowers linear layers to on the CPU) over a **packed** weight: a copy of the
  weight in oneDNN's blocked layout (:class:`OneDnnPack`, made once for :data:`PACK_ROWS` rows and
  again whenever the weight changes). Packed, its cost is nearly flat from 3 to 16 rows, close to
  streaming the weight once, where MKL's product grows with the rows and oneDNN over the plain
  weight reorders the weight in every call. The same
  op over the plain weight computes 7..128 rows where no pack is kept (the text head's output
  rows are packed too; a bare :func:`small_row_linear` call is not): from 8 rows it beats MKL.
  The op has no autograd kernel (backpropagating through it silently yields no
  gradient), so a product that needs a gradient, and any dtype other than float32 or a build
  without oneDNN, keeps the MKL product, over :func:`padded_rows` rows (zero rows added, their
  outputs dropped) where that count is faster.

:func:`use_small_row_products` gives every ``nn.Linear`` of a model this forward: the same
product with another summation order (float noise of order 1e-6), the fast path for everything
else.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn import functional as F

from recspec.accel.kernel import available, unsupported
from recspec.errors import RecspecError

MAX_SMALL_ROWS = 128

#: The fewest rows computed with oneDNN's linear over the plain weight (fewer: MKL's product;
#: measured per shape and per whole call on this project's CPU, `recspec bench rows`).
ONEDNN_ROWS = 7

#: The fewest rows computed with oneDNN's linear over a packed weight (:class:`OneDnnPack`).
PACKED_ROWS = 3

#: The row count oneDNN packs a weight for: one pack at 16 serves 3 to 64 rows as well as a pack per
#: count (measured per SmolLM2 shape, packs for 1, 4, 16 and 64 rows; the pack for 1 row is as slow
#: as the plain weight).
PACK_ROWS = 16

#: The version of the small-row forward. Kept timing records (:mod:`recspec.calibration`) carry it,
#: so a change to how calls are computed has them measured again: 2 made products row-major and one
#: row two; 3 computes 7..128 rows with oneDNN; 4 computes
#: 3..128 rows with oneDNN over packed weights; 5 fuses sibling projections
#: (:mod:`recspec.accel.fused`); 6 computes 1..128 rows with recspec's kernel where it
#: is built (:mod:`recspec.accel.kernel`).
PRODUCTS_VERSION = 6


def padded_rows(rows: int) -> int:
    """The row count the MKL product computes ``rows`` (1..128) rows with (one row is computed as
    two in any case). ``W @ x.T`` over ``n`` columns is fast when ``n`` is a multiple of 8, fastest
    at 16, and up to twice as slow in between. Whole calls gain from padding only where the gap is
    wide: 10..15 rows are computed as 16 and 21..31 as the next multiple of 8; padding fewer rows
    or more was slower on the CPUs measured (`python -m benchmarks.lab rows`)."""
    if 10 <= rows <= 15:
        return 16
    if 21 <= rows <= 31:
        return -(-rows // 8) * 8
    return rows


def has_onednn(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear computes products of ``dtype`` here: float32 on a build with oneDNN."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def onednn_rows(rows: int, packed: bool) -> bool:
    """Whether ``rows`` is in oneDNN's range: 7..128 rows, or 3..128 over a ``packed`` weight."""
    return (PACKED_ROWS if packed else ONEDNN_ROWS) <= rows <= MAX_SMALL_ROWS


def mkl_rows(rows: int, pad: bool) -> int:
    """The rows MKL's product computes ``rows`` rows with: :func:`padded_rows` with ``pad``, and one
    row as two in any case."""
    return max(padded_rows(rows) if pad else rows, 2)


def rows_computed(rows: int, pad: bool, onednn: bool, packed: bool, kernel: bool = False) -> int:
    """The rows :func:`small_row_linear` computes a float32 product over ``rows`` rows (1..128, no
    gradient) with, under the settings ``pad``, ``onednn``, ``packed`` (a pack kept) and ``kernel``
    (recspec's kernel over panels kept: every row count as it is)."""
    if (kernel and packed) or (onednn and has_onednn(torch.float32) and onednn_rows(rows, packed)):
        return rows
    return mkl_rows(rows, pad)


def needs_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``F.linear(x, weight, bias)`` must record a gradient (grad mode on and one of them
    requires it): only an autograd product may compute it."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


def onednn_computes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
                    packed: bool = False) -> bool:
    """Whether :func:`small_row_linear` computes ``rows`` rows of ``x`` with oneDNN: in
    :func:`onednn_rows`' range, :func:`has_onednn`, no gradient asked for."""
    return (onednn_rows(rows, packed) and x.dtype == weight.dtype and has_onednn(x.dtype)
            and not needs_grad(x, weight, bias))


class KeptWeight:
    """A copy of a weight in another form (:meth:`make`: packed, quantized) and the product over it
    (:meth:`linear`), made on first use and
    made again whenever the weight is other memory or was changed in place (its version counter
    moved: an optimiser step, ``load_state_dict``).

    The key is the weight's memory (data pointer, shape, strides) and version, not the tensor
    object, so views of one weight share a copy (``weight.detach()`` shares the version counter: a
    text head over the target's own output layer uses the target's pack). The weights the copy was
    made from are held, so their memory cannot be given to another tensor while the key stands."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: object | None = None
        self.source: list[torch.Tensor] | None = None

    def make(self, weight: torch.Tensor) -> object:
        """The copy of ``weight`` (detached) this kind keeps."""
        raise NotImplementedError

    def linear(self, flat: torch.Tensor, *weights: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``flat @ W.T + bias`` for ``flat`` ``[rows, in]`` (at least one row) and ``W`` the
        concatenation of ``weights`` ``[out_i, in]`` along their outputs, computed over the copy
        kept of them: ``[rows, sum(out_i)]``."""
        raise NotImplementedError

    def of(self, *weights: torch.Tensor) -> object:
        """The kept copy of ``weights`` ``[out_i, in]`` (one weight, or several concatenated along
        their outputs), made again if one of them changed."""
        key = tuple((weight.data_ptr(), tuple(weight.shape), weight.stride(),
                     0 if weight.is_inference() else weight._version) for weight in weights)
        if self.packed is None or key != self.key:
            self.source = [weight.detach() for weight in weights]
            self.packed = self.make(self.source[0] if len(weights) == 1 else torch.cat(self.source))
            self.key = key
        return self.packed

    def __getstate__(self) -> dict[str, None]:
        """A copy (``copy.deepcopy`` of a model, a framework serialising it) starts without the kept
        copy, an opaque object that cannot be copied; it is made again at first use."""
        return {"key": None, "packed": None, "source": None}


class OneDnnPack(KeptWeight):
    """A weight's copy in oneDNN's blocked layout for :data:`PACK_ROWS` rows (an opaque tensor as
    large as the weight; :class:`KeptWeight`)."""

    def make(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)

    def linear(self, flat: torch.Tensor, *weights: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.of(*weights), bias, "none", [], "")


class RowPanels(KeptWeight):
    """A weight's copy in panels of 16 output columns for recspec's kernel
    (:mod:`recspec.accel.kernel`; as large as the weight, padded to 16 columns). Made only
    where the kernel is built (:func:`new_pack` chooses); elsewhere it says why."""

    def __init__(self) -> None:
        if not available():
            raise RecspecError(f"recspec's small-row kernel is not built here ({unsupported() or 'its build failed'})")
        super().__init__()

    def make(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.recspec_rows.pack(weight.contiguous())

    def linear(self, flat: torch.Tensor, *weights: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = sum(weight.shape[0] for weight in weights)
        return torch.ops.recspec_rows.linear(flat.contiguous(), self.of(*weights), out,
                                             None if bias is None else bias.contiguous())


def new_pack(kernel: bool = True) -> KeptWeight:
    """The copy a small-row forward keeps of its weight: panels for recspec's kernel with
    ``kernel`` where it is built (:func:`~recspec.accel.kernel.available`), else oneDNN's
    packed weight."""
    return RowPanels() if kernel and available() else OneDnnPack()


#: The copies kept by small-row forwards, by kind and the weight memory they copy (weakly: a copy
#: lives as long as a forward uses it).
_KEPT: weakref.WeakValueDictionary[tuple, KeptWeight] = weakref.WeakValueDictionary()


def shared_pack(weight: torch.Tensor, kernel: bool = True) -> KeptWeight:
    """The copy a small-row forward over ``weight`` keeps (:func:`new_pack`), shared by every
    forward over the same memory: a draft's logits over its target's whole output layer keep no
    second copy of it."""
    pack = new_pack(kernel)
    key = (type(pack), weight.device, weight.data_ptr(), tuple(weight.shape), weight.stride())
    return _KEPT.setdefault(key, pack)


def kernel_computes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether recspec's kernel can compute ``F.linear(x, weight, bias)`` (over 1..128 rows, which
    the caller checks): float32 on the CPU, no gradient asked for."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and not needs_grad(x, weight, bias))


def small_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     pad: bool = True, onednn: bool = True, pack: KeptWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape ``[..., in]`` and ``weight`` ``[out, in]``;
    1..128 rows on the CPU with the kernel the module doc gives them: recspec's over the panels kept
    in a :class:`RowPanels` ``pack``, else oneDNN's over the weight kept in a :class:`OneDnnPack`
    one or over the plain weight (``onednn=False``: MKL's, as before version 3), MKL's over
    :func:`padded_rows` rows with ``pad``; the result row-major, shape ``[..., out]``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not 1 <= rows <= MAX_SMALL_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if isinstance(pack, RowPanels) and kernel_computes(x, weight, bias):
        return pack.linear(flat, weight, bias=bias).view(*x.shape[:-1], weight.shape[0])
    onednn_pack = pack if isinstance(pack, OneDnnPack) else None
    if onednn and onednn_computes(x, weight, bias, rows, packed=onednn_pack is not None):
        out = (torch.ops.mkldnn._linear_pointwise(flat.contiguous(), weight, bias, "none", [], "")
               if onednn_pack is None else onednn_pack.linear(flat, weight, bias=bias))
        return out.view(*x.shape[:-1], weight.shape[0])
    padded = mkl_rows(rows, pad)  # the concatenation is row-major too: one copy at most
    flat = torch.cat((flat, flat.new_zeros(padded - rows, flat.shape[1]))) if padded > rows else flat.contiguous()
    out = torch.mm(weight, flat.T)[:, :rows].T.contiguous().view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class SmallRowForward:
    """The forward :func:`use_small_row_products` gives a linear layer: :func:`small_row_linear`
    with the layer's weight and bias and the chosen kernels (``pad``, ``onednn``, and with ``pack``
    recspec's kernel over the layer's weight in panels, or with ``kernel=False`` or where the kernel
    is not built oneDNN over its packed weight)."""

    def __init__(self, layer: nn.Linear, pad: bool, onednn: bool, pack: bool, kernel: bool = True) -> None:
        self.layer, self.pad, self.onednn = layer, pad, onednn
        self.pack = shared_pack(layer.weight, kernel) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return small_row_linear(x, self.layer.weight, self.layer.bias, self.pad, self.onednn, self.pack)


def pads_rows(model: nn.Module) -> bool:
    """Whether calls of ``model`` compute :func:`padded_rows` rows: it sits on the CPU and its
    linear layers have the padded small-row forward (:func:`use_small_row_products`) with MKL's
    product over every row count (with oneDNN or recspec's kernel, no row count it computes is ever
    padded)."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return bool(linears) and all(isinstance(module.forward, SmallRowForward) and module.forward.pad
                                 and not (module.forward.onednn and has_onednn(module.weight.dtype))
                                 and not isinstance(module.forward.pack, RowPanels)
                                 and module.weight.device.type == "cpu" for module in linears)


def use_small_row_products(model: nn.Module, pad: bool = True, onednn: bool = True, pack: bool = True,
                           kernel: bool = True) -> nn.Module:
    """Give every ``nn.Linear`` of ``model`` the small-row forward (in place; ``kernel=False``: oneDNN
    over packed weights instead of recspec's kernel, and with ``onednn=False`` too MKL's product for
    every row count, ``pad=False``: without :func:`padded_rows`, ``pack=False``: no kept copy, oneDNN
    over the plain weights from :data:`ONEDNN_ROWS` rows; the settings `recspec bench rows`
    compares); returns ``model``. A kept copy of a weight (panels or oneDNN's pack) is made at a
    layer's first call that reads it and costs as much memory as the weight."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = SmallRowForward(module, pad, onednn, pack, kernel)
    return model
