"""`recspec bench rows`: one target call by the number of rows (tree nodes) it feeds, with the
small-row products padded (:func:`~recspec.models.small_rows.padded_rows`) and without.

The matrix products of a call over ``n`` rows cost a step function of ``n`` on this CPU's MKL
(multiples of 8 fast, 16 fastest, counts in between up to twice as slow), so a tree call's cost is
not ``F + r n``: a 14-node call was measured slower than a 16-node one. Padding computes the
products over a fast row count. For each ``n`` both settings are timed alternately
(:func:`~recspec.decoding.cost.measure_call_cost` over a cache of ``past`` tokens, median of
``repeats`` calls), ``rounds`` times, each figure the median over rounds; the ratio is the side-by-
side speed-up of padding. Writes JSON, Markdown and a plot.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recspec.bench.report import (markdown_table, new_figure, reuse_freed_memory, save_figure, turn_order,
                                  write_results)
from recspec.decoding.cost import measure_call_cost
from recspec.models.hf import load_causal_lm
from recspec.models.small_rows import padded_rows, use_small_row_products

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 23, 24, 28, 32, 40, 48, 56, 64)


def run(out: Path, model: str = "smollm2", past: int = 356, sizes: Sequence[int] = SIZES, repeats: int = 5,
        rounds: int = 3, name: str = "rows") -> str:
    """Time one call of every size in ``sizes`` padded and unpadded; write ``name.{json,md,png}``
    into ``out`` and return the Markdown."""
    reuse_freed_memory()
    lm = load_causal_lm(model)
    cells = []
    for n in sizes:
        runs: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for pad in turn_order((True, False), r):
                use_small_row_products(lm, pad=pad)
                runs[pad].append(measure_call_cost(lm, 1, n, repeats, past_len=past))
        plain, padded = statistics.median(runs[False]), statistics.median(runs[True])
        cells.append({"nodes": n, "rows_computed": padded_rows(n), "plain_ms": 1e3 * plain,
                      "padded_ms": 1e3 * padded, "speedup": plain / padded,
                      "plain_runs_ms": [1e3 * s for s in runs[False]], "padded_runs_ms": [1e3 * s for s in runs[True]]})
    one = cells[0]["padded_ms"] if sizes[0] == 1 else None
    table = markdown_table(["nodes", "rows computed", "unpadded ms", "padded ms", "padding speed-up"]
                           + (["padded x one node"] if one else []),
                           [[c["nodes"], c["rows_computed"], round(c["plain_ms"], 1), round(c["padded_ms"], 1),
                             f"{c['speedup']:.2f}x"] + ([f"{c['padded_ms'] / one:.2f}"] if one else []) for c in cells])
    markdown = (f"# One call of {model} by rows fed, small-row products padded and not\n\n"
                f"One row of {past} cached tokens, n new tree nodes; median of {repeats} calls, median over "
                f"{rounds} alternating rounds.\n\n{table}\n")
    results: dict[str, Any] = {"model": model, "past": past, "repeats": repeats, "rounds": rounds, "cells": cells}
    write_results(out, name, results, markdown)
    _plot(out / f"{name}.png", cells, model)
    return markdown


def _plot(path: Path, cells: list[dict[str, Any]], model: str) -> None:
    figure, axis = new_figure(figsize=(7, 4))
    nodes = [c["nodes"] for c in cells]
    axis.plot(nodes, [c["plain_ms"] for c in cells], "--s", label="unpadded")
    axis.plot(nodes, [c["padded_ms"] for c in cells], "-o", label="padded (recspec)")
    axis.set_xlabel("tree nodes fed in one call")
    axis.set_ylabel("ms per call")
    axis.set_title(f"{model}: one call by rows fed")
    axis.legend()
    save_figure(figure, path)
