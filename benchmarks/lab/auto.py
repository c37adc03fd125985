"""`python -m benchmarks.lab auto`: ``--decoder auto`` against every exact decoder it chooses among.

For each (target, draft) pair, K and batch size, on the first ``users`` test users: ``beam``,
``tree-beam``, ``tree-beam+root`` (the first identifier level scored in the prompt's call),
``spec-strict`` (fixed N = 2K, the rest of the identifier per round) and ``auto``
(its choice made once per cell before timing, from the measurements kept beside the models;
the time to measure them the first time is reported apart) decode all users, taking turns batch by
batch in a balanced order (:func:`~recspec.turns.take_turns`: a drift of the machine's speed
reaches them all alike, and none always follows the same one: a decoder run right after a wide
speculative one was measured up to 15% slower); the median of ``repeats`` runs is reported. ``auto / best`` is auto's speed over the fastest
exact decoder of the cell (the issue's bar: at least 0.97). Every decoder's items are checked
against ``beam``'s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.auto import choose
from recspec.bench.compare import joined_outputs, same_up_to_ties
from recspec.bench.report import markdown_table, reuse_freed_memory, write_results
from recspec.data.splits import Examples
from recspec.recommend import DecodeOptions, Decoded, Recommender
from recspec.turns import take_turns, user_batches


def _cell(recommender: Recommender, k: int, batch: int, users: int,
          repeats: int) -> tuple[dict[str, list[float]], dict[str, Decoded], str, float]:
    examples = recommender.examples("test", users)
    started = time.perf_counter()
    choice = choose(recommender, k, batch)
    choose_s = time.perf_counter() - started
    runs: dict[str, Callable[[Examples], Decoded]] = {
        "beam": lambda part: recommender.recommend(part, k, "beam", batch),
        "tree-beam": lambda part: recommender.recommend(part, k, "tree-beam", batch),
        "tree-beam+root": lambda part: recommender.recommend(part, k, "tree-beam", batch,
                                                             DecodeOptions(expand_root=True)),
        "spec-strict": lambda part: recommender.recommend(part, k, "spec-strict", batch,
                                                          DecodeOptions(draft_beams=2 * k)),
        "auto": lambda part: recommender.recommend(part, k, choice.decoder, batch, choice.options),
    }
    seconds, batches = take_turns(runs, user_batches(examples, batch), repeats)
    return seconds, joined_outputs(batches), choice.reason, choose_s


def run(out: Path, pairs: Sequence[tuple[Path, Path]], ks: Sequence[int] = (1, 5, 10, 20),
        batches: Sequence[int] = (1, 16), users: int = 32, repeats: int = 3, name: str = "auto") -> str:
    """Benchmark ``auto`` on every pair, K and batch size; write ``{name}.json`` / ``.md``."""
    reuse_freed_memory()
    rows: list[dict[str, Any]] = []
    for target_dir, draft_dir in pairs:
        recommender = Recommender.load(target_dir, draft_dir=draft_dir)
        label = f"{recommender.dataset.name}/{Path(target_dir).name}+{Path(draft_dir).name}"
        for k in ks:
            for batch in batches:
                cell_users = users * max(1, batch // 4)  # whole batches, and runs long enough to time
                seconds, outputs, reason, choose_s = _cell(recommender, k, batch, cell_users, repeats)
                median = {decoder: statistics.median(times) for decoder, times in seconds.items()}
                best = min((decoder for decoder in median if decoder != "auto"), key=median.get)
                rows.append({"target": label, "k": k, "batch": batch, "users": cell_users,
                             "ms_per_user": {d: 1e3 * s / cell_users for d, s in median.items()}, "runs_s": seconds,
                             "best": best, "auto_vs_best": median[best] / median["auto"], "choice": reason,
                             "choose_s": choose_s,
                             "same_as_beam": all(same_up_to_ties(outputs[d].topk, outputs["beam"].topk)
                                                 for d in outputs)})
    markdown = "\n\n".join([
        "# `--decoder auto` against the exact decoders",
        f"{users} test users per cell at batch 1 ({users} x batch / 4 above batch 4), median of {repeats} runs "
        f"(decoders take turns batch by batch, in a balanced order); spec-strict at "
        f"N = 2K; auto's choice is made once per cell before timing (choose s: measuring costs and acceptance "
        f"the first time, then read back). torch threads: {torch.get_num_threads()}.",
        markdown_table(["target", "K", "batch", "users", "beam ms/user", "tree-beam", "tree-beam+root",
                        "spec-strict N=2K", "auto", "best", "auto / best", "same as beam", "choose s", "auto's choice"],
                       [[r["target"], r["k"], r["batch"], r["users"], r["ms_per_user"]["beam"], r["ms_per_user"]["tree-beam"],
                         r["ms_per_user"]["tree-beam+root"], r["ms_per_user"]["spec-strict"], r["ms_per_user"]["auto"],
                         r["best"],
                         f"{r['auto_vs_best']:.2f}x", r["same_as_beam"], r["choose_s"], r["choice"]]
                        for r in rows])])
    write_results(out, name, {"users": users, "repeats": repeats, "rows": rows}, markdown)
    return markdown
