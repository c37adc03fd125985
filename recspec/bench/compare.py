"""`recspec bench compare`: recommendation decoders side by side on one model pair, the table
`make demo` prints.

On the first ``users`` test users each decoder decodes all of them once untimed, then
``repeats`` timed times, the decoders taking turns run by run in a balanced order
(:func:`~recspec.bench.report.turn_order`: none always follows the same one; a decoder run right
after a wide speculative one was measured up to 15% slower). Reported per decoder: users/s of the
median run, its speed-up over the first decoder, whether its items are the first decoder's (same items and
scores, order free only among tied scores), and for ``auto`` what it chose and why (chosen once
before timing). ``spec-strict`` runs with ``N = 2K`` draft beams. The ceiling of the table is the
fastest decoder of the run: ``auto`` is measured against it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.auto import choose
from recspec.bench.decode import same_up_to_ties
from recspec.bench.report import markdown_table, reuse_freed_memory, turn_order, write_results
from recspec.errors import RecspecError
from recspec.recommend import DECODERS, DecodeOptions, Decoded, Recommender

#: What `make demo` compares: plain beam search first (every speed-up's reference).
DEMO_DECODERS = ("beam", "tree-beam", "spec-strict", "auto")
#: Exact decoders: their items must equal the reference's.
EXACT = ("hf", "beam", "tree-beam", "spec-strict", "auto")


def take_turns(runs: dict[str, Callable[[], Decoded]], repeats: int) -> tuple[dict[str, list[float]], dict[str, Decoded]]:
    """Each of ``runs`` once untimed, then ``repeats`` timed rounds in which every run goes once, in
    the balanced order of :func:`turn_order`; the seconds of each run's timed calls and its last
    output."""
    for run in runs.values():  # warm-up
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, Decoded] = {}
    names = list(runs)
    for repeat in range(repeats):
        for name in turn_order(names, repeat):
            start = time.perf_counter()
            outputs[name] = runs[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds, outputs


def run(out: Path, target: Path, draft: Path | None, decoders: Sequence[str] = DEMO_DECODERS, k: int = 10,
        batch_size: int = 1, users: int = 200, repeats: int = 3, name: str = "compare") -> str:
    """Compare ``decoders`` (the first is the reference) on the first ``users`` test users of
    ``target`` (with ``draft`` for the speculative ones and ``auto``); write ``{name}.json`` /
    ``.md`` into ``out`` and return the Markdown."""
    unknown = [d for d in decoders if d not in DECODERS]
    if unknown or len(set(decoders)) != len(decoders) or len(decoders) < 2:
        raise RecspecError(f"--decoder: name two or more distinct decoders of {', '.join(DECODERS)}"
                           + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    if min(k, batch_size, users, repeats) < 1:
        raise RecspecError("--k, --batch-size, --users and --repeats must be positive")
    reuse_freed_memory()
    recommender = Recommender.load(target, draft_dir=draft)
    examples = recommender.examples("test", users)
    options = {decoder: DecodeOptions() for decoder in decoders}
    if "spec-strict" in options:
        options["spec-strict"] = DecodeOptions(draft_beams=2 * k)
    reason = ""
    if "auto" in options:
        choice = choose(recommender, k, batch_size)
        reason, options["auto"] = choice.reason, choice.options
    named = {decoder: choice.decoder if decoder == "auto" else decoder for decoder in decoders}
    runs = {decoder: (lambda d=decoder: recommender.recommend(examples, k, named[d], batch_size, options[d]))
            for decoder in decoders}
    seconds, outputs = take_turns(runs, repeats)
    reference = decoders[0]
    median = {decoder: statistics.median(times) for decoder, times in seconds.items()}
    rows = [{"decoder": decoder, "runs_s": seconds[decoder], "users_per_s": len(examples) / median[decoder],
             "speedup": median[reference] / median[decoder],
             "same_items": same_up_to_ties(outputs[decoder].topk, outputs[reference].topk)
             if decoder in EXACT and reference in EXACT else None}
            for decoder in decoders]
    fastest = min((row for row in rows if row["decoder"] != "auto"), key=lambda row: median[row["decoder"]])
    label = f"{recommender.dataset.name}: {Path(target).name}" + (f" + {Path(draft).name}" if draft else "")
    lines = [f"# Decoders side by side ({label})",
             f"{len(examples)} test users, K = {k}, batch {batch_size}, median of {repeats} timed runs (decoders take "
             f"turns); speed-up over {reference}; same items: {reference}'s items and scores. torch threads: "
             f"{torch.get_num_threads()}.",
             markdown_table(["decoder", "users/s", f"x {reference}", "same items"],
                            [[row["decoder"], row["users_per_s"], f"{row['speedup']:.2f}x",
                              "-" if row["same_items"] is None else ("yes" if row["same_items"] else "NO")]
                             for row in rows]),
             f"Fastest: {fastest['decoder']} ({fastest['speedup']:.2f}x over {reference})."]
    if reason:
        lines.append(f"{reason}; auto runs at {median[fastest['decoder']] / median['auto']:.2f}x of the fastest.")
    markdown = "\n\n".join(lines)
    results: dict[str, Any] = {"target": str(target), "draft": str(draft) if draft else None, "k": k,
                               "batch_size": batch_size, "users": len(examples), "repeats": repeats,
                               "auto_choice": reason, "rows": rows}
    write_results(out, name, results, markdown)
    return markdown
