"""The text decoders under two source trees of recspec, side by side: the chain decoders
(speculative sampling with a draft of the target's layers or a text head, TopK-ImpSpecDec), DSBD
over text (beam sampling drafted by the target's layers) and plain beam sampling,
LASER's knowledge job (greedy and relaxed, batch 1 and batch B) and, with ``--head`` (a text head
folder for SmolLM2), the job's greedy decoding drafted by the head's trees (batch 1 and batch B)
and LASER's hybrid of retrieval and the head (batch B), on the same models and prompts.

``python benchmarks/text_before_after.py --before /path/to/old/checkout --pool runs/know/user-old.db``
runs this script's worker under the old tree, then under this one (``PYTHONPATH`` picks the tree,
the interpreter is this one), in alternating rounds so that drift of the machine falls on both
alike. Each worker times every case once (after one warm-up run) and reports its tokens/s and a
digest of its texts; the result is each case's median tokens/s under each tree, their ratio
(after / before) and whether both trees wrote the same texts in every round. Writes ``NAME.json``
and ``NAME.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def cases(args: argparse.Namespace) -> dict:
    """Label -> a function returning the texts of one timed run (the worker's models loaded once)."""
    import torch

    from recspec.assets import require
    from recspec.decoding.text import TextOptions, generate
    from recspec.hub import load_tokenizer
    from recspec.knowledge.job import LASER, KnowledgeConfig, KnowledgeTask, run_job
    from recspec.knowledge.store import read_rows
    from recspec.knowledge.verify import Verification
    from recspec.models.hf import load_causal_lm
    from recspec.models.layer_draft import layer_draft, parse_layers
    from recspec.models.text_head import TextHeadDraft, new_text_head

    path = require("smollm2")
    target, tokenizer = load_causal_lm(path), load_tokenizer(path)
    layers = parse_layers(args.draft_layers, target.config.num_hidden_layers)
    drafts = {"layers": layer_draft(target, layers),
              "head": TextHeadDraft(new_text_head(target, None, seed=3).eval(), target)}
    texts = ["Recommend three films for someone who loved Alien and Blade Runner.",
             "Describe a user who rates Toy Story, Babe and Fargo highly.",
             "Write a short review of Star Wars.", "What makes a movie a classic?",
             "Summarise the plot of Casablanca in two sentences.", "List four comedies from the 1990s."]
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]
    pad, eos = tokenizer.pad_token_id or 0, tokenizer.eos_token_id
    task = KnowledgeTask()

    def chain(method: str, draft: str | None, batch: int, **options) -> callable:
        chosen, model = TextOptions(max_new_tokens=args.max_new_tokens, seed=5, **options), drafts.get(draft)
        return lambda: generate(method, target, model, prompts, chosen, pad, eos, batch_size=batch).tokens

    def laser(verification: str, batch: int, method: str = LASER, head: Path | None = None) -> callable:
        config = KnowledgeConfig(side="user", method=method, verification=Verification(verification),
                                 batch_size=batch, max_new_tokens=args.max_new_tokens,
                                 draft=None if head is None else str(head))

        def run() -> list[list[int]]:
            with tempfile.TemporaryDirectory() as scratch:
                out = Path(scratch) / "texts.db"
                run_job(task, config, out, pool=args.pool if method == LASER else None, limit=args.users,
                        progress=False)
                return [row.tokens for row in read_rows(out)]
        return run

    runs = {"spec-sample layers b1": chain("spec-sample", "layers", 1),
            f"spec-sample layers b{len(prompts)}": chain("spec-sample", "layers", len(prompts)),
            f"spec-sample head b{len(prompts)}": chain("spec-sample", "head", len(prompts), gamma=3),
            f"topk-imp layers b{len(prompts)}": chain("topk-imp", "layers", len(prompts), gamma=2, candidates=5),
            f"dsbd layers b{len(prompts)}": chain("dsbd", "layers", len(prompts), gamma=2),
            f"beam-sample b{len(prompts)}": chain("beam-sample", None, len(prompts)),
            "laser-greedy b1": laser("greedy", 1), f"laser-greedy b{args.batch_size}": laser("greedy", args.batch_size),
            f"laser b{args.batch_size}": laser("relaxed", args.batch_size)}
    if args.head is not None:
        runs.update({"head trees b1": laser("greedy", 1, "ar", args.head),
                     f"head trees b{args.batch_size}": laser("greedy", args.batch_size, "ar", args.head),
                     f"laser-greedy + head b{args.batch_size}": laser("greedy", args.batch_size, LASER, args.head)})
    return runs


def worker(args: argparse.Namespace) -> None:
    """Time every case once after a warm-up (the first case: the weights paged in); print one JSON
    line."""
    import torch

    torch.set_num_threads(args.threads)
    runs = {label: run for label, run in cases(args).items() if not args.case or label in args.case}
    next(iter(runs.values()))()
    rows = {}
    for label, run in runs.items():
        started = time.perf_counter()
        texts = run()
        seconds = time.perf_counter() - started
        rows[label] = {"tokens_per_s": sum(map(len, texts)) / seconds,
                       "digest": hashlib.sha256(json.dumps(texts).encode()).hexdigest()}
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="The old source tree (a checkout).")
    parser.add_argument("--pool", type=Path, required=True, help="Old-part user store (LASER's pools).")
    parser.add_argument("--head", type=Path, help="A text head folder for SmolLM2 (adds the head's cases).")
    parser.add_argument("--case", action="append", default=[], help="Time only this case (repeatable; default all).")
    parser.add_argument("--draft-layers", default="0-5,29")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results")
    parser.add_argument("--name", default="text-before-after")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from recspec.bench.report import machine, markdown_table, write_results

    trees = {"before": args.before.resolve(), "after": HERE}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--before", str(trees["before"]),
               "--pool", str(args.pool.resolve()),
               "--draft-layers", args.draft_layers, "--users", str(args.users), "--batch-size", str(args.batch_size),
               "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    if args.head is not None:
        command += ["--head", str(args.head.resolve())]
    for case in args.case:
        command += ["--case", case]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for round_ in range(args.rounds):  # the trees' order alternates, so a drifting machine favours neither
        for label, tree in list(trees.items())[::1 if round_ % 2 == 0 else -1]:
            done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=HERE,
                                  env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                       "OMP_NUM_THREADS": str(args.threads)})
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for case in runs["after"][0]:
        before = statistics.median(run[case]["tokens_per_s"] for run in runs["before"])
        after = statistics.median(run[case]["tokens_per_s"] for run in runs["after"])
        digests = {run[case]["digest"] for tree in runs.values() for run in tree}
        rows.append({"case": case, "before_tokens_per_s": before, "after_tokens_per_s": after, "ratio": after / before,
                     "same_texts": len(digests) == 1,
                     "runs": {tree: [run[case]["tokens_per_s"] for run in values] for tree, values in runs.items()}})
    results = {"benchmark": "text-before-after", "machine": machine(), "before": str(trees["before"]),
               "rounds": args.rounds, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
               "users": args.users, "batch_size": args.batch_size, "draft_layers": args.draft_layers,
               "head": None if args.head is None else str(args.head), "rows": rows}
    table = markdown_table(["case", "before tok/s", "after tok/s", "after / before", "same texts"],
                           [[r["case"], f"{r['before_tokens_per_s']:.1f}", f"{r['after_tokens_per_s']:.1f}",
                             f"{r['ratio']:.2f}", str(r["same_texts"])] for r in rows])
    markdown = (f"# Text decoders before and after\n\nSmolLM2-135M-Instruct; chains: 6 prompts, a draft of layers "
                f"{args.draft_layers} or an untrained text head, seed 5; LASER: the knowledge job over the first "
                f"{args.users} new-part users with pools from `{args.pool.name}`"
                + ("" if args.head is None else f", the head cases drafted by the text head `{args.head.name}`")
                + f"; at most {args.max_new_tokens} new "
                f"tokens; median of {args.rounds} alternating rounds, {args.threads} threads.\n\n{table}\n")
    write_results(args.out, args.name, results, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
