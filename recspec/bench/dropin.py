"""`recspec bench dropin`: the transformers drop-in against the constrained ``generate`` it replaces.

One trained model, its test users' prompts left-padded into batches, and two calls of the same
``model.generate(num_beams=K, num_return_sequences=K, max_new_tokens=L, output_scores=True,
return_dict_in_generate=True)``: with ``prefix_allowed_tokens_fn`` over the trie's prefix table
(how LC-Rec and AtSpeed decode) and with ``custom_generate=recspec.hf.trie_beam_search(...)``.
Per K and batch size, median of ``repeats`` interleaved runs over the same users, every drop-in
answer checked against the reference (same items; a near-tie may swap, counted). Two floors,
each the bare cost of one layout's model calls timed alone (the prefill, computing the last
position's logits only as both do, then L - 1 calls): transformers' layout, which prefills the
prompt once per beam (``B * K`` rows) and then feeds ``B * K`` beam rows of one token each over
their own copy of the prompt's cache, and ``tree-beam``'s, one row per user feeding its K beams
as K tokens over one shared prompt cache. The ceiling is the reference over the second (every decoding overhead
gone); the first shows what removing only the Python work of ``generate`` could give.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.bench.report import markdown_table, write_results
from recspec.decoding.cost import measure_call_cost
from recspec.decoding.hf_reference import allowed_tokens_table
from recspec.decoding.prompts import left_pad
from recspec.hf import trie_beam_search
from recspec.recommend import Recommender


def run_dropin(out: Path, target: Path, ks: Sequence[int] = (5, 10, 20), batches: Sequence[int] = (1, 16),
               users: int = 64, repeats: int = 3, name: str = "dropin") -> str:
    """Measure every (K, batch) cell; write ``name.json`` / ``name.md``; return the Markdown."""
    recommender = Recommender.load(target)
    model, tokenizer, trie = recommender.model, recommender.tokenizer, recommender.trie
    prompts = recommender.encoder.prompts(recommender.examples("test", users))
    pad, depth = recommender.encoder.pad_id, trie.depth
    table = allowed_tokens_table(trie)
    drop_in = trie_beam_search(recommender.index, tokenizer)
    prompt_len = int(statistics.median(len(p) for p in prompts))
    cells = []
    for batch in batches:
        groups = [left_pad(prompts[i:i + batch], pad, torch.device("cpu")) for i in range(0, len(prompts), batch)]
        for k in ks:
            def generate(constrained: bool) -> list:
                results = []
                for group in groups:
                    width = group.input_ids.shape[1]
                    extra = ({"prefix_allowed_tokens_fn": lambda b, ids, w=width: table[tuple(ids[w:].tolist())]}
                             if constrained else {"custom_generate": drop_in})
                    results.append(model.generate(input_ids=group.input_ids, attention_mask=group.attention_mask,
                                                  num_beams=k, num_return_sequences=k, max_new_tokens=depth,
                                                  do_sample=False, pad_token_id=pad, output_scores=True,
                                                  return_dict_in_generate=True, **extra))
                return results

            times: dict[str, list[float]] = {"constrained": [], "drop-in": []}
            outputs: dict[str, list] = {}
            generate(False)  # warm-up
            for repeat in range(repeats):
                for way in (("constrained", "drop-in") if repeat % 2 == 0 else ("drop-in", "constrained")):
                    started = time.perf_counter()
                    outputs[way] = generate(way == "constrained")
                    times[way].append(time.perf_counter() - started)
            differ, gap = _compare(outputs["drop-in"], outputs["constrained"])
            prefill = measure_call_cost(model, batch, prompt_len, repeats=5, last_logits=True)
            hf_prefill = measure_call_cost(model, batch * k, prompt_len, repeats=3, warmup=1, last_logits=True)
            hf_floor = len(groups) * (hf_prefill + (depth - 1) * measure_call_cost(model, batch * k, 1, repeats=5,
                                                                                   past_len=prompt_len))
            floor = len(groups) * (prefill + (depth - 1) * measure_call_cost(model, batch, k, repeats=5,
                                                                             past_len=prompt_len))
            reference, ours = statistics.median(times["constrained"]), statistics.median(times["drop-in"])
            cells.append({"k": k, "batch": batch, "users": len(prompts), "constrained_s": reference,
                          "drop_in_s": ours, "constrained_runs_s": times["constrained"],
                          "drop_in_runs_s": times["drop-in"], "speedup": reference / ours,
                          "hf_layout_floor_s": hf_floor, "hf_layout_ceiling": reference / hf_floor,
                          "floor_s": floor, "ceiling": reference / floor,
                          "users_per_s": len(prompts) / ours, "rows_differing": differ, "max_score_gap": gap})
    results = {"target": str(target), "depth": depth, "prompt_len_median": prompt_len, "repeats": repeats,
               "threads": torch.get_num_threads(), "cells": cells}
    markdown = _markdown(results)
    write_results(out, name, results, markdown)
    return markdown


def _compare(ours: list, reference: list) -> tuple[int, float]:
    """Result rows whose sequences differ (near-ties may swap) and the largest score gap."""
    differ, gap = 0, 0.0
    for mine, theirs in zip(ours, reference):
        differ += int((mine.sequences != theirs.sequences).any(dim=1).sum())
        gap = max(gap, float((mine.sequences_scores - theirs.sequences_scores).abs().max()))
    return differ, gap


def _markdown(results: dict[str, Any]) -> str:
    table = markdown_table(
        ["K", "batch", "constrained generate s", "drop-in s", "speed-up", "ceiling (shared prompt cache)",
         "ceiling (HF layout)", "users/s", "rows differing", "max score gap"],
        [[c["k"], c["batch"], c["constrained_s"], c["drop_in_s"], c["speedup"], c["ceiling"], c["hf_layout_ceiling"],
          c["users_per_s"], f"{c['rows_differing']}", f"{c['max_score_gap']:.1e}"] for c in results["cells"]])
    return (f"# transformers drop-in against constrained generate\n\n{results['target']}: "
            f"{results['cells'][0]['users']} test users, identifiers of {results['depth']} tokens, median prompt "
            f"{results['prompt_len_median']} tokens, {results['threads']} torch threads; median of "
            f"{results['repeats']} interleaved runs. Ceilings: constrained generate over the bare cost of "
            f"the {results['depth']} model calls (the prefill computing the last position's logits only, as "
            f"both do), with the K beams of a user fed over one shared prompt cache "
            f"(tree-beam's layout) and as K rows over their own caches (transformers' layout).\n\n{table}\n")
