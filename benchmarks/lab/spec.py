"""`python -m benchmarks.lab spec`: speculative beam search (AtSpeed) against the target's own decoders.

For each (target, draft) pair and K, on the first ``users`` test users decoded one at a time
(batch 1: latency, where speculative decoding pays on a CPU), every decoder runs over all users
once per run, the decoders taking turns user by user in a balanced order; the median of
``repeats`` runs is reported:

* ``hf``, ``beam``, ``tree-beam``: exact beam search (the baselines of strict verification);
* ``spec-strict N=...``: strict top-K verification with the draft, for each N of
  ``draft_beams`` (at least K). On a GPU a verification call costs about the same for 30 or 120
  tree nodes; on a CPU every node costs compute, so N trades acceptance against call cost;
* ``beam-sample`` and ``spec-relaxed``: the target's beam sampling at T = 1 and relaxed
  sampling verification, the speculative version of the same distribution;
* the **ceiling**: an oracle draft at zero cost. Strict search with the target as its own draft
  and N = K drafts exactly the target's beams, so its verification phase alone (one target call
  over the prompt and the target's K beams at every depth that has children, plus the
  verification bookkeeping; its drafting time is left out) is the time a perfect draft would give.

WS@K is a decoder's speed-up (median total time) over a baseline; AS@K the mean accepted steps
per user; the acceptance rate accepted steps / drafted steps. Quality, on ``quality_users`` test
users in batches: Recall / NDCG@K of beam search (which strict verification equals: checked
user by user) and, for each temperature, of the target's beam sampling and of relaxed
verification (atspeed.txt Table 2).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recspec.bench.compare import same_up_to_ties
from recspec.bench.report import markdown_table, reuse_freed_memory, target_label, write_results
from recspec.bench.sampling import time_per_user
from recspec.decoding.rounds import SpecStats
from recspec.eval.metrics import recall_ndcg
from recspec.recommend import DecodeOptions, Decoded, Recommender, item_rows, run_decoder


def _decoders(recommender: Recommender, k: int, draft_beams: Sequence[int],
              gamma: int | None) -> dict[str, Callable[[list], Decoded]]:
    """name -> decode(prompts) for one K; the ceiling drafts with the target itself, N = K."""
    target, draft, trie, pad = recommender.model, recommender.draft, recommender.trie, recommender.encoder.pad_id

    def call(name: str, draft_model, opts: DecodeOptions) -> Callable[[list], Decoded]:
        return lambda prompts: run_decoder(name, target, draft_model, prompts, trie, k, pad, opts)

    plain = DecodeOptions(gamma=gamma)
    decoders = {"hf": call("hf", None, plain), "beam": call("beam", None, plain),
                "tree-beam": call("tree-beam", None, plain)}
    for n in sorted({max(n, k) for n in draft_beams}):
        decoders[f"spec-strict N={n}"] = call("spec-strict", draft, DecodeOptions(draft_beams=n, gamma=gamma))
    decoders.update({"beam-sample": call("beam-sample", None, plain),
                     "spec-relaxed": call("spec-relaxed", draft, plain),
                     "ceiling": call("spec-strict", target, DecodeOptions(draft_beams=k))})
    return decoders


def _speed_rows(target: str, k: int, runs: dict[str, list[float]],
                outputs: dict[str, list[Decoded]]) -> list[dict[str, Any]]:
    median = {name: statistics.median(times) for name, times in runs.items()}
    rows = []
    for name, seconds in median.items():
        row: dict[str, Any] = {"target": target, "k": k, "decoder": name, "median_s": seconds, "runs_s": runs[name],
                               "latency_ms": 1e3 * seconds / len(outputs[name]),
                               "ws_vs_hf": median["hf"] / seconds, "ws_vs_beam": median["beam"] / seconds,
                               "ws_vs_tree_beam": median["tree-beam"] / seconds,
                               "share_of_ceiling": median["ceiling"] / seconds}
        stats = [decoded.stats for decoded in outputs[name] if decoded.stats is not None]
        if stats:
            merged = SpecStats.cat(stats).summary()
            row.update(merged)
            row["acceptance"] = merged["accepted_steps"] / max(merged["drafted_steps"], 1e-9)
        if name.startswith("spec-strict"):
            row["same_as_beam"] = all(same_up_to_ties(ours.topk, ref.topk)
                                      for ours, ref in zip(outputs[name], outputs["beam"]))
        rows.append(row)
    return rows


def _quality(recommender: Recommender, k: int, users: int, temperatures: Sequence[float], options: DecodeOptions,
             batch_size: int) -> list[dict[str, Any]]:
    """Recall / NDCG@K of beam search, and of beam sampling and relaxed verification per T."""
    examples = recommender.examples("test", users)
    prompts = recommender.encoder.prompts(examples)
    table = item_rows(recommender.dataset.item_ids, recommender.index.item_keys)
    targets = [examples.targets(i) for i in range(len(examples))]

    def metrics(name: str, opts: DecodeOptions) -> dict[str, Any]:
        decoded = run_decoder(name, recommender.model, recommender.draft, prompts, recommender.trie, k,
                              recommender.encoder.pad_id, opts, batch_size)
        items = decoded.topk.items.cpu().numpy()
        return recall_ndcg(np.where(items >= 0, table[items.clip(0)], -1), targets, [k])

    rows = [{"k": k, "decoder": "beam", "temperature": 0.0, "users": len(examples), **metrics("beam", options)}]
    for temperature in temperatures:
        opts = DecodeOptions(options.draft_beams, options.gamma, temperature, options.seed, options.replacement)
        for name in ("beam-sample", "spec-relaxed"):
            rows.append({"k": k, "decoder": name, "temperature": temperature, "users": len(examples),
                         **metrics(name, opts)})
    return rows


def run(out: Path, pairs: Sequence[tuple[Path, Path]], ks: Sequence[int] = (1, 3, 5, 10, 20), users: int = 64,
        repeats: int = 3, draft_beams: Sequence[int] = (40,), gamma: int | None = None,
        temperatures: Sequence[float] = (0.5, 1.0), quality_ks: Sequence[int] = (5, 10), quality_users: int = 1000,
        quality_batch: int = 64, name: str = "spec") -> str:
    """Benchmark every (target, draft) pair; write ``{name}.json`` / ``{name}.md``; return the Markdown."""
    reuse_freed_memory()
    speed, quality = [], []
    options = DecodeOptions(draft_beams=max(draft_beams), gamma=gamma)
    for target_dir, draft_dir in pairs:
        recommender = Recommender.load(target_dir, draft_dir=draft_dir)
        label = target_label(recommender.dataset.name, recommender.info.get("preset"), target_dir)
        prompts = recommender.encoder.prompts(recommender.examples("test", users))
        for k in ks:
            runs, outputs = time_per_user(_decoders(recommender, k, draft_beams, gamma), prompts, repeats)
            speed += _speed_rows(label, k, runs, outputs)
        for k in quality_ks:
            quality += [{"target": label, **row}
                        for row in _quality(recommender, k, quality_users, temperatures, options, quality_batch)]
    markdown = "\n\n".join([
        "# Speculative beam search (AtSpeed) vs the target's own decoders",
        f"Batch 1, {users} test users, median of {repeats} runs (decoders take turns user by user); "
        f"gamma = {gamma or 'rest of the identifier'}; relaxed and beam sampling at T = 1. Ceiling = an oracle draft "
        f"at zero cost (one target call over the prompt and exactly the target's beams).",
        markdown_table(
            ["target", "K", "decoder", "ms/user", "WS vs hf", "WS vs beam", "WS vs tree-beam", "share of ceiling",
             "AS", "accept", "target calls", "tree nodes", "draft ms", "verify ms", "other ms", "same as beam"],
            [[r["target"], r["k"], r["decoder"], r["latency_ms"], f"{r['ws_vs_hf']:.2f}x", f"{r['ws_vs_beam']:.2f}x",
              f"{r['ws_vs_tree_beam']:.2f}x", f"{r['share_of_ceiling']:.0%}", r.get("accepted_steps", ""),
              f"{r['acceptance']:.0%}" if "acceptance" in r else "", r.get("target_calls", ""), r.get("tree_nodes", ""),
              1e3 * (r["draft_s"] + r["prefill_s"]) if "draft_s" in r else "",
              1e3 * r["verify_s"] if "verify_s" in r else "", 1e3 * r["overhead_s"] if "overhead_s" in r else "",
              r.get("same_as_beam", "")] for r in speed]),
        "## Quality (Recall / NDCG@K on test users)",
        markdown_table(["target", "K", "decoder", "T", "users", "recall", "ndcg"],
                       [[r["target"], r["k"], r["decoder"], r["temperature"], r["users"], r[f"recall@{r['k']}"],
                         r[f"ndcg@{r['k']}"]] for r in quality]),
    ])
    write_results(out, name, {"users": users, "repeats": repeats, "draft_beams": list(draft_beams), "gamma": gamma,
                              "speed": speed, "quality": quality}, markdown)
    return markdown
