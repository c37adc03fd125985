"""`recspec bench knowledge`: knowledge generation methods side by side on the same users / items.

For each side, on the first ``limit`` new-part users (or new items), every variant generates
every text ``repeats`` times, interleaved (entity by entity, variant by variant, so that a change
of machine load hits all variants alike); per text the median wall time is kept. Variants:

* baselines: ``hf`` (transformers greedy ``generate``: the reference of every speed-up),
  ``prompt-lookup`` (transformers prompt lookup decoding), ``ar`` (recspec's greedy loop);
* ``resd``: global pool, greedy verification (= GRP of laser.txt Table 3);
* ``laser-greedy``: routed pools (CRP), greedy; ``laser``: routed pools, relaxed (LASER);
* Table 3 ablation: ``rrp`` (random pools of the collaborative groups' sizes, greedy),
  ``rv+grp`` and ``rv+rrp`` (relaxed verification on the global / random pools);
* draft tree size: ``laser@8``, ``laser@32``, ``laser@64`` (relaxed LASER with 8, 32, 64 draft
  nodes instead of the configured number);
* with a text draft head (``--draft``): ``head`` (greedy speculative decoding with the head's
  trees, its draft logits and decoder layer in int8 on the CPU), ``head-fp32`` (the same head in
  float32), ``head-fixed`` (the same with every tree ``--head-nodes`` nodes), ``head-unpruned``
  (``head``'s trees grown level by level in full: what pruning saves), ``laser-greedy+head`` and
  ``laser+head`` (hybrid trees: LASER's retrieved continuations and the head's branches, greedy
  or relaxed), ``laser-greedy+head-gated`` and ``laser+head-gated`` (the head drafts only in
  rounds whose retrieved tree is shallower than the base config's gate).

Variants that draft from pools need the side's old-part store; the others run without one.

Reported per variant: tokens/s over the whole requests (prefill included) and over the decoding
phase alone, speed-ups against ``hf``, AAL (tokens per target call), ART (retrieval ms per
request), output length, whether greedy variants reproduced ``hf``'s tokens, and the *ceiling*:
the speed-up had every step accepted its longest draft branch (same calls, same time). A
second table measures one target call against the number of tree nodes it scores, which is what
bounds speculative decoding on a CPU.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from recspec.bench.report import markdown_table, reuse_freed_memory, timed, write_results
from recspec.decoding.scorer import score_tree
from recspec.decoding.cache import gather_positions
from recspec.decoding.tree import ancestor_matrix
from recspec.decoding.text_rounds import Generation
from recspec.errors import RecspecError
from recspec.hub import returned_cache
from recspec.knowledge.job import (AR, DRAFTING, HF, LASER, PROMPT_LOOKUP, RESD, KnowledgeConfig, KnowledgeTask,
                                  build_pools, make_generator)
from recspec.knowledge.verify import Verification

GREEDY, RELAXED = Verification("greedy"), Verification("relaxed")
# name -> (method, grouping, relaxed?, draft nodes or None for the configured number, with the text head?)
VARIANTS = {
    "hf": (HF, "router", False, None, False), "prompt-lookup": (PROMPT_LOOKUP, "router", False, None, False),
    "ar": (AR, "router", False, None, False), "resd": (RESD, "global", False, None, False),
    "rrp": (LASER, "random", False, None, False), "laser-greedy": (LASER, "router", False, None, False),
    "rv+grp": (LASER, "global", True, None, False), "rv+rrp": (LASER, "random", True, None, False),
    "laser": (LASER, "router", True, None, False),
    "laser@8": (LASER, "router", True, 8, False), "laser@32": (LASER, "router", True, 32, False),
    "laser@64": (LASER, "router", True, 64, False),
    "head": (AR, "router", False, None, True), "head-fp32": (AR, "router", False, None, True),
    "head-fixed": (AR, "router", False, None, True),
    "head-unpruned": (AR, "router", False, None, True),
    "laser-greedy+head": (LASER, "router", False, None, True),
    "laser+head": (LASER, "router", True, None, True),
    "laser-greedy+head-gated": (LASER, "router", False, None, True),
    "laser+head-gated": (LASER, "router", True, None, True),
}
#: Variants drafted by the text head (need ``--draft``).
HEAD_VARIANTS = tuple(name for name, variant in VARIANTS.items() if variant[4])
#: Variants drafting from the old-part pools (need the side's pool).
POOL_VARIANTS = tuple(name for name, variant in VARIANTS.items() if variant[0] in DRAFTING)
#: Variants whose head trees always hold ``--head-nodes`` nodes (the others size greedy trees by cost).
FIXED_TREES = ("head-fixed",)
#: Variants whose head trees grow every level in full (the same trees as ``head``, more head calls).
UNPRUNED = ("head-unpruned",)
#: Variants whose head computes its draft logits in float32 (the others in int8 on the CPU).
FLOAT32_HEAD = ("head-fp32",)
#: Hybrid variants whose head drafts only where retrieval is shallow (``--head-gate``); the other
#: hybrids draft with the head every round.
GATED = ("laser-greedy+head-gated", "laser+head-gated")
MAIN = ("hf", "prompt-lookup", "ar", "head", "head-fp32", "head-unpruned", "head-fixed", "resd", "laser-greedy",
        "laser-greedy+head", "laser-greedy+head-gated", "laser", "laser+head", "laser+head-gated")
TREE_SIZES = ("laser@8", "laser", "laser@32", "laser@64")
ABLATION = (("GRP", "resd"), ("RRP", "rrp"), ("CRP", "laser-greedy"), ("RV+GRP", "rv+grp"), ("RV+RRP", "rv+rrp"),
            ("LASER (RV+CRP)", "laser"))
ABLATION_NAMES = tuple(name for _, name in ABLATION)
CALL_SIZES = (1, 2, 4, 8, 16, 32, 64)


def variant_config(base: KnowledgeConfig, name: str) -> KnowledgeConfig:
    """``base`` (with its text head in ``draft``, if any) as variant ``name`` runs it."""
    method, grouping, relaxed, nodes, head = VARIANTS[name]
    retrieval = replace(base.retrieval, max_nodes=nodes) if nodes else base.retrieval
    tree = replace(base.head_tree, sized=name not in FIXED_TREES and base.head_tree.sized,
                   prune=name not in UNPRUNED and base.head_tree.prune,
                   gate=base.head_tree.gate if name in GATED else None)
    return replace(base, method=method, grouping=grouping, retrieval=retrieval,
                   verification=replace(base.verification, kind="relaxed") if relaxed else GREEDY,
                   draft=base.draft if head else None, head_tree=tree,
                   head_int8=name not in FLOAT32_HEAD and base.head_int8)


def check_variants(variants: Sequence[str], has_head: bool, sides: dict[str, Path | None],
                   gate: int | None = None) -> None:
    """Refuse an unknown variant, a run without ``hf`` (every speed-up's reference), head variants
    without a head, gated variants without a ``gate`` and pool variants on a side without its pool."""
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "hf" not in variants:
        raise RecspecError(f"--variant: unknown {', '.join(unknown)}" if unknown else
                           "--variant: include hf, the reference of every speed-up")
    headed = [name for name in variants if name in HEAD_VARIANTS]
    if headed and not has_head:
        raise RecspecError(f"--variant {', '.join(headed)} drafts with a text head: pass --draft")
    gated = [name for name in variants if name in GATED]
    if gated and gate is None:
        raise RecspecError(f"--variant {', '.join(gated)} gates the head by retrieval's depth: pass --head-gate")
    pooled = [name for name in variants if name in POOL_VARIANTS]
    bare = [side for side, pool in sides.items() if pool is None]
    if pooled and bare:
        raise RecspecError(f"--variant {', '.join(pooled)} drafts from old-part pools: pass --{bare[0]}-pool")


def bench_side(task: KnowledgeTask, base: KnowledgeConfig, pool: Path | None, limit: int, repeats: int,
               variants: Sequence[str]) -> dict[str, Any]:
    """Rows for one side: every variant on the first ``limit`` new-part entities (``pool``: the
    side's old-part store, for the variants that draft from pools)."""
    texts = task.pool_texts(replace(base, method=RESD, verification=GREEDY), pool) if pool is not None else None
    entities = [int(e) for e in task.entities(base.side, "new", limit)]
    prompts = {e: task.prompt(base, e) for e in entities}
    generators, build_s, pool_sizes = {}, {}, {}
    for name in variants:
        config = variant_config(base, name)
        pools = build_pools(task, config, texts)
        generators[name] = make_generator(task, config, pools)
        if pools is not None:  # build the entities' pools now, outside the timed requests
            for e in entities:
                pools.trie_for(e)
            build_s[name], pool_sizes[name] = pools.build_s, pools.sizes()
    generators["hf"](entities[:1], [prompts[entities[0]]])  # warm-up
    runs: dict[str, dict[int, list[Generation]]] = {name: {e: [] for e in entities} for name in variants}
    load_before = os.getloadavg()
    for e in tqdm(entities, desc=f"bench {base.side} knowledge", unit=base.side):
        for _ in range(repeats):
            for name in variants:
                runs[name][e] += generators[name]([e], [prompts[e]])
    load_after = os.getloadavg()
    rows = {name: _summarise(runs[name], runs.get("hf")) for name in variants}
    reference = rows["hf"]["tokens_per_s"] if "hf" in rows else None
    for row in rows.values():
        if reference:
            row["speedup"] = row["tokens_per_s"] / reference
            row["ceiling_speedup"] = row["ceiling_tokens_per_s"] / reference
            row["decode_speedup"] = row["decode_tokens_per_s"] / rows["hf"]["decode_tokens_per_s"]
    return {"side": base.side, "entities": [task.entity_id(base.side, e) for e in entities],
            "prompt_tokens_mean": statistics.mean(len(p) for p in prompts.values()),
            "load_average_before": load_before, "load_average_after": load_after,
            "pool_build_s": build_s, "pool_sizes": pool_sizes, "rows": rows,
            "call_cost_ms": call_costs(task.model, prompts[entities[0]])}


def _summarise(runs: dict[int, list[Generation]], reference: dict[int, list[Generation]] | None) -> dict[str, Any]:
    """Totals over entities of each entity's median-wall run."""
    chosen = {e: sorted(gens, key=lambda g: g.wall_s)[len(gens) // 2] for e, gens in runs.items()}
    gens = list(chosen.values())
    tokens, calls, wall = sum(len(g.tokens) for g in gens), sum(g.calls for g in gens), sum(g.wall_s for g in gens)
    decode_s = sum(g.wall_s - g.prefill_s for g in gens)
    row = {"texts": len(gens), "tokens": tokens, "mean_length": tokens / len(gens), "wall_s": wall,
           "tokens_per_s": tokens / wall, "decode_tokens_per_s": sum(len(g.tokens) - 1 for g in gens) / decode_s,
           "prefill_share": sum(g.prefill_s for g in gens) / wall, "aal": tokens / calls,
           "draft_nodes_per_call": sum(g.drafted for g in gens) / max(1, calls - len(gens)),
           "art_ms": 1e3 * sum(g.retrieval_s for g in gens) / len(gens),
           "retrieval_share": sum(g.retrieval_s for g in gens) / wall,
           "ceiling_tokens_per_s": sum(g.ceiling_tokens for g in gens) / wall,
           "wall_runs_s": {str(e): [g.wall_s for g in runs[e]] for e in runs}}
    if reference is not None:
        row["same_as_hf"] = sum(chosen[e].tokens == reference[e][0].tokens for e in chosen)
    return row


def call_costs(model, prompt: Sequence[int], repeats: int = 5) -> dict[str, float]:
    """Median ms of one target call scoring a chain of ``n`` tree nodes after ``prompt``'s cache,
    for each ``n`` of :data:`CALL_SIZES`: the cost that every draft node adds."""
    costs = {}
    with torch.inference_mode():
        cache = returned_cache(model(input_ids=torch.tensor([list(prompt)]), use_cache=True))
        keep = torch.arange(len(prompt))[None]
        for n in CALL_SIZES:
            tokens = torch.tensor([list(prompt[:n]) + [0] * max(0, n - len(prompt))])
            ancestors = ancestor_matrix(torch.arange(-1, n - 1)[None])
            visible = torch.ones(1, len(prompt), dtype=torch.bool)

            def call() -> None:
                score_tree(model, cache, tokens, ancestors, visible, torch.tensor([len(prompt)]))
                gather_positions(cache, keep)

            costs[str(n)] = 1e3 * timed(call, repeats=repeats)["median_s"]
    return costs


def run_knowledge(out: Path, pools: dict[str, Path | None], limit: int = 8, repeats: int = 3, max_new_tokens: int = 128,
                  base: KnowledgeConfig | None = None, variants: Sequence[str] | None = None, model: str = "smollm2",
                  dataset: str = "ml-100k", name: str = "knowledge") -> str:
    """Benchmark each side of ``pools`` (side -> its old-part store, or None where no variant
    drafts from pools) with ``variants`` (default: every one the head and pools given allow);
    write ``name.json`` / ``name.md`` into ``out``; return the Markdown."""
    base = base or KnowledgeConfig()
    if variants is None:
        variants = tuple(v for v in VARIANTS if (base.draft is not None or v not in HEAD_VARIANTS)
                         and (all(pools.values()) or v not in POOL_VARIANTS))
    check_variants(variants, base.draft is not None, pools, base.head_tree.gate)
    reuse_freed_memory()
    task = KnowledgeTask(model, dataset)
    sides = [bench_side(task, replace(base, side=side, max_new_tokens=max_new_tokens), pool, limit, repeats,
                        variants) for side, pool in pools.items()]
    markdown = render(sides, limit, repeats, max_new_tokens, base)
    write_results(out, name, {"limit": limit, "draft": base.draft, "head_tree": vars(base.head_tree), "repeats": repeats, "max_new_tokens": max_new_tokens,
                                     "retrieval": vars(base.retrieval), "verification": asdict(base.verification),
                                     "groups": base.groups, "min_interactions": base.min_interactions,
                                     "sides": sides}, markdown)
    return markdown


def render(sides: list[dict[str, Any]], limit: int, repeats: int, max_new_tokens: int, base: KnowledgeConfig) -> str:
    r = base.retrieval
    parts = ["# Knowledge generation: greedy, prompt lookup, ReSD, LASER and the text head",
             f"SmolLM2-135M-Instruct, MovieLens-100K, first {limit} new-part users / new items per side, "
             f"{max_new_tokens} new tokens at most; median of {repeats} interleaved runs per text. Drafts: at most "
             f"{r.max_nodes} nodes, {r.max_depth} deep, suffix <= {r.max_suffix}; relaxed verification "
             f"k={base.verification.top_k}, p={base.verification.min_prob:g}; LASER's collaborative pools: "
             f"{base.groups} k-means groups, routed from {base.min_interactions} interactions. x hf: tokens/s "
             f"over `generate`'s (whole requests, prefill included); decode x hf: the same after the prefill; ceiling: the speed-up "
             f"had every step accepted its longest draft branch."]
    for side in sides:
        rows = side["rows"]
        load = f"load average {side['load_average_before'][0]:.2f} before, {side['load_average_after'][0]:.2f} after"
        parts.append(f"## {side['side']} knowledge ({len(side['entities'])} texts, prompts of "
                     f"{side['prompt_tokens_mean']:.0f} tokens on average; {load})")
        parts.append(markdown_table(
            ["method", "tokens/s", "x hf", "decode tokens/s", "decode x hf", "AAL", "ART ms", "mean length",
             "same as hf", "ceiling x hf"],
            [[name, row["tokens_per_s"], f"{row.get('speedup', 0):.2f}x", row["decode_tokens_per_s"],
              f"{row.get('decode_speedup', 0):.2f}x", row["aal"], row["art_ms"], row["mean_length"],
              "-" if VARIANTS[name][2] else f"{row.get('same_as_hf', '-')}/{row['texts']}",
              f"{row.get('ceiling_speedup', 0):.2f}x"]
             for name, row in rows.items() if name in MAIN]))
        for mine, others in (("laser", ("hf", "prompt-lookup", "resd")), ("head", ("hf", "ar", "head-fixed")),
                             ("laser+head", ("hf", "laser")), ("laser-greedy+head", ("laser-greedy", "head"))):
            if mine in rows:
                ratios = {other: rows[mine]["tokens_per_s"] / rows[other]["tokens_per_s"]
                          for other in others if other in rows}
                parts.append(f"{mine} tokens/s ratio: " + ", ".join(f"{v:.2f}x over {k}" for k, v in ratios.items()))
        if any(name in rows for name in ABLATION_NAMES):
            parts.append("Ablation (laser.txt Table 3):")
            parts.append(markdown_table(
                ["variant", "AAL", "ART ms", "tokens/s", "x hf", "draft nodes per call", "pool build s"],
                [[label, rows[name]["aal"], rows[name]["art_ms"], rows[name]["tokens_per_s"],
                  f"{rows[name].get('speedup', 0):.2f}x", rows[name]["draft_nodes_per_call"],
                  side["pool_build_s"].get(name, 0.0)] for label, name in ABLATION if name in rows]))
        sizes = [name for name in TREE_SIZES if name in rows]
        if len(sizes) > 1:
            parts.append("Draft tree size (relaxed LASER):")
            parts.append(markdown_table(
                ["variant", "draft nodes per call", "AAL", "tokens/s", "x hf"],
                [[name, rows[name]["draft_nodes_per_call"], rows[name]["aal"], rows[name]["tokens_per_s"],
                  f"{rows[name].get('speedup', 0):.2f}x"] for name in sizes]))
        costs = side["call_cost_ms"]
        parts.append("One target call scoring n tree nodes after the first prompt's cache (ms, median of 5):")
        parts.append(markdown_table(["n"] + list(costs), [["ms"] + list(costs.values()),
                                                          ["x one node"] + [v / costs["1"] for v in costs.values()]]))
    return "\n\n".join(parts)
