"""`python -m benchmarks.lab cost`: the draft's cost per call relative to its target's, c (atspeed.txt §4.1).

Speculative decoding pays only while drafting is cheap: a round costs ``gamma`` draft calls plus
one target call, so the speed-up is bounded by the accepted steps over ``1 + gamma * c``. For
each (target, draft) pair, both models run the same call shapes (random tokens of the target's
vocabulary; the cost does not depend on them) through :func:`measure_call_cost`,
which reports the median of ``repeats`` calls; c is draft / target per shape. The shapes are the
ones the decoders make, with prompts of the data set's median test prompt length: a prefill of one
prompt and of 16, a verification call of 40 tree nodes over a cached prompt, and one decoding step
of 16 rows (beams or users) and of one row over cached prompts.

Cost of one forward call, fp32, 2 threads on the 2-core development CPU (median of repeated
runs on an idle machine, Beauty vocabulary), and the draft / target ratio c:
1 x 84 tokens 32-36 ms vs 0.71-0.75 ms (c = 0.021-0.022); 16 x 84 tokens 450-478 ms vs 6.8-9.2 ms
(c = 0.015-0.019); 1 x 40 new tokens over an 84-token cache 22.7 ms vs 0.66 ms (c = 0.029);
one decoding step 16 x 1 over 84 cached 17.1 vs 0.46 ms (c = 0.027), 1 x 1: 9.0 vs 0.30 ms
(c = 0.034). The draft's small calls are mostly framework overhead, so c grows as calls shrink.

:func:`~recspec.decoding.cost.measure_call_cost` times one forward call, the unit in which
speculative decoding pays: a draft call must cost a small fraction c of a target call for
drafting to pay off.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recspec.bench.report import markdown_table, write_results
from recspec.decoding.cost import measure_call_cost
from recspec.models.presets import count_parameters
from recspec.recommend import Recommender

PROMPT = -1  # stands for the median test prompt length of the pair's data set
SHAPES: tuple[tuple[str, int, int, int], ...] = (  # name, batch, new tokens, cached tokens
    ("prefill 1 prompt", 1, PROMPT, 0),
    ("prefill 16 prompts", 16, PROMPT, 0),
    ("verify 40 nodes over 1 cached prompt", 1, 40, PROMPT),
    ("step of 16 beams over 16 cached prompts", 16, 1, PROMPT),
    ("step of 1 beam over 1 cached prompt", 1, 1, PROMPT),
)


def run(out: Path, pairs: Sequence[tuple[Path, Path]], repeats: int = 20, name: str = "cost") -> str:
    """Measure every shape for every pair; write ``name.json`` / ``name.md``; return the Markdown."""
    rows: list[dict[str, Any]] = []
    for target_dir, draft_dir in pairs:
        recommender = Recommender.load(target_dir, draft_dir=draft_dir)
        prompt = int(statistics.median(len(p) for p in recommender.encoder.prompts(recommender.examples("test"))))
        for shape, batch, new, cached in SHAPES:
            new_tokens, cached_tokens = (prompt if n == PROMPT else n for n in (new, cached))
            target_s = measure_call_cost(recommender.model, batch, new_tokens, repeats, cached_tokens)
            draft_s = measure_call_cost(recommender.draft, batch, new_tokens, repeats, cached_tokens)
            rows.append({"target": str(target_dir), "draft": str(draft_dir),
                         "target_parameters": count_parameters(recommender.model),
                         "draft_parameters": count_parameters(recommender.draft), "shape": shape, "batch": batch,
                         "new_tokens": new_tokens, "cached_tokens": cached_tokens, "target_s": target_s,
                         "draft_s": draft_s, "c": draft_s / target_s})
    table = markdown_table(
        ["target", "draft", "call", "target ms", "draft ms", "c"],
        [[Path(r["target"]).name, Path(r["draft"]).name, f"{r['shape']} ({r['batch']} x {r['new_tokens']}"
          f"{' over ' + str(r['cached_tokens']) if r['cached_tokens'] else ''})", round(r["target_s"] * 1e3, 2),
          round(r["draft_s"] * 1e3, 3), round(r["c"], 4)] for r in rows])
    markdown = (f"# Draft / target cost per call (c)\n\nMedian of {repeats} calls per shape, fp32, random tokens; "
                f"c = draft time / target time.\n\n{table}\n")
    write_results(out, name, {"repeats": repeats, "rows": rows}, markdown)
    return markdown
