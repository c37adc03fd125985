"""Two source trees of recspec side by side: `recspec bench compare` run under each in turn.

A change that must keep speed level is measured against the code before it on the same models,
in one run: ``python benchmarks/before_after.py --before /path/to/old/checkout --target T
--draft D``. Each round runs `recspec bench compare` under both trees (the tree goes first on the
path, checked; the interpreter is this one), which tree runs first alternating from round to round
so that drift of the machine falls on both alike; the result gives each decoder's median users/s
under each tree and their ratio (after / before), with whether every round returned the same items
as the first decoder. With ``--seed S`` each tree then writes `recspec recommend`'s file for every
decoder (seeded sampling included) and the result says whether the two files are byte-identical.
Writes ``NAME.json`` and ``NAME.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from recspec.bench.report import markdown_table, write_results

HERE = Path(__file__).resolve().parents[1]
#: The command line's program under a tree: ``python -c`` puts the working folder first on the path,
#: ahead of ``PYTHONPATH``, so the tree goes first explicitly and the package imported is checked.
CHILD = ("import sys; sys.path.insert(0, {tree!r}); import recspec; from pathlib import Path; "
         "assert Path(recspec.__file__).resolve().is_relative_to({tree!r}), recspec.__file__; "
         "from recspec.cli import main; main()")


def run_cli(tree: Path, args: argparse.Namespace, *command: str) -> None:
    """``recspec COMMAND`` under ``tree`` on the run's target, draft, K, batch and users."""
    subprocess.run([sys.executable, "-c", CHILD.format(tree=str(tree)), *command,
                    "--target", args.target, "--k", str(args.k), "--batch-size", str(args.batch_size),
                    "--users", str(args.users), *(["--draft", args.draft] if args.draft else [])],
                   check=True, stdout=subprocess.DEVNULL,
                   env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(args.threads),
                        "HOME": str(Path.home())})


def compare(tree: Path, args: argparse.Namespace, out: Path, name: str) -> list[dict]:
    """The rows of one `recspec bench compare` run under ``tree``."""
    run_cli(tree, args, "bench", "compare", "--repeats", str(args.repeats), "--out", str(out), "--name", name,
            *(part for decoder in args.decoder for part in ("--decoder", decoder)))
    return json.loads((out / f"{name}.json").read_text())["rows"]


def same_files(trees: dict[str, Path], args: argparse.Namespace, out: Path) -> dict[str, bool]:
    """Per decoder, whether `recspec recommend --seed` wrote byte-identical files under both trees."""
    for label, tree in trees.items():
        for decoder in args.decoder:
            run_cli(tree, args, "recommend", "--decoder", decoder, "--seed", str(args.seed),
                    "--out", str(out / f"{label}-{decoder}.jsonl"))
    return {decoder: (out / f"before-{decoder}.jsonl").read_bytes() == (out / f"after-{decoder}.jsonl").read_bytes()
            for decoder in args.decoder}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="The old source tree (a checkout).")
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--decoder", action="append", default=[])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, help="Also compare `recspec recommend --seed SEED`'s files.")
    parser.add_argument("--out", type=Path, default=HERE / "benchmarks" / "results")
    parser.add_argument("--name", default="before-after")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": HERE}
    rates: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    same: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):  # the trees' order alternates, so a drifting machine favours neither
            for label, tree in list(trees.items())[::1 if round_ % 2 == 0 else -1]:
                for row in compare(tree, args, Path(scratch), f"{label}-{round_}"):
                    rates[label].setdefault(row["decoder"], []).append(row["users_per_s"])
                    same[row["decoder"]] = same.get(row["decoder"], True) and row["same_items"]
        files = {} if args.seed is None else same_files(trees, args, Path(scratch))
    rows = [{"decoder": decoder, "before_users_per_s": statistics.median(rates["before"][decoder]),
             "after_users_per_s": statistics.median(rates["after"][decoder]),
             "ratio": statistics.median(rates["after"][decoder]) / statistics.median(rates["before"][decoder]),
             "same_items": same[decoder], "same_file": files.get(decoder),
             "runs_before": rates["before"][decoder], "runs_after": rates["after"][decoder]}
            for decoder in rates["after"]]
    headers = ["decoder", "before (users/s)", "after (users/s)", "after / before", "items of the first decoder",
               *([f"same file as before (seed {args.seed})"] if files else [])]
    table = markdown_table(headers,
                           [[r["decoder"], f"{r['before_users_per_s']:.1f}", f"{r['after_users_per_s']:.1f}",
                             f"{r['ratio']:.3f}x", r["same_items"], *([r["same_file"]] if files else [])]
                            for r in rows])
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "name")}
    settings["before"] = str(settings["before"])
    markdown = (f"# {args.name}\n\n`recspec bench compare` under two source trees, alternating, {args.rounds} rounds "
                f"of {args.repeats} timed runs; medians of the rounds. Ceiling: each decoder's own speed under the old "
                f"tree (a ratio of 1.0 is level).\n\n{table}\n")
    json_path, md_path = write_results(args.out, args.name, {"settings": settings, "rows": rows}, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
