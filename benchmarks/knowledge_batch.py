"""Bulk knowledge generation in batches: LASER (greedy and relaxed) at batch 1 and batch B against
batched transformers ``generate`` (the pools' builder) at batch B, on the same requests.

``python benchmarks/knowledge_batch.py --pool runs/know/user-old.db --users 64 --batch-size 16``
runs the knowledge job (:func:`recspec.knowledge.job.run_job`, in-memory stores under a scratch
folder) for the first ``--users`` new-part users with every variant, ``--repeats`` times in
interleaved rounds (variant after variant, so drift of the machine falls on all alike), and
reports per variant the median tokens/s over the whole job (prefill and pool building included),
its ratio to batched ``generate`` and to the same method at batch 1, AAL (tokens per target call)
and whether its texts equal batch 1's (greedy: also ``generate``'s). Writes ``NAME.json`` and
``NAME.md`` under ``--out``.

The ceiling: a batch of draft trees costs the target what its rows' nodes cost (a call's price
grows with the fed tokens, ``F + r * tokens``), so batching amortises the fixed part ``F`` (the
weights streamed once per call) and nothing of the per-token part; a batch also runs until its
longest text ends, with its finished rows leaving the batch. And the prompts' prefill is the same
work for every method: a job is at most ``1 / s`` times faster than ``generate``'s, ``s`` the
prefill's share of ``generate``'s seconds (reported as the ceiling).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from recspec.bench.report import machine, markdown_table, reuse_freed_memory, write_results
from recspec.knowledge.job import AR, HF, LASER, KnowledgeConfig, KnowledgeTask, run_job
from recspec.knowledge.store import read_rows
from recspec.knowledge.verify import Verification

HERE = Path(__file__).resolve().parents[1]
GREEDY, RELAXED = Verification("greedy"), Verification("relaxed")


def variants(batch: int, nodes: list[int], relaxed: bool, head: Path | None) -> dict[str, KnowledgeConfig]:
    """The job's variants by label (``nodes``: only greedy LASER at batch ``batch`` with draft trees
    of that many nodes per row, not sized, and relaxed LASER too if ``relaxed``, beside greedy
    LASER's default trees, sized by the cost model; ``head``: a text head folder, also greedy
    decoding drafted by its trees and greedy LASER with them, hybrid, at batch ``batch``)."""
    laser = KnowledgeConfig(side="user", method=LASER, verification=GREEDY)
    rules = {"laser-greedy": GREEDY, "laser": RELAXED} if relaxed else {"laser-greedy": GREEDY}
    smaller = {f"{name} b{batch}@{n}": replace(laser, batch_size=batch, verification=rule,
                                               retrieval=replace(laser.retrieval, max_nodes=n, sized=False))
               for n in nodes for name, rule in rules.items()}
    if nodes:
        smaller[f"laser-greedy b{batch} sized"] = replace(laser, batch_size=batch)
    if head is not None:
        smaller |= {f"head b{batch}": replace(laser, method=AR, batch_size=batch, draft=str(head)),
                    f"laser-greedy + head b{batch}": replace(laser, batch_size=batch, draft=str(head))}
    if smaller:
        return {f"hf b{batch}": replace(laser, method=HF, batch_size=batch), **smaller}
    return {
        f"hf b{batch}": replace(laser, method=HF, batch_size=batch),
        "laser-greedy b1": laser,
        f"laser-greedy b{batch}": replace(laser, batch_size=batch),
        "laser b1": replace(laser, verification=RELAXED),
        f"laser b{batch}": replace(laser, verification=RELAXED, batch_size=batch),
    }


def one_run(task: KnowledgeTask, config: KnowledgeConfig, pool: Path, users: int, scratch: Path
            ) -> tuple[float, float, float, dict[str, list[int]]]:
    """(tokens/s, the prompts' prefill share of the job's seconds, AAL, texts by user) of one whole
    job."""
    out = scratch / f"{time.perf_counter_ns()}.db"
    started = time.perf_counter()
    summary = run_job(task, config, out, pool=None if config.method in (HF, AR) else pool, limit=users, progress=False)
    seconds = time.perf_counter() - started
    texts = {row.entity: row.tokens for row in read_rows(out)}
    out.unlink()
    return summary.tokens / seconds, summary.prefill_s / seconds, summary.tokens / summary.calls, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=Path, required=True, help="Old-part user store (the pools).")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--nodes", type=int, action="append", default=[],
                        help="Only batched generate and greedy LASER at the batch size with trees of this many "
                             "nodes per row (repeatable), and with its default trees sized by the cost model.")
    parser.add_argument("--relaxed", action="store_true", help="With --nodes: relaxed LASER at those sizes too.")
    parser.add_argument("--head", type=Path, help="A text head folder (adds its trees and LASER's hybrid with them).")
    parser.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results")
    parser.add_argument("--name", default="knowledge-batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_freed_memory()
    task = KnowledgeTask()
    configs = {label: replace(config, max_new_tokens=args.max_new_tokens)
               for label, config in variants(args.batch_size, args.nodes, args.relaxed, args.head).items()}
    rates: dict[str, list[float]] = {label: [] for label in configs}
    prefill: dict[str, list[float]] = {label: [] for label in configs}
    aal: dict[str, float] = {}
    texts: dict[str, dict[str, list[int]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, config in configs.items():  # warm-up: pools built, weights paged in
            one_run(task, config, args.pool, min(args.users, args.batch_size), Path(scratch))
        for _ in range(args.repeats):
            for label, config in configs.items():
                rate, share, aal[label], texts[label] = one_run(task, config, args.pool, args.users, Path(scratch))
                rates[label].append(rate)
                prefill[label].append(share)
    hf_label = f"hf b{args.batch_size}"
    medians = {label: statistics.median(values) for label, values in rates.items()}
    rows = []
    for label in configs:
        single = label.rsplit(" ", 1)[0] + " b1"  # absent for the smaller trees: no batch-1 run of them
        rows.append({"variant": label, "tokens_per_s": medians[label], "runs": rates[label],
                     "x_hf_batched": medians[label] / medians[hf_label],
                     "x_batch1": medians[label] / medians[single] if single in medians else None,
                     "prefill_share": statistics.median(prefill[label]), "aal": aal[label],
                     "same_texts_as_batch1": texts[label] == texts[single] if single in texts else None,
                     "same_texts_as_hf": texts[label] == texts[hf_label]})
    # the prompts' prefill costs every method the same: a job is at most 1 / (generate's prefill share)
    # times faster than generate's, however little its decoding costs
    ceiling = 1 / statistics.median(prefill[hf_label])
    results = {"benchmark": "knowledge-batch", "machine": machine(), "users": args.users, "ceiling_x_hf": ceiling,
               "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
               "threads": args.threads, "pool": str(args.pool), "pool_texts": sum(1 for _ in read_rows(args.pool)),
               "head": None if args.head is None else str(args.head),
               "rows": rows}
    table = markdown_table(
        ["variant", "tokens/s", "x hf batched", "x batch 1", "prefill share", "AAL", "= batch 1", "= hf"],
        [[r["variant"], f"{r['tokens_per_s']:.1f}", f"{r['x_hf_batched']:.2f}",
          "" if r["x_batch1"] is None else f"{r['x_batch1']:.2f}", f"{r['prefill_share']:.2f}", f"{r['aal']:.2f}",
          "" if r["same_texts_as_batch1"] is None else str(r["same_texts_as_batch1"]), str(r["same_texts_as_hf"])]
         for r in rows])
    markdown = (f"# Knowledge generation in batches\n\nSmolLM2-135M-Instruct, MovieLens-100K, the first {args.users} "
                f"new-part users, at most {args.max_new_tokens} new tokens, pools from {results['pool_texts']} "
                f"old-part texts; median of {args.repeats} interleaved whole-job runs, {args.threads} threads. "
                f"`= hf`: greedy texts equal batched `generate`'s (relaxed LASER is not greedy by design). "
                f"`prefill share`: the prompts' prefill, the same work for every method, as a share of the job; "
                f"the ceiling (decoding for free) is {ceiling:.2f}x batched `generate`.\n\n"
                f"{table}\n")
    write_results(args.out, args.name, results, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
