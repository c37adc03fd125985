"""`recspec bench compare`: recommendation decoders side by side on one model pair, the table
`make demo` prints.

On the first ``users`` test users each decoder decodes one batch untimed, then all of them
``repeats`` timed times, the decoders taking turns batch by batch in a balanced order
(:func:`~recspec.turns.take_turns`: a drift of the machine's speed reaches them all alike,
and none always follows the same one: a decoder run right after a wide speculative one can run
slower). Reported per decoder: users/s of the
median run, its speed-up over the first decoder, whether its items are the first decoder's (same items and
scores, order free only among tied scores), and for ``auto`` what it chose and why (chosen once
before timing). ``spec-strict`` and ``spec-beam-sample`` run with ``draft_beams`` (default ``N =
2K``) and ``gamma`` (default: the rest of the identifier; ``spec-relaxed`` takes ``gamma`` only).
``tree-beam+root`` and ``beam-sample+root`` are the two with ``expand_root`` (the first
identifier level fed whole with the prompt). The sampled decoders (``beam-sample`` and its
speculative versions) are compared by speed alone: their items are draws. The ceiling of the
table is the fastest decoder of the run: ``auto`` is measured against it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.auto import choose
from recspec.bench.report import markdown_table, reuse_freed_memory, write_results
from recspec.decoding import TopK
from recspec.errors import RecspecError
from recspec.precision import dtype_name
from recspec.decoding.registry import ITEMS, names
from recspec.recommend import (AUTO, BEAM, DECODERS, ROOT_EXPANDING, SPEC_STRICT, TREE_BEAM, DecodeOptions, Decoded,
                               Recommender)
from recspec.turns import take_turns, user_batches

#: What `make demo` compares: plain beam search first (every speed-up's reference).
#: A decoder named with this suffix (``tree-beam+root``) runs with ``expand_root``.
ROOT_SUFFIX = "+root"
DEMO_DECODERS = (BEAM, TREE_BEAM, TREE_BEAM + ROOT_SUFFIX, SPEC_STRICT, AUTO)
#: Exact decoders: their items must equal the reference's.
EXACT = names(ITEMS, exact=True)
#: How the ``NAME+root`` decoders are named in messages.
ROOT_NAMES = " / ".join(name + ROOT_SUFFIX for name in ROOT_EXPANDING)


def split_root(name: str) -> tuple[str, bool]:
    """A benchmark's decoder name as ``(decoder, expand_root)``: ``tree-beam+root`` is
    ``("tree-beam", True)``."""
    return name.removesuffix(ROOT_SUFFIX), name.endswith(ROOT_SUFFIX)


def unknown_decoders(decoders: Sequence[str]) -> list[str]:
    """The names among ``decoders`` that are neither a decoder nor ``NAME+root`` of one that
    takes ``expand_root``."""
    return [name for name, (decoder, root) in zip(decoders, map(split_root, decoders))
            if decoder not in DECODERS or root and decoder not in ROOT_EXPANDING]


def joined_outputs(outputs: dict[str, list[Decoded]]) -> dict[str, Decoded]:
    """Each decoder's outputs over the batches as one result."""
    return {name: Decoded.joined(parts) for name, parts in outputs.items()}


def same_up_to_ties(result: TopK, reference: TopK, atol: float = 1e-4) -> bool:
    """Same items with the same scores per user; the order may differ only among tied scores."""
    items_match = torch.equal(result.items.sort(dim=1).values, reference.items.sort(dim=1).values)
    return bool(items_match and torch.allclose(result.scores, reference.scores, atol=atol))


def run_compare(out: Path, target: Path, draft: Path | None, decoders: Sequence[str] = DEMO_DECODERS, k: int = 10,
                batch_size: int = 1, users: int = 200, repeats: int = 3, name: str = "compare",
                draft_beams: int | None = None, gamma: int | None = None, dtype: str = "auto",
                draft_dtype: str | None = None) -> str:
    """Compare ``decoders`` (the first is the reference) on the first ``users`` test users of
    ``target`` (with ``draft`` for the speculative ones and ``auto``), the models in ``dtype`` /
    ``draft_dtype`` (:mod:`recspec.precision`); write ``{name}.json`` / ``.md`` into ``out`` and
    return the Markdown."""
    unknown = unknown_decoders(decoders)
    if unknown or len(set(decoders)) != len(decoders) or len(decoders) < 2:
        raise RecspecError(f"--decoder: name two or more distinct decoders of {', '.join(DECODERS)} (or {ROOT_NAMES})"
                           + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    if min(k, batch_size, users, repeats) < 1:
        raise RecspecError("--k, --batch-size, --users and --repeats must be positive")
    reuse_freed_memory()
    recommender = Recommender.load(target, draft_dir=draft, dtype=dtype, draft_dtype=draft_dtype)
    examples = recommender.examples("test", users)
    options = {decoder: DecodeOptions(draft_beams=draft_beams or 2 * k, gamma=gamma,
                                      expand_root=split_root(decoder)[1]) for decoder in decoders}
    reason = ""
    if AUTO in options:
        choice = choose(recommender, k, batch_size)
        reason, options[AUTO] = choice.reason, choice.options
    named = {decoder: choice.decoder if decoder == AUTO else split_root(decoder)[0] for decoder in decoders}
    runs = {decoder: (lambda part, d=decoder: recommender.recommend(part, k, named[d], batch_size, options[d]))
            for decoder in decoders}
    seconds, batches = take_turns(runs, user_batches(examples, batch_size), repeats)
    outputs = joined_outputs(batches)
    reference = decoders[0]
    median = {decoder: statistics.median(times) for decoder, times in seconds.items()}
    rows = [{"decoder": decoder, "runs_s": seconds[decoder], "users_per_s": len(examples) / median[decoder],
             "speedup": median[reference] / median[decoder],
             "same_items": same_up_to_ties(outputs[decoder].topk, outputs[reference].topk)
             if named[decoder] in EXACT and named[reference] in EXACT else None}
            for decoder in decoders]
    fastest = min((row for row in rows if row["decoder"] != AUTO), key=lambda row: median[row["decoder"]])
    label = f"{recommender.dataset.name}: {Path(target).name}" + (f" + {Path(str(draft)).name}" if draft else "")
    lines = [f"# Decoders side by side ({label})",
             f"{len(examples)} test users, K = {k}, batch {batch_size}, median of {repeats} timed runs (decoders take "
             f"turns batch by batch); speed-up over {reference}; same items: {reference}'s items and scores. torch threads: "
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
                               "draft_beams": draft_beams or 2 * k, "gamma": gamma,
                               "batch_size": batch_size, "users": len(examples), "repeats": repeats,
                               "dtype": dtype_name(recommender.model.dtype),
                               "auto_choice": reason, "rows": rows}
    write_results(out, name, results, markdown)
    return markdown
