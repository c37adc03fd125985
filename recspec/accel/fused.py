"""Sibling linear layers that read the same input, computed as one product.

A decoder layer of a Llama-family model projects the same hidden states three times for attention
(``q_proj``, ``k_proj``, ``v_proj``) and twice for its MLP (``gate_proj``, ``up_proj``). Over 3-128
rows on the CPU each is oneDNN's product over its packed weight (:mod:`recspec.accel.small_rows`),
and the small ones stream their weights badly: SmolLM2's 192 x 576 key and value products take
several times the time their weights take to read. One product over the concatenated weights,
packed once, streams them together, so a call over 3-16 rows is cheaper. The outputs are
bit-identical: oneDNN computes every output column with the same summation whatever columns
share the product. One and two rows (MKL's product, every plain decoding step) are computed by
each sibling alone: fused as MKL products over a plain concatenated copy, whole calls ran
slower. Where recspec's kernel serves (:mod:`recspec.accel.kernel`), every row
count from 1 to 128 is one kernel product over the concatenated panels, bit-identical too (each
output column is its own chain of multiply-adds).

transformers calls the siblings one after another on the same tensor (``self.q_proj(hidden_states)``,
then ``k_proj``, then ``v_proj``), so :class:`FusedProjections` needs no change to the model's own
code: the first sibling's forward computes every sibling's output and keeps the others' for their
own calls on that same tensor object; any other call (another input, 1-2 rows without the kernel,
a product that needs a gradient, a sibling called first out of turn) is computed by the sibling
alone, as before.
The kept outputs and the tensor they belong to are replaced in one assignment, so two threads
running the same model never take each other's outputs. The packed concatenation replaces the
siblings' own packs: no memory is added.

A draft whose layers compute in int8 (:mod:`recspec.accel.int8`: a text head's decoder
layer, q, k, v and gate, up) fuses its siblings the same way, with ``int8``: one int8 product over
the concatenated weights, quantized once, for any row count (a head's steps are 1-8 rows). Its
outputs are bit-identical too: each activation row is quantized on its own scale and each weight row
on its own, so an output column does not depend on the columns beside it. The quantized engine's
dynamic linear has a fixed cost per call whatever its size, and a head's step makes seven calls
unfused.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from recspec.accel.int8 import Int8Forward, Int8Pack, int8_computes
from recspec.accel.small_rows import (MAX_SMALL_ROWS, PACKED_ROWS, KeptWeight, RowPanels, SmallRowForward, has_onednn,
                                      kernel_computes, needs_grad, new_pack)

#: The sibling groups of a transformers Llama-family layer fused, by attribute name.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections:
    """``layers`` (linear layers with the small-row forward, or the int8 one with ``int8``; one input
    width, all with a bias or none) computed as one product where :meth:`fuses` says so (module
    doc)."""

    def __init__(self, layers: list[nn.Linear], int8: bool = False) -> None:
        self.layers, self.int8 = layers, int8
        self.own = [layer.forward for layer in layers]  # each sibling alone
        self.widths = [layer.out_features for layer in layers]
        # the kind of copy the siblings keep: recspec's kernel's panels or oneDNN's packed weight
        kernel = isinstance(getattr(self.own[0], "pack", None), RowPanels)
        self.pack: KeptWeight = Int8Pack() if int8 else new_pack(kernel)
        self.kept: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None

    def fuses(self, x: torch.Tensor, rows: int) -> bool:
        """Whether a call over ``rows`` rows of ``x`` is one product: in int8 where
        :func:`~recspec.accel.int8.int8_computes` (one row or more), else recspec's kernel
        over 1 to 128 rows where the siblings use it, or oneDNN's packed product over
        :data:`~recspec.accel.small_rows.PACKED_ROWS` to 128 rows (the CPU, float32), no gradient
        asked for."""
        weight, bias = self.layers[0].weight, self.layers[0].bias
        if self.int8:
            return rows >= 1 and int8_computes(x, weight, bias)
        if isinstance(self.pack, RowPanels):
            return 1 <= rows <= MAX_SMALL_ROWS and kernel_computes(x, weight, bias)
        return (PACKED_ROWS <= rows <= MAX_SMALL_ROWS and x.device.type == "cpu" and x.dtype == weight.dtype
                and has_onednn(x.dtype) and not needs_grad(x, weight, bias))

    def __call__(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s output over ``x`` ``[..., in]``: ``[..., out_index]``. The common calls
        of 1-2 rows cost a few attribute reads more than the sibling's own forward."""
        kept = self.kept
        if kept is not None and kept[0] is x:
            part = kept[1].pop(index, None)
            if part is not None:
                return part
        rows = x.numel() // x.shape[-1] if index == 0 and x.shape[-1] else 0
        if not self.fuses(x, rows):
            return self.own[index](x)
        bias = None if self.layers[0].bias is None else torch.cat([layer.bias for layer in self.layers])
        out = self.pack.linear(x.reshape(rows, x.shape[-1]), *(layer.weight for layer in self.layers), bias=bias)
        parts = [part.contiguous().view(*x.shape[:-1], width) for part, width in
                 zip(out.split(self.widths, dim=1), self.widths)]
        self.kept = (x, dict(enumerate(parts[1:], start=1)))
        return parts[0]

    def __getstate__(self) -> dict:
        """A copy of the model (``copy.deepcopy``, a framework serialising it) keeps no outputs."""
        return {**self.__dict__, "kept": None}


def fusable(layers: list[object], int8: bool = False) -> bool:
    """Whether ``layers`` can be one product: linear layers with the small-row forward (the int8
    one with ``int8``), one input width, each with a bias or none of them."""
    forward = Int8Forward if int8 else SmallRowForward
    return (all(isinstance(layer, nn.Linear) and isinstance(layer.forward, forward) for layer in layers)
            and len({layer.in_features for layer in layers}) == 1
            and len({layer.bias is None for layer in layers}) == 1)


def sibling_groups(model: nn.Module, siblings: tuple[tuple[str, ...], ...] = SIBLINGS) -> list[list[nn.Linear]]:
    """Every group of ``siblings`` (attribute names) that a module of ``model`` has as linear
    layers, in module order."""
    groups = []
    for module in list(model.modules()):
        for names in siblings:
            layers = [getattr(module, name, None) for name in names]
            if all(isinstance(layer, nn.Linear) for layer in layers):
                groups.append(layers)
    return groups


def use_fused_projections(model: nn.Module, siblings: tuple[tuple[str, ...], ...] = SIBLINGS,
                          int8: bool = False) -> nn.Module:
    """Fuse every group of ``siblings`` (attribute names) of ``model`` (in place, after
    :func:`~recspec.accel.small_rows.use_small_row_products`, or with ``int8`` after
    :func:`~recspec.accel.int8.use_int8_products`; groups whose layers do not qualify,
    :func:`fusable`, are left as they are): each sibling's forward becomes its group's call with
    its index; returns ``model``."""
    fuse_groups(sibling_groups(model, siblings), int8)
    return model


def fuse_groups(groups: list[list[nn.Linear]], int8: bool = False) -> None:
    """Fuse each of ``groups`` (sibling linear layers reading one input) that is :func:`fusable`,
    in place: each layer's forward becomes its group's call with its index."""
    for layers in groups:
        if fusable(layers, int8):
            group = FusedProjections(layers, int8)
            for index, layer in enumerate(layers):
                layer.forward = functools.partial(group, index)
