"""recspec's CPU acceleration, in one place under one policy (:mod:`recspec.accel.policy`).

:func:`accelerate` gives a model every speed-up that fits it; ``RECSPEC_ACCEL=0`` or
:func:`set_enabled` ``(False)`` turns them all off. The speed-ups, each in its module:

* :mod:`~recspec.accel.small_rows`: linear layers over 1..128 rows by the fastest product for the
  row count, recspec's AVX2 kernel (:mod:`~recspec.accel.kernel`, ``kernel.cpp``, built into the
  cache on first use) where it builds;
* :mod:`~recspec.accel.fused`: sibling projections of one input as one product;
* :mod:`~recspec.accel.int8`: a draft's products in int8;
* :mod:`~recspec.accel.packed_attention`: grouped-query attention over several query rows without
  copying the keys and values;
* :mod:`~recspec.accel.lean_forward`: a small Llama's forward in one function, bit for bit
  transformers'.

Decoding code asks :func:`call_shape` what a call computes and :func:`timing_key` what a timing
depends on, instead of knowing the products' rules. Importing this package builds and loads
nothing.
"""

from recspec.accel.policy import CallShape, accelerate, call_shape, is_enabled, set_enabled, timing_key

__all__ = ["CallShape", "accelerate", "call_shape", "is_enabled", "set_enabled", "timing_key"]
