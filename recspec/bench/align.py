"""`recspec bench align`: the paper's Table 1 on our models (atspeed.txt Table 1, Table 2, Fig. 4c).

For every alignment method a draft is trained on the same alignment data with the same budget
(`recspec align train`, selected by validation acceptance; drafts already trained in the work
folder are reused, so the benchmark resumes). Then, on the first ``users`` test users at batch 1,
side by side in one run: beam search (the baseline) and, per method and K, strict and relaxed
speculative search: WS@K (speed-up over beam search, median of ``repeats`` runs) and AS@K.
Relaxed decoding's quality at each temperature is compared with the target's beam sampling for
the AtSpeed-R draft (Table 2, T = 0 being beam search itself), and the acceptance of AtSpeed-S
drafts trained with several alpha gives the alpha curve (Fig. 4c). Results: ``align.json`` /
``align.md`` and ``align_as.png`` (AS@K per method, strict and relaxed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.align.task import METHODS
from recspec.align.train import align_fit
from recspec.bench.report import markdown_table, new_figure, reuse_freed_memory, save_figure, write_results
from recspec.eval.metrics import recall_ndcg
from recspec.models.train import TrainConfig
from recspec.recommend import DecodeOptions, Recommender, item_rows, run_decoder


def _draft(work: Path, name: str, data: Path, target: Path, method: str, alpha: float, config: TrainConfig,
           eval_k: int) -> Path:
    """The draft ``work/name``: trained (or resumed) unless a finished one is there."""
    out = work / name
    if not (out / "finished").is_file():
        align_fit(data, out, method, alpha, target_dir=target, config=config, eval_k=eval_k)
        (out / "finished").write_text("done\n")
    return out


def _timed(recommender: Recommender, draft, name: str, prompts: list[torch.Tensor], k: int,
           options: DecodeOptions) -> tuple[float, float, float]:
    """Seconds for all users one at a time, mean accepted steps, mean target calls."""
    accepted, calls, total = [], [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        decoded = run_decoder(name, recommender.model, draft, [prompt], recommender.trie, k,
                              recommender.encoder.pad_id, options)
        total += time.perf_counter() - start
        if decoded.stats is not None:
            accepted.append(float(decoded.stats.accepted_steps[0]))
            calls.append(float(decoded.stats.target_calls[0]))
    return total, float(np.mean(accepted)) if accepted else 0.0, float(np.mean(calls)) if calls else 0.0


def _load_draft(recommender: Recommender, folder: Path):
    from recspec.models.checkpoint import load_trained

    return load_trained(folder, recommender.index)[0]


def _recall(recommender: Recommender, draft, name: str, k: int, temperature: float, users: int) -> dict[str, float]:
    examples = recommender.examples("test", users)
    decoded = run_decoder(name, recommender.model, draft, recommender.encoder.prompts(examples), recommender.trie, k,
                          recommender.encoder.pad_id, DecodeOptions(temperature=temperature), batch_size=64)
    items = decoded.topk.items.cpu().numpy()
    table = item_rows(recommender.dataset.item_ids, recommender.index.item_keys)
    return recall_ndcg(np.where(items >= 0, table[items.clip(0)], -1),
                       [examples.targets(i) for i in range(len(examples))], [k])


def _plot(path: Path, rows: list[dict[str, Any]], ks: Sequence[int]) -> None:
    figure, axes = new_figure(nrows=1, ncols=2, figsize=(9, 3.4), sharey=True)
    for axis, verify in zip(axes, ("strict", "relaxed")):
        for method in METHODS:
            values = [next(r["as"] for r in rows if r["method"] == method and r["verify"] == verify and r["k"] == k)
                      for k in ks]
            axis.plot(list(ks), values, marker="o", label=method)
        axis.set_title(f"{verify} verification")
        axis.set_xlabel("K")
        axis.set_xticks(list(ks))
    axes[0].set_ylabel("AS@K (accepted steps per user)")
    axes[1].legend(fontsize=7)
    save_figure(figure, path)


def run(out: Path, target: Path, data: Path, work: Path, ks: Sequence[int] = (1, 3, 5, 10, 20), users: int = 64,
        repeats: int = 3, alpha: float = 0.5, alphas: Sequence[float] = (0.1, 0.3, 0.7), draft_beams: int = 40,
        train_minutes: float = 5.0, epochs: int = 10, temperatures: Sequence[float] = (0.5, 1.0),
        quality_users: int = 1000) -> str:
    """Train the drafts (or reuse them from ``work``), measure, write ``align.*``; the Markdown."""
    reuse_freed_memory()
    config = TrainConfig(epochs=epochs, batch_size=64, lr=1e-3, warmup_steps=100, patience=2,
                         max_minutes=train_minutes)
    drafts = {method: _draft(work, method, data, target, method, alpha, config, 10) for method in METHODS}
    curve_drafts = {a: _draft(work, f"atspeed-s-alpha{a}", data, target, "atspeed-s", a, config, 10)
                    for a in alphas}
    recommender = Recommender.load(target)
    prompts = recommender.encoder.prompts(recommender.examples("test", users))
    models = {method: _load_draft(recommender, folder) for method, folder in drafts.items()}
    rows = []
    for k in ks:
        options = DecodeOptions(draft_beams=max(draft_beams, k))
        cells = [("beam", None, "beam", "-")] + [(f"spec-{v}", models[m], m, v) for m in METHODS
                                                   for v in ("strict", "relaxed")]
        runs: dict[tuple[str, str], list[float]] = {(m, v): [] for _, _, m, v in cells}
        accepted: dict[tuple[str, str], float] = {}
        for _ in range(repeats):
            for name, draft, method, verify in cells:
                seconds, steps, _ = _timed(recommender, draft, name, prompts, k, options)
                runs[(method, verify)].append(seconds)
                accepted[(method, verify)] = steps
        beam = statistics.median(runs[("beam", "-")])
        for (method, verify), times in runs.items():
            if method != "beam":
                rows.append({"k": k, "method": method, "verify": verify, "median_s": statistics.median(times),
                             "runs_s": times, "ws": beam / statistics.median(times), "as": accepted[(method, verify)],
                             "beam_s": beam})
    curve = []
    for a, folder in {**curve_drafts, alpha: drafts["atspeed-s"]}.items():
        draft = _load_draft(recommender, folder)
        _, steps, _ = _timed(recommender, draft, "spec-strict", prompts, 10, DecodeOptions(draft_beams=draft_beams))
        curve.append({"alpha": a, "as@10": steps})
    curve.sort(key=lambda r: r["alpha"])
    quality = []
    for k in (5, 10):
        quality.append({"k": k, "decoder": "beam", "temperature": 0.0,
                        **_recall(recommender, None, "beam", k, 1.0, quality_users)})
        for temperature in temperatures:
            for name in ("beam-sample", "spec-relaxed"):
                quality.append({"k": k, "decoder": name, "temperature": temperature,
                                **_recall(recommender, models["atspeed-r"], name, k, temperature, quality_users)})
    table_rows = []
    for verify in ("strict", "relaxed"):
        for method in METHODS:
            mine = {r["k"]: r for r in rows if r["method"] == method and r["verify"] == verify}
            table_rows.append([verify, method] + [f"{mine[k]['ws']:.2f}" for k in ks] + [f"{mine[k]['as']:.2f}"
                                                                                         for k in ks])
    markdown = "\n\n".join([
        "# Draft alignment: Table 1 on our models",
        f"Target {target}; drafts trained on {data} for at most {train_minutes} min each (alpha = {alpha}); "
        f"{users} test users at batch 1, median of {repeats} runs; WS@K = speed-up over beam search, AS@K = "
        f"accepted steps per user; N = {draft_beams}; relaxed at T = 1.",
        markdown_table(["verification", "method"] + [f"WS@{k}" for k in ks] + [f"AS@{k}" for k in ks], table_rows),
        "## Relaxed decoding quality, AtSpeed-R draft (Table 2)",
        markdown_table(["K", "decoder", "T", "recall", "ndcg"],
                       [[r["k"], r["decoder"], r["temperature"], r[f"recall@{r['k']}"], r[f"ndcg@{r['k']}"]]
                        for r in quality]),
        "## AS@10 of AtSpeed-S against alpha (Fig. 4c)",
        markdown_table(["alpha", "AS@10"], [[r["alpha"], r["as@10"]] for r in curve]),
        "![AS@K per method](align_as.png)",
    ])
    write_results(out, "align", {"users": users, "repeats": repeats, "alpha": alpha, "rows": rows, "quality": quality,
                                 "alpha_curve": curve, "train_minutes": train_minutes}, markdown)
    _plot(out / "align_as.png", rows, ks)  # after the figures are safe on disk
    return markdown
