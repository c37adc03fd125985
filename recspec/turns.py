"""Timing contenders in turns: the order in which they run, and runs that alternate them part by
part (user by user, or batch by batch) so that a drift of the machine's speed reaches them all
alike. Used by the benchmarks and by ``--decoder auto``'s timing probe."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from recspec.data.splits import Examples


def turn_order(names: Sequence[str], repeat: int) -> list[str]:
    """The order in which ``names`` run in timed round ``repeat``: a Williams design, so that over
    ``n`` rounds (``2n`` for an odd count) every name runs first once and right after every other
    name equally often. A plain rotation keeps the cyclic order, so each name would always follow
    the same one and carry its after-effects (caches, allocator state) into every timing."""
    n = len(names)
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    order = [names[(b + repeat) % n] for b in base]
    return order[::-1] if n % 2 and (repeat // n) % 2 else order


def take_turns(decoders: dict[str, Callable[[Any], Any]], parts: Sequence[Any], repeats: int, warmup: bool = True,
               charge: Callable[[str, Any, float], float] | None = None) -> tuple[dict[str, list[float]],
                                                                                  dict[str, list[Any]]]:
    """Per decoder: the total seconds of each of ``repeats`` runs over all ``parts`` (one call per
    part: a user, or a batch of users) and the last run's outputs, part by part; one warm-up call
    each on the first part first unless ``warmup`` is False (decoders already warm). Within a run
    the decoders take turns part by part in the balanced order of :func:`turn_order`, so that a
    drift in the machine's speed reaches them all alike (this project's CPU drifted by a third
    within minutes: decoders taking turns a whole run at a time measured that drift).
    ``charge(name, output, seconds)``: the seconds a call counts (default: its wall time)."""
    for decode in decoders.values() if warmup else ():
        decode(parts[0])
    names = list(decoders)
    runs: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, list[Any]] = {}
    for repeat in range(repeats):
        totals = dict.fromkeys(names, 0.0)
        outputs = {name: [] for name in names}
        for index, part in enumerate(parts):
            for name in turn_order(names, repeat * len(parts) + index):
                start = time.perf_counter()
                output = decoders[name](part)
                seconds = time.perf_counter() - start
                totals[name] += seconds if charge is None else charge(name, output, seconds)
                outputs[name].append(output)
        for name in names:
            runs[name].append(totals[name])
    return runs, outputs


def user_batches(examples: Examples, batch_size: int) -> list[Examples]:
    """``examples`` in consecutive batches of ``batch_size`` users (the last one may be smaller): the
    parts the decoders take turns over."""
    return [examples.subset(np.arange(start, min(start + batch_size, len(examples))))
            for start in range(0, len(examples), batch_size)]
