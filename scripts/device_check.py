"""Check that the exact decoders give on another device what they give on the CPU.

For every exact decoder (tree-beam, beam, spec-strict when a draft is given, auto) at batch 1 and
16, the top-K of the first --users test users on --device is compared with tree-beam's on the
CPU: the users whose K items (in order) are the same, and the largest score difference. Writes
``device-check-<device>.json`` and ``.md`` under --out. The figures in BENCHMARKS.md ("Serving")
came from an H100:

    python scripts/device_check.py --target runs/demo/target --draft runs/demo/draft --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from recspec.bench.report import markdown_table, write_results
from recspec.recommend import Recommender


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    cpu = Recommender.load(args.target, device="cpu", draft_dir=args.draft)
    other = Recommender.load(args.target, device=args.device, draft_dir=args.draft)
    examples = cpu.examples("test", args.users)
    reference = cpu.recommend(examples, args.k, "tree-beam", 16).topk
    decoders = ["tree-beam", "beam"] + (["spec-strict"] if args.draft else []) + ["auto"]
    rows = []
    for decoder in decoders:
        for batch in (1, 16):
            started = time.perf_counter()
            topk = other.recommend(examples, args.k, decoder, batch).topk
            seconds = time.perf_counter() - started
            same = sum(a == b for a, b in zip(topk.items.tolist(), reference.items.tolist()))
            gap = (topk.scores.cpu() - reference.scores).abs().max().item()
            rows.append({"decoder": decoder, "batch": batch, "same_items_users": same, "users": len(examples),
                         "max_score_diff": gap, "seconds": seconds})
    markdown = "\n".join([f"# Exact decoders on {args.device} against tree-beam on the CPU\n",
                          f"Target `{args.target}`, draft `{args.draft}`, K = {args.k}, {len(examples)} test users.\n",
                          markdown_table(["decoder", "batch", "same items (users)", "max score difference", "s"],
                                         [[r["decoder"], r["batch"], f"{r['same_items_users']} / {r['users']}",
                                           f"{r['max_score_diff']:.1e}", r["seconds"]] for r in rows])])
    name = f"device-check-{args.device.replace(':', '')}"
    write_results(args.out, name, {"target": str(args.target), "draft": str(args.draft), "device": args.device,
                                   "k": args.k, "rows": rows}, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
