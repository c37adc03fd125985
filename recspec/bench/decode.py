"""`recspec bench decode`: hf vs beam vs tree-beam on trained targets, side by side in one run.

For each trained target (a `recspec train` folder) and each K and batch size: median seconds per
call over ``repeats`` runs after a warm-up, per-user latency, users/s and the speed-up of each
recspec decoder over `hf`; plus whether each decoder returned the same items with the same scores
as `hf` (order may differ only among exactly tied scores). Peak memory is not measured yet.
Ceiling: the prefill alone (one forward over the batch's prompts, which every decoder must do
once), i.e. the time beam search would take if its L - 1 decoding steps were free.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.bench.report import markdown_table, reuse_freed_memory, timed, write_results
from recspec.decoding import TopK
from recspec.decoding.beam import left_pad, prefill
from recspec.recommend import DECODERS, Recommender


def _prefill_seconds(recommender: Recommender, prompts: list[torch.Tensor], repeats: int) -> float:
    batch = left_pad(prompts, recommender.encoder.pad_id, recommender.model.device)

    def run() -> None:
        with torch.inference_mode():
            prefill(recommender.model, batch)

    return timed(run, repeats=repeats)["median_s"]


def bench_target(name: str, recommender: Recommender, ks: Sequence[int], batch_sizes: Sequence[int],
                 users: int, repeats: int) -> list[dict[str, Any]]:
    """Rows for one target: every (batch size, K, decoder) on the first ``users`` test users."""
    examples = recommender.examples("test", users)
    rows = []
    for batch_size in batch_sizes:
        prompts = recommender.encoder.prompts(examples.subset(np.arange(min(batch_size, len(examples)))))
        prefill = _prefill_seconds(recommender, prompts, repeats)
        for k in ks:
            results, times = {}, {}
            for decoder, decode in DECODERS.items():
                def run() -> Any:
                    return decode(recommender.model, prompts, recommender.trie, k, recommender.encoder.pad_id)

                times[decoder] = timed(run, repeats=repeats)
                results[decoder] = run()
            reference = results["hf"]
            for decoder, timing in times.items():
                same = same_up_to_ties(results[decoder], reference)
                rows.append({"target": name, "batch": len(prompts), "k": k, "decoder": decoder,
                             "median_s": timing["median_s"], "runs_s": timing["runs_s"],
                             "per_user_ms": 1e3 * timing["median_s"] / len(prompts),
                             "users_per_s": len(prompts) / timing["median_s"],
                             "speedup_vs_hf": times["hf"]["median_s"] / timing["median_s"],
                             "prefill_ceiling_s": prefill, "share_of_ceiling": prefill / timing["median_s"],
                             "same_items_as_hf": same})
    return rows


def same_up_to_ties(result: TopK, reference: TopK, atol: float = 1e-4) -> bool:
    """Same items with the same scores per user; the order may differ only among tied scores."""
    items_match = torch.equal(result.items.sort(dim=1).values, reference.items.sort(dim=1).values)
    return bool(items_match and torch.allclose(result.scores, reference.scores, atol=atol))


def run(out: Path, targets: Sequence[Path], ks: Sequence[int] = (1, 5, 10, 20), batch_sizes: Sequence[int] = (1, 16),
        users: int = 64, repeats: int = 5) -> str:
    """Benchmark every target; write ``decode.json`` / ``decode.md`` into ``out``; return the Markdown."""
    reuse_freed_memory()
    rows = []
    for target in targets:
        recommender = Recommender.load(target)
        rows += bench_target(f"{recommender.dataset.name}/{recommender.info.get('preset', Path(target).name)}",
                             recommender, ks, batch_sizes, users, repeats)
    markdown = "\n\n".join([
        "# Top-K decoding: hf vs beam vs tree-beam",
        f"Median of {repeats} runs after a warm-up; ceiling = the prefill alone (one forward over the prompts).",
        markdown_table(
            ["target", "B", "K", "decoder", "median s", "ms/user", "users/s", "x hf", "ceiling s",
             "share of ceiling", "same items"],
            [[r["target"], r["batch"], r["k"], r["decoder"], r["median_s"], r["per_user_ms"], r["users_per_s"],
              f"{r['speedup_vs_hf']:.2f}x", r["prefill_ceiling_s"], f"{r['share_of_ceiling']:.0%}",
              r["same_items_as_hf"]] for r in rows]),
    ])
    write_results(out, "decode", {"repeats": repeats, "users": users, "rows": rows}, markdown)
    return markdown
