"""Which of recspec's CPU speed-ups a model gets, the one switch that turns them off, and what a
call costs under them.

**The policy** (:func:`accelerate`, the one place that installs any of them). Nothing applies where
:func:`unfit` names a reason: the switch is off, the model or its device is not the CPU (CUDA,
``meta``), a parameter is not float32, or the CPU is not x86-64 with AVX2, the CPUs these speed-ups
were built and measured for. Elsewhere:

* a transformers model recspec loads: grouped-query attention packed over several query rows
  (:mod:`~recspec.accel.packed_attention`, SDPA models); an LLM-sized one (:func:`streams_weights`:
  its calls are bound by reading its weights) small-row products (:mod:`~recspec.accel.small_rows`,
  recspec's kernel where it builds) with sibling projections fused (:mod:`~recspec.accel.fused`);
  any other the lean forward where it computes the model's own bits
  (:mod:`~recspec.accel.lean_forward`: float32 multi-head Llamas). The lean forward calls
  ``F.linear`` itself, so only a model whose products stay transformers' gets it;
* a caller's transformers model (``borrowed``: the drop-in's): the lean forward alone, which only
  recspec's decoders reach (:func:`~recspec.accel.lean_forward.forward_of`); its modules, its own
  forward and ``generate`` stay transformers';
* recspec's own draft modules (a text head and its output rows, 1-8 rows a step): small-row
  products on every linear layer, and the ``int8`` groups of layers in int8 where this CPU computes
  int8 right (:mod:`~recspec.accel.int8`), each group of siblings as one product.

**The switch.** ``RECSPEC_ACCEL=0`` in the environment, :func:`set_enabled` ``(False)`` in a
process (for a command's option to call), or ``enabled=False`` for one model: transformers' own
forward and products, and the kernel is never built. ``RECSPEC_ROW_KERNEL=0``, which switched off
the kernel alone before, now reads as ``RECSPEC_ACCEL=0`` and warns once; it goes in the next
release.

**Costs.** Decoding code knows no product's rules: :func:`call_shape` says how many rows a model's
call computes for the rows it is fed (:meth:`CallShape.rows`), and :func:`timing_key` what any
timing depends on here.

This module imports none of the speed-ups at import time (``import recspec.accel`` works on any
OS and builds nothing); :func:`accelerate` imports those that apply when it applies them.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

#: The environment variable that switches every speed-up off when ``0``.
SWITCH = "RECSPEC_ACCEL"
#: The kernel's own switch before accel (deprecated): ``0`` reads as ``RECSPEC_ACCEL=0``.
OLD_SWITCH = "RECSPEC_ROW_KERNEL"

#: Linear weights above this size (twice this project's CPU's 32 MB last-level cache) are read
#: from memory on every call: the calls the small-row products pay for.
STREAMED_BYTES = 64 * 2**20

Model = TypeVar("Model", bound=nn.Module)

_process_switch: bool | None = None  # set_enabled's; None: the environment decides


def set_enabled(on: bool | None) -> None:
    """Switch accel on or off for this process whatever the environment says (None: as the
    environment says again). Models accelerated before keep what they got."""
    global _process_switch
    _process_switch = on


def switched_off() -> str | None:
    """Why accel is off in this process (:func:`set_enabled`, then ``RECSPEC_ACCEL``, then the
    deprecated ``RECSPEC_ROW_KERNEL``), or None where it is on."""
    if _process_switch is not None:
        return None if _process_switch else "set_enabled(False)"
    value = os.environ.get(SWITCH)
    if value is not None:
        return f"{SWITCH}=0" if value == "0" else None
    if os.environ.get(OLD_SWITCH) == "0":
        warn_old_switch()
        return f"{OLD_SWITCH}=0"
    return None


def is_enabled() -> bool:
    """Whether accel is on in this process (:func:`switched_off` names no reason)."""
    return switched_off() is None


@functools.cache
def warn_old_switch() -> None:
    """Say once that ``RECSPEC_ROW_KERNEL=0`` is read as ``RECSPEC_ACCEL=0`` and will go."""
    warnings.warn(f"{OLD_SWITCH}=0 is deprecated and goes in the next release; it now switches off all of "
                  f"recspec's CPU acceleration, as {SWITCH}=0 does: set {SWITCH}=0 instead", FutureWarning,
                  stacklevel=2)


@functools.cache
def platform_unfit() -> str | None:
    """Why this CPU is not one accel serves (x86-64 with AVX2), or None where it is."""
    machine, capability = platform.machine(), torch.backends.cpu.get_cpu_capability()
    if machine not in ("x86_64", "AMD64") or capability not in ("AVX2", "AVX512"):
        return f"this CPU is not x86-64 with AVX2 ({machine}, torch reports {capability})"
    return None


def unfit(device: torch.device | str | None, model: nn.Module | None = None,
          enabled: bool | None = None) -> str | None:
    """Why accel applies nothing on ``device`` (and to ``model``, on its parameters' devices), or
    None where it applies: switched off (``enabled=False``, or with None :func:`switched_off`),
    not the CPU, a floating parameter not float32, or :func:`platform_unfit`."""
    off = "enabled=False" if enabled is False else None if enabled else switched_off()
    if off is not None:
        return f"switched off ({off})"
    parameters = [] if model is None else list(model.parameters())
    places = {parameter.device.type for parameter in parameters}
    if device is not None:
        places.add(torch.device(device).type)
    if places != {"cpu"}:
        return f"not on the CPU ({', '.join(sorted(places)) or 'no parameters'})"
    if any(parameter.is_floating_point() and parameter.dtype != torch.float32 for parameter in parameters):
        return "its parameters are not all float32"
    return platform_unfit()


def streams_weights(model: nn.Module) -> bool:
    """Whether ``model``'s linear weights exceed :data:`STREAMED_BYTES` (an LLM-sized model: each
    call streams them). Smaller models' calls are bound by per-operator overhead, where
    transformers' own products are as fast or faster."""
    return sum(module.weight.numel() * module.weight.element_size() for module in model.modules()
               if isinstance(module, nn.Linear)) > STREAMED_BYTES


def accelerate(model: Model, device: torch.device | str | None = None, enabled: bool | None = None, *,
               borrowed: bool = False, int8: Sequence[Sequence[nn.Linear]] = ()) -> Model:
    """Give ``model`` (in place) every speed-up the policy gives it (module doc) and return it.
    ``device``: where it runs (None: its parameters' device); ``enabled``: False gives it nothing,
    None follows the switch, True accelerates it whatever the switch says (recspec's kernel
    follows the switch alone); ``borrowed``: the model is a caller's, whose modules stay as they
    are (the lean forward alone); ``int8``: groups of a draft's linear layers to compute in int8,
    the layers of a group reading one input (their products become one)."""
    if unfit(device, model, enabled) is not None:
        return model
    from transformers import PreTrainedModel

    from recspec.accel.lean_forward import use_lean_forward
    from recspec.accel.small_rows import use_small_row_products

    if borrowed:
        use_lean_forward(model)
        return model
    if isinstance(model, PreTrainedModel):
        from recspec.accel.fused import use_fused_projections
        from recspec.accel.packed_attention import use_packed_attention

        use_packed_attention(model)
        if streams_weights(model):
            use_fused_projections(use_small_row_products(model))
        else:
            use_lean_forward(model)
    else:
        use_small_row_products(model)
    if int8:
        from recspec.accel.fused import fuse_groups
        from recspec.accel.int8 import int8_engine, use_int8_products

        if int8_engine():
            use_int8_products([layer for group in int8 for layer in group])
            fuse_groups([list(group) for group in int8 if len(group) > 1], int8=True)
    return model


@dataclass(frozen=True)
class CallShape:
    """How a model's calls are computed, as far as their cost goes: ``padded``, a call computes
    more rows than it is fed (MKL's products over padded row counts,
    :func:`~recspec.accel.small_rows.padded_rows`), so it may be fed up to that many at the cost
    of the rows it is fed."""

    padded: bool = False

    def rows(self, rows: int) -> int:
        """The rows a call fed ``rows`` rows computes, and costs (at least ``rows``)."""
        if not self.padded:
            return rows
        from recspec.accel.small_rows import padded_rows

        return padded_rows(rows)


def call_shape(model: nn.Module) -> CallShape:
    """How ``model``'s calls are computed (:class:`CallShape`): padded where its linear layers
    have the padded small-row products (:func:`~recspec.accel.small_rows.pads_rows`)."""
    if unfit(None, model, enabled=True) is not None:  # on another device, or not float32: no product of accel
        return CallShape()
    from recspec.accel.small_rows import pads_rows

    return CallShape(pads_rows(model))


def timing_key(device: torch.device | str) -> dict[str, int | bool]:
    """What accel changes in any timing on ``device``: the versions of its products, attention
    and lean forward, and whether recspec's kernel computes the products (built here at the first
    call); versions 0 and no kernel where accel applies nothing there (:func:`unfit`)."""
    if unfit(device) is not None:
        return {"products": 0, "attention": 0, "lean_forward": 0, "row_kernel": False}
    from recspec.accel.kernel import available
    from recspec.accel.lean_forward import LEAN_FORWARD_VERSION
    from recspec.accel.packed_attention import ATTENTION_VERSION
    from recspec.accel.small_rows import PRODUCTS_VERSION

    return {"products": PRODUCTS_VERSION, "attention": ATTENTION_VERSION, "lean_forward": LEAN_FORWARD_VERSION,
            "row_kernel": available()}
