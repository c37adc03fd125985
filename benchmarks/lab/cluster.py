"""`python -m benchmarks.lab ray`: batch recommendation and knowledge generation on Ray against one process.

Three ways to run the same job on this machine, side by side in one run (in a balanced order
between repeats, median of ``repeats``): one process with every core as torch threads (what
``recspec recommend`` does), one Ray worker holding every core, and one Ray worker per core. Each
run is timed end to end (models loaded in the run: Ray's workers load them in their own
processes) on a Ray cluster started once beforehand (its start-up is reported apart), whose
worker processes Ray keeps warm between jobs: the first Ray job of the command, while they import
torch and transformers, is timed apart too (``cold_s``). The one-worker run against the single
process is the overhead of Ray itself on warm workers: tasks scheduled, the models loaded in
another process, results moved back and committed shard by shard. Every Ray output is
checked equal to the single-process one (bytes for recommendations, texts for knowledge).

Recommendation: ``users`` per second over the test users of a trained model. Knowledge: tokens
per second of greedy generation (``ar``) for the first ``items`` old-part items.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recspec.bench.report import markdown_table, write_results
from recspec.cluster.knowledge import ray_runner
from recspec.cluster.recommend import recommend_on_ray
from recspec.cluster.runtime import Workers, connect
from recspec.knowledge.job import KnowledgeConfig, KnowledgeTask, run_job
from recspec.knowledge.store import read_rows
from recspec.knowledge.verify import Verification
from recspec.recommend import RecommendJob, write_recs
from recspec.turns import turn_order

def setups(cores: int) -> dict[str, Workers | None]:
    """The three ways to run a job on ``cores`` cores (module doc), by name; None: one process
    with every core as torch threads."""
    return {"one process": None, "ray, 1 worker": Workers(1, cores), f"ray, {cores} workers": Workers(cores, 1)}


def _recommend(job: RecommendJob, workers: Workers | None, out: Path, cores: int) -> tuple[float, float]:
    """Seconds to run ``job`` end to end, writing ``out``, and of them the seconds spent loading
    the models (the slowest worker's, on Ray)."""
    started = time.perf_counter()
    if workers is None:
        torch.set_num_threads(cores)
        recommender = job.load()
        load_s = time.perf_counter() - started
        examples, decoded = job.decode(recommender)
        write_recs(out, recommender, examples, decoded.topk)
    else:
        load_s = max(recommend_on_ray(job, out, workers, progress=False).load_s.values())
    return time.perf_counter() - started, load_s


def _knowledge(model: str, config: KnowledgeConfig, items: int, workers: Workers | None, out: Path,
               cores: int) -> tuple[float, int]:
    """Seconds to generate ``items`` texts end to end into the store ``out``, and their tokens."""
    started = time.perf_counter()
    torch.set_num_threads(cores)
    task = KnowledgeTask(model)
    runner = {} if workers is None else {"runner": ray_runner({"model": model, "dataset": "ml-100k"}, workers)}
    summary = run_job(task, config, out, limit=items, progress=False, **runner)
    return time.perf_counter() - started, summary.tokens


def _measure(names: list[str], repeats: int, once: Callable[[str, Path], float]) -> dict[str, list[float]]:
    """``once(name, folder)`` for every name, ``repeats`` times in a balanced order (:func:`turn_order`)."""
    runs: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in turn_order(names, repeat):
            with tempfile.TemporaryDirectory() as folder:
                runs[name].append(once(name, Path(folder)))
    return runs


def run(out: Path, target: Path, model: str = "smollm2", decoder: str = "tree-beam", k: int = 10,
        batch_size: int = 16, items: int = 8, max_new_tokens: int = 32, repeats: int = 3,
        name: str = "ray") -> str:
    """Measure both jobs in the three set-ups; write ``name.json`` / ``name.md``; the Markdown."""
    cores = os.cpu_count() or 1
    ways = setups(cores)
    names = list(ways)
    started = time.perf_counter()
    connect(None, num_cpus=cores)
    ray_start_s = time.perf_counter() - started
    job = RecommendJob(target, decoder, k, batch_size=batch_size)
    with tempfile.TemporaryDirectory() as folder:
        cold_s, _ = _recommend(job, ways[names[-1]], Path(folder) / "recs.jsonl", cores)
        reference: dict[str, bytes] = {"recs": (Path(folder) / "recs.jsonl").read_bytes()}

    loads: dict[str, list[float]] = {way: [] for way in names}

    def recommend_once(way: str, folder: Path) -> float:
        seconds, load_s = _recommend(job, ways[way], folder / "recs.jsonl", cores)
        loads[way].append(load_s)
        text = (folder / "recs.jsonl").read_bytes()
        if reference.setdefault("recs", text) != text:
            raise AssertionError(f"{way}: other recommendations than the first run")
        return seconds

    recs = _measure(names, repeats, recommend_once)
    users = reference["recs"].count(b"\n")
    config = KnowledgeConfig(side="item", part="old", method="ar", verification=Verification("greedy"),
                             max_new_tokens=max_new_tokens)
    tokens: dict[str, int] = {}

    def knowledge_once(way: str, folder: Path) -> float:
        seconds, count = _knowledge(model, config, items, ways[way], folder / "k.db", cores)
        texts = sorted((row.entity, row.text) for row in read_rows(folder / "k.db"))
        if reference.setdefault("texts", repr(texts).encode()) != repr(texts).encode():
            raise AssertionError(f"{way}: other texts than the first run")
        tokens[way] = count
        return seconds

    texts = _measure(names, repeats, knowledge_once)
    rows = []
    for way in names:
        rec_s, know_s = statistics.median(recs[way]), statistics.median(texts[way])
        rows.append({"setup": way, "workers": 0 if ways[way] is None else ways[way].count,
                     "recommend_s": rec_s, "recommend_runs_s": recs[way], "users_per_s": users / rec_s,
                     "load_s": statistics.median(loads[way]),
                     "knowledge_s": know_s, "knowledge_runs_s": texts[way], "tokens_per_s": tokens[way] / know_s})
    for row in rows:
        row["recommend_speedup"] = row["users_per_s"] / rows[0]["users_per_s"]
        row["knowledge_speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    results = {"target": str(target), "model": model, "decoder": decoder, "k": k, "batch_size": batch_size,
               "users": users, "items": items, "max_new_tokens": max_new_tokens, "repeats": repeats, "cores": cores,
               "ray_start_s": ray_start_s, "cold_s": cold_s, "cold_setup": names[-1], "ray_overhead_recommend_s": rows[1]["recommend_s"] - rows[0]["recommend_s"],
               "ray_overhead_knowledge_s": rows[1]["knowledge_s"] - rows[0]["knowledge_s"], "rows": rows}
    markdown = _markdown(results)
    write_results(out, name, results, markdown)
    return markdown


def _markdown(results: dict[str, Any]) -> str:
    table = markdown_table(
        ["set-up", "recommend s", "of which model loading", "users/s", "x one process", "knowledge s",
         "tokens/s", "x one process"],
        [[r["setup"], r["recommend_s"], r["load_s"], r["users_per_s"], r["recommend_speedup"], r["knowledge_s"],
          r["tokens_per_s"], r["knowledge_speedup"]] for r in results["rows"]])
    return (f"# Ray against one process ({results['cores']} cores)\n\n"
            f"Recommend: {results['users']} test users of {results['target']}, {results['decoder']}, "
            f"K = {results['k']}, batch {results['batch_size']}. Knowledge: {results['items']} old-part item "
            f"texts of {results['model']}, greedy (`ar`), {results['max_new_tokens']} new tokens. End to end "
            f"(models loaded in each run), median of {results['repeats']}, rotated order; every output equal "
            f"to the single-process one.\n\n{table}\n\nRay cluster start-up (once): {results['ray_start_s']:.1f} s. "
            f"First recommend job ({results['cold_setup']}, before the timed runs, while Ray's worker processes "
            f"import torch and transformers; kept warm after it): {results['cold_s']:.1f} s. "
            f"Overhead of Ray itself (1 worker with every core against one process): "
            f"{results['ray_overhead_recommend_s']:.1f} s per recommend job, "
            f"{results['ray_overhead_knowledge_s']:.1f} s per knowledge job.\n")
