"""`python -m benchmarks.lab rows`: one target call by the number of rows (tree nodes) it feeds, under each
setting of the small-row products (:mod:`recspec.accel.small_rows`): MKL's product for every row
count, unpadded and over :func:`~recspec.accel.small_rows.padded_rows` rows, oneDNN's linear over
the plain weights from :data:`~recspec.accel.small_rows.ONEDNN_ROWS` rows on (version 3), oneDNN's
linear over packed weights from :data:`~recspec.accel.small_rows.PACKED_ROWS` rows on (version 4)
and with sibling projections fused (:mod:`recspec.accel.fused`, version 5), and
recspec's default, its own kernel over 1-128 rows with the siblings fused
(:mod:`recspec.accel.kernel`, version 6); the default also with transformers' own SDPA
attention instead of recspec's packed grouped-query attention (:mod:`recspec.accel.packed_attention`),
which show what each is worth. :func:`products` times a call's products alone, side by side.

MKL's products cost a step function of ``n`` on this CPU (multiples of 8 fast, 16 fastest, counts
in between up to twice as slow), so a tree call's cost is not ``F + r n``; padding computes them
over a fast row count, oneDNN's linear grows smoothly and is faster from 7 rows on, and over packed
weights it is nearly flat from 3 to 16 rows. For each
``n`` the settings are timed in turn (:func:`~recspec.decoding.cost.measure_call_cost` over a
cache of ``past`` tokens, median of ``repeats`` calls), ``rounds`` times, each figure the median
over rounds; the ratios are side-by-side speed-ups of the default. Writes JSON, Markdown and a plot.
:func:`paired` compares two settings call by call, pair by pair, where a small difference hides
in this host's drift (``--pairs``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.bench.report import markdown_table, new_figure, reuse_freed_memory, save_figure, write_results
from recspec.decoding.cost import measure_call_cost
from recspec.accel.packed_attention import PACKED_SDPA
from recspec.errors import RecspecError
from recspec.accel.fused import sibling_groups, use_fused_projections
from recspec.models.hf import load_causal_lm
from recspec.hub import with_cache
from recspec.accel.kernel import available, unsupported
from recspec.accel.small_rows import (ONEDNN_ROWS, PACKED_ROWS, OneDnnPack, RowPanels, rows_computed,
                                      small_row_linear, use_small_row_products)
from recspec.turns import turn_order

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 23, 24, 28, 32, 40, 48, 56, 64)
#: Name -> (pad, onednn, pack, kernel) of :func:`~recspec.accel.small_rows.use_small_row_products`,
#: whether the attention is packed and whether sibling projections are fused; "recspec" is the default.
SETTINGS = {"mkl": (False, False, False, False, True, False), "mkl_padded": (True, False, False, False, True, False),
            "onednn_plain": (True, True, False, False, True, False),
            "unfused": (True, True, True, False, True, False), "onednn_packed": (True, True, True, False, True, True),
            "unpacked": (True, True, True, True, False, True), "recspec": (True, True, True, True, True, True)}


def computed(n: int) -> dict[str, int]:
    """The rows each setting computes a float32 call over ``n`` nodes with
    (:func:`~recspec.accel.small_rows.rows_computed`)."""
    return {setting: rows_computed(n, pad, onednn, pack, kernel and available())
            for setting, (pad, onednn, pack, kernel, _, _) in SETTINGS.items()}


def run(out: Path, model: str = "smollm2", past: int = 356, sizes: Sequence[int] = SIZES, repeats: int = 5,
        rounds: int = 3, name: str = "rows") -> str:
    """Time one call of every size in ``sizes`` under every setting; write ``name.{json,md,png}``
    into ``out`` and return the Markdown."""
    reuse_freed_memory()
    lm = load_causal_lm(model)
    cells = []
    for n in sizes:
        runs: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        for r in range(rounds):
            for setting in turn_order(tuple(SETTINGS), r):
                _install(lm, setting)
                runs[setting].append(1e3 * measure_call_cost(lm, 1, n, repeats, past_len=past))
        ms = {setting: statistics.median(times) for setting, times in runs.items()}
        cells.append({"nodes": n, "rows_computed": computed(n), "ms": ms, "runs_ms": runs,
                      "speedup_over_mkl": ms["mkl"] / ms["recspec"],
                      "speedup_over_mkl_padded": ms["mkl_padded"] / ms["recspec"],
                      "speedup_over_onednn_plain": ms["onednn_plain"] / ms["recspec"],
                      "speedup_over_unfused": ms["unfused"] / ms["recspec"],
                      "speedup_over_onednn_packed": ms["onednn_packed"] / ms["recspec"],
                      "speedup_over_unpacked": ms["unpacked"] / ms["recspec"]})
    _install(lm, "recspec")
    one = cells[0]["ms"]["recspec"] if sizes[0] == 1 else None
    table = markdown_table(["nodes", "MKL ms", "MKL padded ms (rows)", "oneDNN plain ms", "unfused ms",
                            "oneDNN packed ms", "unpacked attention ms", "recspec ms", "x MKL", "x MKL padded",
                            "x oneDNN plain", "x unfused", "x oneDNN packed", "x unpacked"]
                           + (["recspec x one node"] if one else []),
                           [[c["nodes"], round(c["ms"]["mkl"], 1),
                             f"{c['ms']['mkl_padded']:.1f} ({c['rows_computed']['mkl_padded']})",
                             round(c["ms"]["onednn_plain"], 1), round(c["ms"]["unfused"], 1),
                             round(c["ms"]["onednn_packed"], 1), round(c["ms"]["unpacked"], 1),
                             round(c["ms"]["recspec"], 1), f"{c['speedup_over_mkl']:.2f}x",
                             f"{c['speedup_over_mkl_padded']:.2f}x", f"{c['speedup_over_onednn_plain']:.2f}x",
                             f"{c['speedup_over_unfused']:.2f}x", f"{c['speedup_over_onednn_packed']:.2f}x",
                             f"{c['speedup_over_unpacked']:.2f}x"]
                            + ([f"{c['ms']['recspec'] / one:.2f}"] if one else []) for c in cells])
    markdown = (f"# One call of {model} by rows fed, under each setting of the small-row products\n\n"
                f"One row of {past} cached tokens, n new tree nodes; median of {repeats} calls, median over "
                f"{rounds} rounds, settings in turn. MKL: `W @ x.T` for every row count (one row as two), "
                f"padded: over `padded_rows` rows; oneDNN plain: oneDNN's linear over the plain weights from "
                f"{ONEDNN_ROWS} rows on (version 3); unfused: oneDNN's linear over packed weights from "
                f"{PACKED_ROWS} rows on, MKL below (version 4); oneDNN packed: the same with sibling projections "
                f"(q, k, v; gate, up) fused over {PACKED_ROWS} rows or more (version 5); recspec: its own kernel "
                f"over 1-128 rows, siblings fused (version 6{'' if available() else '; NOT BUILT here: oneDNN'}); "
                f"every setting with recspec's packed grouped-query attention but 'unpacked', recspec's products "
                f"with transformers' SDPA attention.\n\n{table}\n")
    results: dict[str, Any] = {"model": model, "past": past, "repeats": repeats, "rounds": rounds,
                               "onednn_rows": ONEDNN_ROWS, "packed_rows": PACKED_ROWS, "row_kernel": available(),
                               "cells": cells}
    write_results(out, name, results, markdown)
    _plot(out / f"{name}.png", cells, model)
    return markdown


def _attention(setting: str) -> str:
    """The attention implementation of ``setting`` (:data:`SETTINGS`)."""
    return PACKED_SDPA if SETTINGS[setting][4] else "sdpa"


def _install(lm, setting: str) -> None:
    """Give ``lm`` the products and attention of ``setting`` (:data:`SETTINGS`)."""
    pad, onednn, pack, kernel, _, fused = SETTINGS[setting]
    use_small_row_products(lm, pad, onednn, pack, kernel)
    if fused:
        use_fused_projections(lm)
    lm.set_attn_implementation(_attention(setting))


class _Calls:
    """One call of ``model`` over ``n`` new nodes after a ``past``-token cache, under a setting of
    :data:`SETTINGS`: each setting's forwards made once (its packs kept between calls), the new
    tokens dropped from the cache after each call, outside its timing
    (:meth:`transformers.DynamicCache.crop`)."""

    def __init__(self, model: str, past: int, settings: Sequence[str]) -> None:
        from transformers import DynamicCache

        reuse_freed_memory()
        self.lm, self.past = load_causal_lm(model), past
        self.linears = [module for module in self.lm.modules() if isinstance(module, torch.nn.Linear)]
        self.forwards = {}
        for setting in settings:
            _install(self.lm, setting)
            self.forwards[setting] = [layer.forward for layer in self.linears]
        self.generator = torch.Generator().manual_seed(0)
        self.vocab = self.lm.config.get_text_config().vocab_size
        self.cache = DynamicCache(config=self.lm.config)
        with torch.inference_mode():
            self.lm(torch.randint(0, self.vocab, (1, past), generator=self.generator), **with_cache(self.lm, self.cache),
                    use_cache=True)

    def ms(self, setting: str, n: int) -> float:
        """The time of one call over ``n`` new nodes under ``setting``, in ms."""
        for layer, forward in zip(self.linears, self.forwards[setting]):
            layer.forward = forward
        self.lm.set_attn_implementation(_attention(setting))
        new = torch.randint(0, self.vocab, (1, n), generator=self.generator)
        positions = torch.arange(self.past, self.past + n)[None]
        with torch.inference_mode():
            start = time.perf_counter()
            self.lm(input_ids=new, position_ids=positions, **with_cache(self.lm, self.cache), use_cache=True)
            seconds = time.perf_counter() - start
            self.cache.crop(-n)
        return 1e3 * seconds

    def pairs(self, first: tuple[str, int], second: tuple[str, int], count: int) -> dict[str, Any]:
        """``count`` pairs of one call under each of two (setting, nodes) arms, the first of a pair
        alternating, after two untimed calls of each: both arms' median ms and the median and
        quartiles of the pairs' ratios (first / second)."""
        arms = (first, second)
        for arm in (*arms, *arms):  # warm-up: packs made, caches grown
            self.ms(*arm)
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(count):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                times[j].append(self.ms(*arms[j]))
        ratios = [a / b for a, b in zip(*times)]
        return {"ms": [statistics.median(t) for t in times], "ratio": statistics.median(ratios),
                "ratio_quartiles": statistics.quantiles(ratios, n=4, method="inclusive")}


def paired(out: Path, model: str = "smollm2", past: int = 356, sizes: Sequence[int] = SIZES, pairs: int = 100,
           settings: tuple[str, str] = ("onednn_packed", "recspec"), name: str = "rows-paired") -> str:
    """Two settings side by side call by call: for every size, ``pairs`` pairs of one call under each
    (the first of a pair alternating), each pair's time ratio, their median and quartiles. On a host
    whose call time drifts by 20% between runs, medians taken apart hide a 5% difference that the
    pairs' ratios show. Writes ``name.{json,md,png}`` into ``out``; returns the Markdown."""
    calls = _Calls(model, past, settings)
    first, second = settings
    cells = []
    for n in sizes:
        cell = calls.pairs((first, n), (second, n), pairs)
        cells.append({"nodes": n, "ms": dict(zip(settings, cell["ms"])), "ratio": cell["ratio"],
                      "ratio_quartiles": cell["ratio_quartiles"]})
    table = markdown_table(["nodes", f"{first} ms", f"{second} ms", f"{first} / {second}, median of pairs",
                            "quartiles"],
                           [[c["nodes"], round(c["ms"][first], 1), round(c["ms"][second], 1), f"{c['ratio']:.3f}x",
                             f"{c['ratio_quartiles'][0]:.3f}-{c['ratio_quartiles'][2]:.3f}"] for c in cells])
    markdown = (f"# One call of {model}, {first} against {second}, pair by pair\n\n"
                f"One row of {past} cached tokens, n new tree nodes; {pairs} pairs of one call under each setting "
                f"per size, the first of a pair alternating; ms are medians, the ratio the median of the pairs' "
                f"ratios (above 1: {second} faster).\n\n{table}\n")
    write_results(out, name, {"model": model, "past": past, "pairs": pairs, "settings": list(settings),
                              "cells": cells}, markdown)
    _plot_ratios(out / f"{name}.png", {f"{first} / {second}": cells}, f"{first} / {second} time",
                 f"{model}: {second} against {first}, pair by pair")
    return markdown


def against(out: Path, model: str = "smollm2", past: int = 356, sizes: Sequence[int] = SIZES, pairs: int = 40,
            base: int = 2, settings: tuple[str, ...] = ("onednn_packed", "recspec"),
            name: str = "rows-against") -> str:
    """What a call over n nodes costs in calls over ``base`` nodes, per setting, call by call: for
    every size and setting, ``pairs`` pairs of a call over ``base`` nodes and one over n (the first
    of a pair alternating), the median and quartiles of the pairs' ratios (n / base). The cost of a
    verifying call relative to a plain decoding step's, free of the host's drift. Writes
    ``name.{json,md,png}`` into ``out``; returns the Markdown."""
    calls = _Calls(model, past, settings)
    cells: dict[str, list[dict[str, Any]]] = {setting: [] for setting in settings}
    for n in sizes:
        for setting in settings:
            cell = calls.pairs((setting, n), (setting, base), pairs)
            cells[setting].append({"nodes": n, "ms": cell["ms"][0], "base_ms": cell["ms"][1],
                                   "ratio": cell["ratio"], "ratio_quartiles": cell["ratio_quartiles"]})
    table = markdown_table(["nodes", *(f"{setting}: n / {base} nodes (quartiles)" for setting in settings)],
                           [[n, *(f"{c['ratio']:.3f} ({c['ratio_quartiles'][0]:.3f}-{c['ratio_quartiles'][2]:.3f})"
                                  for c in (cells[setting][i] for setting in settings))]
                            for i, n in enumerate(sizes)])
    markdown = (f"# One call of {model} over n nodes against one over {base}, pair by pair\n\n"
                f"One row of {past} cached tokens; per size and setting {pairs} pairs of a call over {base} new "
                f"nodes and one over n, the first of a pair alternating; the median of the pairs' time ratios "
                f"(n / {base}) and their quartiles.\n\n{table}\n")
    write_results(out, name, {"model": model, "past": past, "pairs": pairs, "base": base,
                              "settings": list(settings), "cells": cells}, markdown)
    _plot_ratios(out / f"{name}.png", cells, f"time / a {base}-node call", f"{model}: n nodes against {base}")
    return markdown


def _plot_ratios(path: Path, series: dict[str, list[dict[str, Any]]], ylabel: str, title: str) -> None:
    """Each series' median ratio by nodes, its quartiles shaded, a line at 1."""
    figure, axis = new_figure(figsize=(6, 3.5))
    for label, cells in series.items():
        nodes = [c["nodes"] for c in cells]
        axis.plot(nodes, [c["ratio"] for c in cells], "-o", label=label)
        axis.fill_between(nodes, [c["ratio_quartiles"][0] for c in cells], [c["ratio_quartiles"][2] for c in cells],
                          alpha=0.2)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("tree nodes fed in one call")
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend()
    save_figure(figure, path)


PRODUCT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
#: The products :func:`products` times: MKL's row-major product (one row as two), oneDNN's over its
#: packed weight (products version 5) and recspec's kernel over panels (version 6).
PRODUCTS = ("mkl", "onednn_packed", "kernel")


def call_weights(lm) -> list[torch.Tensor]:
    """The weights one call of ``lm`` streams, as recspec computes them: each group of sibling
    projections (:func:`~recspec.accel.fused.sibling_groups`) concatenated, every other linear
    layer's weight alone; ``[out, in]`` each."""
    groups = sibling_groups(lm)
    grouped = {id(layer) for layers in groups for layer in layers}
    return ([torch.cat([layer.weight.detach() for layer in layers]) for layers in groups]
            + [module.weight.detach() for module in lm.modules()
               if isinstance(module, torch.nn.Linear) and id(module) not in grouped])


def products(out: Path, model: str = "smollm2", sizes: Sequence[int] = PRODUCT_SIZES, repeats: int = 7,
             name: str = "row-products") -> str:
    """Every product of one call of ``model`` (:func:`call_weights`: SmolLM2's 121 weights, 538 MB,
    far more than the CPU's caches, so each is read from memory) over ``n`` rows for each ``n`` in
    ``sizes``, nothing else between them: MKL's, oneDNN's packed and recspec's kernel
    (:data:`PRODUCTS`), in a balanced turn order, ``repeats`` times each, medians; the weights' bytes
    over the median time give each one's read speed. Writes ``name.{json,md,png}``; returns the
    Markdown."""
    if not available():
        raise RecspecError(f"recspec's small-row kernel is not built here ({unsupported()}); nothing to compare")
    reuse_freed_memory()
    weights = call_weights(load_causal_lm(model))
    gigabytes = sum(weight.numel() * weight.element_size() for weight in weights) / 1e9
    packs = {"onednn_packed": [OneDnnPack() for _ in weights], "kernel": [RowPanels() for _ in weights]}
    generator = torch.Generator().manual_seed(0)

    def timed(product: str, n: int) -> Callable[[], float]:
        rows = [torch.randn(n, weight.shape[1], generator=generator) for weight in weights]

        def run() -> float:
            start = time.perf_counter()
            if product == "mkl":  # small_row_linear's MKL path: row-major rows, one row as two
                for weight, x in zip(weights, rows):
                    small_row_linear(x, weight, pad=False, onednn=False)
            else:
                for pack, weight, x in zip(packs[product], weights, rows):
                    pack.linear(x, weight)
            return 1e3 * (time.perf_counter() - start)
        return run

    cells = []
    with torch.inference_mode():
        for n in sizes:
            runs = {product: timed(product, n) for product in PRODUCTS}
            for run in runs.values():  # warm-up: packs made
                run()
            times: dict[str, list[float]] = {product: [] for product in PRODUCTS}
            for r in range(repeats):
                for product in turn_order(PRODUCTS, r):
                    times[product].append(runs[product]())
            ms = {product: statistics.median(t) for product, t in times.items()}
            best_torch = min(ms["mkl"], ms["onednn_packed"])
            cells.append({"rows": n, "ms": ms, "runs_ms": times,
                          "gb_per_s": {product: gigabytes / (v / 1e3) for product, v in ms.items()},
                          "speedup_over_best_torch": best_torch / ms["kernel"]})
    table = markdown_table(["rows", "MKL ms", "oneDNN packed ms", "kernel ms", "kernel GB/s", "best torch GB/s",
                            "kernel x best torch"],
                           [[c["rows"], round(c["ms"]["mkl"], 2), round(c["ms"]["onednn_packed"], 2),
                             round(c["ms"]["kernel"], 2), round(c["gb_per_s"]["kernel"], 1),
                             round(max(c["gb_per_s"]["mkl"], c["gb_per_s"]["onednn_packed"]), 1),
                             f"{c['speedup_over_best_torch']:.2f}x"] for c in cells])
    markdown = (f"# The products of one {model} call, alone, by rows\n\n"
                f"{len(weights)} weights ({gigabytes * 1e3:.0f} MB; sibling projections concatenated), each product "
                f"over n random rows, one after another; median of {repeats} passes, the three products in a "
                f"balanced turn order. MKL: `W @ x.T` over row-major rows (one row as two); oneDNN packed: its "
                f"linear over weights packed once (products version 5); kernel: recspec's over panels (version 6). "
                f"GB/s: the weights' bytes over the time (each product reads its weight once).\n\n{table}\n")
    write_results(out, name, {"model": model, "weights": len(weights), "gigabytes": gigabytes, "repeats": repeats,
                              "cells": cells}, markdown)
    figure, axis = new_figure(figsize=(6, 3.5))
    for product, style in zip(PRODUCTS, (":^", "--d", "-o")):
        axis.plot([c["rows"] for c in cells], [c["ms"][product] for c in cells], style, label=product)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("rows")
    axis.set_ylabel(f"ms for the {len(weights)} products")
    axis.set_title(f"{model}: one call's products by rows")
    axis.legend()
    save_figure(figure, out / f"{name}.png")
    return markdown


def _plot(path: Path, cells: list[dict[str, Any]], model: str) -> None:
    figure, axis = new_figure(figsize=(7, 4))
    nodes = [c["nodes"] for c in cells]
    for setting, style, label in (("mkl", ":^", "MKL"), ("mkl_padded", "--s", "MKL, padded rows"),
                                  ("onednn_plain", "--d", f"oneDNN over plain weights from {ONEDNN_ROWS} rows"),
                                  ("unfused", "-+", f"oneDNN over packed weights from {PACKED_ROWS} rows"),
                                  ("onednn_packed", "-v", "the same, sibling projections fused (version 5)"),
                                  ("unpacked", "-.x", "recspec products, transformers' attention"),
                                  ("recspec", "-o", "recspec (its kernel, siblings fused, packed attention)")):
        axis.plot(nodes, [c["ms"][setting] for c in cells], style, label=label)
    axis.set_xlabel("tree nodes fed in one call")
    axis.set_ylabel("ms per call")
    axis.set_title(f"{model}: one call by rows fed")
    axis.legend()
    save_figure(figure, path)
