"""`python -m benchmarks.lab decode`: hf vs beam vs tree-beam on trained targets, side by side in one run.

For each trained target (a `recspec train` folder), batch size B and K, the first ``users`` test
users are cut into batches of B; one *run* decodes all of them with one decoder, and the
decoders take turns run by run (so drift on a busy machine hits them alike). Reported per
decoder: the median over ``repeats`` runs of the total time, users/s, the median per-call latency
per user (for B = 1: the per-user latency), the speed-up over `hf`, the peak memory of one batch
(measured in a separate worker process, see :mod:`recspec.bench.memory`), and whether the decoder
returned the same items with the same scores as `hf` for every user (order may differ only
among scores within 1e-4: the tie rule).

Ceiling: the prefill alone (one forward over each batch's prompts, which every decoder must do
once), i.e. the time beam search would take if its L - 1 decoding steps were free.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.bench.compare import same_up_to_ties
from recspec.bench.report import markdown_table, reuse_freed_memory, target_label, write_results
from recspec.decoding import TopK
from recspec.decoding.prefix import shared_columns
from recspec.decoding.prompts import left_pad
from recspec.decoding.scorer import prefill
from recspec.recommend import BEAM_DECODERS, Recommender


def batches_of(recommender: Recommender, users: int, batch_size: int) -> list[list[torch.Tensor]]:
    """The prompts of the first ``users`` test users, in batches of ``batch_size``."""
    prompts = recommender.encoder.prompts(recommender.examples("test", users))
    return [prompts[start:start + batch_size] for start in range(0, len(prompts), batch_size)]


def _call(recommender: Recommender, decoder: str, k: int) -> Callable[[list[torch.Tensor]], TopK]:
    decode = BEAM_DECODERS[decoder]
    return lambda prompts: decode(recommender.model, prompts, recommender.trie, k, recommender.encoder.pad_id)


def prefill_call(recommender: Recommender) -> Callable[[list[torch.Tensor]], None]:
    """prefill(prompts): the prompts' prefill alone (the shared prefix stored, where declared),
    what every decoder pays once per batch."""

    def run(prompts: list[torch.Tensor]) -> None:
        with torch.inference_mode():
            prefill(recommender.model, left_pad(prompts, recommender.encoder.pad_id, recommender.model.device,
                                                shared_columns(recommender.model, prompts)))

    return run


def time_side_by_side(calls: dict[str, Callable[[list[torch.Tensor]], Any]], batches: list[list[torch.Tensor]],
                      repeats: int) -> dict[str, dict[str, Any]]:
    """Per call name: ``runs_s`` (total seconds of each run over all batches), ``median_s`` and
    ``call_s`` (every timed call). One untimed warm-up batch each; runs alternate between calls."""
    for call in calls.values():
        call(batches[0])
    timings: dict[str, dict[str, Any]] = {name: {"runs_s": [], "call_s": []} for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            total = 0.0
            for batch in batches:
                start = time.perf_counter()
                call(batch)
                seconds = time.perf_counter() - start
                total += seconds
                timings[name]["call_s"].append(seconds)
            timings[name]["runs_s"].append(total)
    for timing in timings.values():
        timing["median_s"] = statistics.median(timing["runs_s"])
    return timings


def _memory_worker(target: str, cells: list[tuple[int, int, str]], users: int) -> list[int]:
    """In a fresh process: peak bytes of decoding the first batch of each (B, K, decoder) cell."""
    from recspec.bench.memory import peak_memory, return_freed_memory

    return_freed_memory()
    torch.set_num_threads(1)
    recommender = Recommender.load(target)
    peaks = []
    for batch_size, k, decoder in cells:
        batch = batches_of(recommender, users, batch_size)[0]
        call = _call(recommender, decoder, k)
        call(batch)  # warm-up: lazily built tables are not the decoder's working memory
        peaks.append(peak_memory(lambda: call(batch), recommender.model.device))
    return peaks


def peak_memory_cells(target: Path, cells: list[tuple[int, int, str]], users: int) -> list[int]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_memory_worker, (str(target), cells, users))


def bench_target(target: Path, ks: Sequence[int], batch_sizes: Sequence[int], users: int,
                 repeats: int) -> list[dict[str, Any]]:
    """Rows for one target: every (batch size, K, decoder) on the first ``users`` test users."""
    recommender = Recommender.load(target)
    name = target_label(recommender.dataset.name, recommender.info.get("preset"), target)
    cells = [(b, k, d) for b in batch_sizes for k in ks for d in BEAM_DECODERS]
    peaks = dict(zip(cells, peak_memory_cells(target, cells, users)))
    rows = []
    for batch_size in batch_sizes:
        batches = batches_of(recommender, users, batch_size)
        count = sum(len(batch) for batch in batches)
        ceiling = time_side_by_side({"prefill": prefill_call(recommender)}, batches, repeats)["prefill"]["median_s"]
        for k in ks:
            calls = {decoder: _call(recommender, decoder, k) for decoder in BEAM_DECODERS}
            timings = time_side_by_side(calls, batches, repeats)
            results = {decoder: TopK.cat([call(batch) for batch in batches]) for decoder, call in calls.items()}
            for decoder, timing in timings.items():
                rows.append({
                    "target": name, "batch": batch_size, "users": count, "k": k, "decoder": decoder,
                    "median_s": timing["median_s"], "runs_s": timing["runs_s"],
                    "latency_ms": 1e3 * statistics.median(timing["call_s"]) / batch_size,
                    "users_per_s": count / timing["median_s"],
                    "speedup_vs_hf": timings["hf"]["median_s"] / timing["median_s"],
                    "prefill_ceiling_s": ceiling, "share_of_ceiling": ceiling / timing["median_s"],
                    "peak_mib": peaks[(batch_size, k, decoder)] / 2**20,
                    "same_items_as_hf": same_up_to_ties(results[decoder], results["hf"]),
                })
    return rows


def run(out: Path, targets: Sequence[Path], ks: Sequence[int] = (1, 5, 10, 20), batch_sizes: Sequence[int] = (1, 16),
        users: int = 64, repeats: int = 3, name: str = "decode") -> str:
    """Benchmark every target; write ``{name}.json`` / ``{name}.md`` into ``out``; return the Markdown."""
    reuse_freed_memory()
    rows = [row for target in targets for row in bench_target(Path(target), ks, batch_sizes, users, repeats)]
    markdown = "\n\n".join([
        "# Top-K decoding: hf vs beam vs tree-beam",
        f"{users} test users per target in batches of B; median of {repeats} runs (decoders alternate run by "
        f"run); latency = median per call / B; ceiling = the prefill alone (one forward over the prompts); "
        f"peak memory of one batch, measured in a separate process.",
        markdown_table(
            ["target", "B", "K", "decoder", "total s", "latency ms/user", "users/s", "x hf", "ceiling s",
             "share of ceiling", "peak MiB", "same as hf"],
            [[r["target"], r["batch"], r["k"], r["decoder"], r["median_s"], r["latency_ms"], r["users_per_s"],
              f"{r['speedup_vs_hf']:.2f}x", r["prefill_ceiling_s"], f"{r['share_of_ceiling']:.0%}",
              f"{r['peak_mib']:.1f}", r["same_items_as_hf"]] for r in rows]),
    ])
    write_results(out, name, {"repeats": repeats, "users": users, "rows": rows}, markdown)
    return markdown
