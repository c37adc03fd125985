"""`python -m benchmarks.lab prefix`: prefix caching, on and off, side by side in one run.

For a trained target (and optionally its draft), each batch size B and K, the first ``users`` test
users are cut into batches of B; every decoder runs twice, once with the template's fixed prefix
stored (:mod:`recspec.decoding.prefix`, what recspec does by default) and once feeding every prompt
whole (:func:`~recspec.decoding.prefix.prefix_unshared`), the variants taking turns run by run.
Decoders: the prefill alone (what every decoder pays once per batch), ``beam``, ``tree-beam`` and,
with a draft, ``spec-strict`` at N = ``draft_beams``. Reported: median ms per user over ``repeats``
runs, the speed-up of the cached variant, and whether both variants returned the same items for
every user. The prefix's share of the prompt tokens is stated with them. Then, at batch 1, the
speculative ceiling of `python -m benchmarks.lab spec` against ``tree-beam`` in both variants: what prefix
caching does to the most any draft could gain.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.lab.decode import batches_of, prefill_call, time_side_by_side
from recspec.bench.report import machine, markdown_table, reuse_freed_memory, write_results
from recspec.bench.sampling import time_per_user
from recspec.decoding import TopK
from recspec.decoding.prefix import MIN_SHARED, prefix_unshared, shared_columns
from recspec.errors import RecspecError
from recspec.recommend import DecodeOptions, Recommender, run_decoder


def _decoders(recommender: Recommender, k: int, draft_beams: int) -> dict[str, Callable[[list[torch.Tensor]], Any]]:
    """name -> decode(prompts) of one batch: the prefill alone, beam, tree-beam (and spec-strict)."""
    model, pad = recommender.model, recommender.encoder.pad_id

    def decoder(name: str, options: DecodeOptions = DecodeOptions()) -> Callable[[list[torch.Tensor]], TopK]:
        return lambda prompts: run_decoder(name, model, recommender.draft, prompts, recommender.trie, k, pad,
                                           options).topk

    calls: dict[str, Callable[[list[torch.Tensor]], Any]] = {
        "prefill": prefill_call(recommender), "beam": decoder("beam"), "tree-beam": decoder("tree-beam")}
    if recommender.draft is not None:
        calls[f"spec-strict N={draft_beams}"] = decoder("spec-strict", DecodeOptions(draft_beams=draft_beams))
    return calls


def _unshared(call: Callable[[list[torch.Tensor]], Any]) -> Callable[[list[torch.Tensor]], Any]:
    def run(prompts: list[torch.Tensor]) -> Any:
        with prefix_unshared():
            return call(prompts)

    return run


def ceiling_rows(recommender: Recommender, prompts: list[torch.Tensor], k: int, repeats: int) -> list[dict[str, Any]]:
    """Batch 1, both variants: ``tree-beam`` and the speculative ceiling of `python -m benchmarks.lab spec`
    (the target as its own draft at N = K, its verification phase alone: one call over the prompt
    and the target's beams), per user, median of ``repeats`` runs taking turns."""
    model, pad, trie = recommender.model, recommender.encoder.pad_id, recommender.trie
    calls = {"tree-beam": lambda batch: run_decoder("tree-beam", model, None, batch, trie, k, pad),
             "ceiling": lambda batch: run_decoder("spec-strict", model, model, batch, trie, k, pad,
                                                  DecodeOptions(draft_beams=k))}
    variants = {"cached": calls, "whole": {name: _unshared(call) for name, call in calls.items()}}
    runs: dict[str, dict[str, list[float]]] = {variant: {name: [] for name in calls} for variant in variants}
    for repeat in range(repeats):
        for variant, decoders in variants.items():
            for name, seconds in time_per_user(decoders, prompts, 1, warmup=repeat == 0)[0].items():
                runs[variant][name] += seconds
    rows = []
    for variant, times in runs.items():
        tree, ceiling = (1e3 * statistics.median(times[name]) / len(prompts) for name in ("tree-beam", "ceiling"))
        rows.append({"variant": variant, "k": k, "tree_beam_ms_per_user": tree, "ceiling_ms_per_user": ceiling,
                     "ceiling_vs_tree_beam": tree / ceiling, "tree_beam_runs_s": times["tree-beam"],
                     "ceiling_runs_s": times["ceiling"]})
    return rows


def bench(target: Path, draft: Path | None, ks: Sequence[int], batch_sizes: Sequence[int], users: int,
          repeats: int, draft_beams: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Rows (one per batch size, K and decoder), the ceiling rows (:func:`ceiling_rows`) and what
    was shared (prefix and prompt tokens)."""
    recommender = Recommender.load(target, draft_dir=draft)
    prompts = recommender.encoder.prompts(recommender.examples("test", users))
    shared = shared_columns(recommender.model, prompts)
    if not shared:
        raise RecspecError(f"{target}: its prompt template has no shared prefix of at least {MIN_SHARED} tokens "
                           f"(the LLM presets have one); prefix caching changes nothing for it")
    tokens = {"prefix_tokens": shared, "mean_prompt_tokens": statistics.mean(len(prompt) for prompt in prompts)}
    ceilings = [row for k in ks for row in ceiling_rows(recommender, prompts, k, repeats)]
    rows = []
    for batch_size in batch_sizes:
        batches = batches_of(recommender, users, batch_size)
        for k in ks:
            cached = _decoders(recommender, k, max(draft_beams, k))
            calls = {**{f"{name} cached": call for name, call in cached.items()},
                     **{f"{name} whole": _unshared(call) for name, call in cached.items()}}
            timings = time_side_by_side(calls, batches, repeats)
            for name in cached:
                same = None
                if name != "prefill":
                    results = [TopK.cat([calls[f"{name} {variant}"](batch) for batch in batches])
                               for variant in ("cached", "whole")]
                    same = bool(torch.equal(results[0].items, results[1].items))
                on, off = timings[f"{name} cached"]["median_s"], timings[f"{name} whole"]["median_s"]
                rows.append({"batch": batch_size, "k": k, "decoder": name, "users": len(prompts),
                             "cached_ms_per_user": 1e3 * on / len(prompts), "whole_ms_per_user": 1e3 * off / len(prompts),
                             "speedup": off / on, "cached_runs_s": timings[f"{name} cached"]["runs_s"],
                             "whole_runs_s": timings[f"{name} whole"]["runs_s"], "same_items": same})
    return rows, ceilings, tokens


def run(out: Path, target: Path, draft: Path | None = None, ks: Sequence[int] = (10,),
        batch_sizes: Sequence[int] = (1, 16), users: int = 32, repeats: int = 3, draft_beams: int = 20,
        name: str = "prefix") -> str:
    """Benchmark ``target``; write ``{name}.json`` / ``{name}.md`` into ``out``; return the Markdown."""
    reuse_freed_memory()
    rows, ceilings, tokens = bench(Path(target), draft, ks, batch_sizes, users, repeats, draft_beams)
    share = tokens["prefix_tokens"] / tokens["mean_prompt_tokens"]
    markdown = "\n\n".join([
        "# Prefix caching: the shared prompt prefix stored, and every prompt fed whole",
        f"Target {target}{f', draft {draft}' if draft else ''}; {rows[0]['users']} test users in batches of B; "
        f"median of {repeats} runs, the two variants taking turns. Shared prefix: {tokens['prefix_tokens']} of "
        f"{tokens['mean_prompt_tokens']:.1f} prompt tokens on average ({share:.0%}).",
        markdown_table(["B", "K", "decoder", "ms/user, prefix stored", "ms/user, prompt whole", "speed-up",
                        "same items"],
                       [[r["batch"], r["k"], r["decoder"], f"{r['cached_ms_per_user']:.1f}",
                         f"{r['whole_ms_per_user']:.1f}", f"{r['speedup']:.2f}x",
                         "" if r["same_items"] is None else r["same_items"]] for r in rows]),
        "Speculative ceiling at batch 1 (as `python -m benchmarks.lab spec`: the target as its own draft at N = K, its "
        "verification phase alone, i.e. one call over the prompt and the target's beams) against `tree-beam`, "
        "with the prefix stored and with every prompt fed whole:",
        markdown_table(["prompt", "K", "tree-beam ms/user", "ceiling ms/user", "ceiling vs tree-beam"],
                       [["prefix stored" if r["variant"] == "cached" else "fed whole", r["k"],
                         f"{r['tree_beam_ms_per_user']:.1f}", f"{r['ceiling_ms_per_user']:.1f}",
                         f"{r['ceiling_vs_tree_beam']:.2f}x"] for r in ceilings]),
    ])
    write_results(out, name, {"target": str(target), "draft": None if draft is None else str(draft),
                              "repeats": repeats, **tokens, "machine": machine(), "rows": rows,
                              "ceilings": ceilings}, markdown)
    return markdown
