"""`python -m benchmarks.lab coverage`: how often a draft's top-N covers the target's top-K, level by level.

Strict verification accepts a drafted level only when the draft's top ``N`` children (ranked by
the target's exact beam scores plus the draft's log-probabilities) contain all ``K`` beams the
target keeps at that level. This benchmark measures that probability per identifier level and N,
from the target's *exact* beams one level up, for any draft: a draft model or a head (whose level
1 comes from the target's prefill, so its coverage there is 1 by construction and not listed).

It runs the shared round loop with one drafted level per round (``gamma = 1``) and a verifier
that counts, for every round, the level it drafted and whether it was accepted
(:func:`~recspec.calibration.count_rounds`): a round starts
from the target's exact beams, so each round is one sample of coverage at its level. (An accepted
round also takes the bonus step, so deep levels are sampled less often for good drafts.) Not a
timing: the decoders' speed is `python -m benchmarks.lab spec`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.bench.report import markdown_table, write_results
from recspec.calibration import count_rounds
from recspec.decoding.draft_sources import ModelHeadPair
from recspec.models.head import HeadDraft
from recspec.recommend import Recommender


def level_coverage(recommender: Recommender, draft, prompts: Sequence[torch.Tensor], k: int, n: int,
                   batch_size: int = 32) -> dict[int, tuple[int, int]]:
    """``{level: (covered rounds, rounds)}`` of ``draft`` (a draft model or a head) with N = ``n``."""
    counts = count_rounds(recommender, draft, prompts, k, n, 1, batch_size)
    return {level: (counts.level_accepted[level], total) for level, total in sorted(counts.level_rounds.items())}


def run(out: Path, target: Path, drafts: Sequence[Path], ks: Sequence[int] = (10,),
        factors: Sequence[float] = (1.0, 1.5, 2.0, 4.0), users: int = 200, name: str = "coverage") -> str:
    """Coverage of every draft of ``target`` at N = factor * K; writes ``{name}.json`` / ``.md``."""
    rows: list[dict[str, Any]] = []
    for draft_dir in drafts:
        recommender = Recommender.load(target, draft_dir=draft_dir)
        prompts = recommender.encoder.prompts(recommender.examples("test", users))
        kind = ("model+head" if isinstance(recommender.draft, ModelHeadPair) else
                "head" if isinstance(recommender.draft, HeadDraft) else "model")
        for k in ks:
            for factor in factors:
                n = max(k, round(factor * k))
                for level, (covered, total) in level_coverage(recommender, recommender.draft, prompts, k, n).items():
                    rows.append({"draft": str(draft_dir), "kind": kind, "k": k, "n": n, "level": level,
                                 "covered": covered, "rounds": total, "coverage": covered / total})
    markdown = "\n\n".join([
        f"# Coverage of the target's top-K by the draft's top-N, per level ({target})",
        f"{users} test users; a round drafts one level from the target's exact beams (gamma = 1); coverage = "
        f"share of rounds at that level whose drafted top-N held all K target beams (strict acceptance).",
        markdown_table(["draft", "kind", "K", "N", "level", "rounds", "coverage"],
                       [[r["draft"], r["kind"], r["k"], r["n"], r["level"], r["rounds"], f"{r['coverage']:.1%}"]
                        for r in rows])])
    write_results(out, name, {"target": str(target), "users": users, "rows": rows}, markdown)
    return markdown
