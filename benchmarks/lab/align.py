"""`python -m benchmarks.lab align`: the paper's Table 1 on our models (atspeed.txt Table 1, Table 2, Fig. 4c).

For every alignment method a draft is trained on the same alignment data with the same budget
(`recspec align train`, selected by validation acceptance; drafts already trained in the work
folder are reused, so the benchmark resumes); with ``heads``, a feature-level head over the target
(`recspec align train --head`) is trained per method too, with the same budget (or one of its own for
every head: a head's epoch costs more than a draft's). Then, on the first
``users`` test users at batch 1, side by side in one run: beam search (the baseline) and, per kind
of draft, method and K, strict and relaxed speculative search: WS@K (speed-up over beam search,
median of ``repeats`` runs) and AS@K, the accepted steps per user, averaged over the first
``as_users`` test users (decoded in batches: a user's accepted steps do not depend on its batch).
Every strict row is checked to return beam search's items for every timed user. The ranking of
the methods by AS@K is compared with the paper's (AtSpeed-S first under strict verification,
AtSpeed-R under relaxed), and each draft's validation acceptance after every epoch is kept to show
whether the ranking had settled within the budget. Relaxed decoding's quality at each temperature
is compared with the target's beam sampling for the AtSpeed-R draft (Table 2, T = 0 being beam
search itself), and the acceptance of AtSpeed-S drafts trained with several alpha gives the alpha
curve (Fig. 4c). Results: ``NAME.json`` / ``NAME.md`` and ``NAME_as.png`` (AS@K per method,
strict and relaxed, per kind).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.align.task import METHODS
from recspec.align.train import ACCEPTANCE_METRIC, align_fit, head_fit
from benchmarks.lab.curve import read_log
from recspec.bench.report import markdown_table, new_figure, reuse_freed_memory, save_figure, write_results
from recspec.eval.metrics import recall_ndcg
from recspec.models.train import TrainConfig
from recspec.recommend import DecodeOptions, Recommender, item_rows, run_decoder
from recspec.turns import turn_order

#: Kinds of draft: an independent ``draft-tiny`` model, and a feature-level head over the target.
KINDS = ("draft", "head")
VERIFICATIONS = ("strict", "relaxed")
#: What the paper's Table 1 finds best under each verification.
PAPER_BEST = {"strict": "atspeed-s", "relaxed": "atspeed-r"}


def _trained(work: Path, name: str, train: Callable[[Path], Any]) -> Path:
    """The draft ``work/name``: trained (or resumed) by ``train(folder)`` unless a finished one is there."""
    out = work / name
    if not (out / "finished").is_file():
        train(out)
        (out / "finished").write_text("done\n")
    return out


def _folder_name(kind: str, method: str) -> str:
    return method if kind == "draft" else f"head-{method}"


def train_drafts(work: Path, data: Path, target: Path, kinds: Sequence[str], alpha: float, config: TrainConfig,
                 eval_k: int = 10, head_config: TrainConfig | None = None) -> dict[tuple[str, str], Path]:
    """Every method's draft of every kind in ``kinds``, trained on ``data`` with ``config`` (its
    budget; ``head_config`` for the heads, default ``config``) unless finished in ``work``:
    {(kind, method): folder}."""
    def trainer(kind: str, method: str) -> Callable[[Path], Any]:
        if kind == "head":
            return lambda out: head_fit(data, target, out, method, alpha, config=head_config or config,
                                        eval_k=eval_k)
        return lambda out: align_fit(data, out, method, alpha, target_dir=target, config=config, eval_k=eval_k)

    return {(kind, method): _trained(work, _folder_name(kind, method), trainer(kind, method))
            for kind in kinds for method in METHODS}


def _timed(recommender: Recommender, draft, name: str, prompts: list[torch.Tensor], k: int,
           options: DecodeOptions) -> tuple[float, list[torch.Tensor]]:
    """Seconds for all users one at a time, and each user's items."""
    items, total = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        decoded = run_decoder(name, recommender.model, draft, [prompt], recommender.trie, k,
                              recommender.encoder.pad_id, options)
        total += time.perf_counter() - start
        items.append(decoded.topk.items[0])
    return total, items


def _accepted(recommender: Recommender, draft, name: str, prompts: list[torch.Tensor], k: int,
              options: DecodeOptions) -> dict[str, float]:
    """Mean accepted steps (AS@K) and target calls per user over ``prompts``, in batches of 64."""
    decoded = run_decoder(name, recommender.model, draft, prompts, recommender.trie, k, recommender.encoder.pad_id,
                          options, batch_size=64)
    summary = decoded.stats.summary()
    return {"as": summary["accepted_steps"], "calls": summary["target_calls"]}


def _recall(recommender: Recommender, draft, name: str, k: int, temperature: float, users: int) -> dict[str, float]:
    examples = recommender.examples("test", users)
    decoded = run_decoder(name, recommender.model, draft, recommender.encoder.prompts(examples), recommender.trie, k,
                          recommender.encoder.pad_id, DecodeOptions(temperature=temperature), batch_size=64)
    items = decoded.topk.items.cpu().numpy()
    table = item_rows(recommender.dataset.item_ids, recommender.index.item_keys)
    return recall_ndcg(np.where(items >= 0, table[items.clip(0)], -1),
                       [examples.targets(i) for i in range(len(examples))], [k])


def ranking(rows: Sequence[dict[str, Any]], kinds: Sequence[str], ks: Sequence[int]) -> list[dict[str, Any]]:
    """Per kind, verification and K: the methods by AS@K, best first, and whether the best is the
    paper's (:data:`PAPER_BEST`)."""
    out = []
    for kind in kinds:
        for verify in VERIFICATIONS:
            for k in ks:
                cells = [r for r in rows if r["kind"] == kind and r["verify"] == verify and r["k"] == k]
                order = [r["method"] for r in sorted(cells, key=lambda r: -r["as"])]
                out.append({"kind": kind, "verify": verify, "k": k, "order": order,
                            "agrees": order[0] == PAPER_BEST[verify]})
    return out


def validation_curves(drafts: dict[tuple[str, str], Path]) -> dict[str, list[float]]:
    """Each draft's validation acceptance after every epoch (its ``train_log.jsonl``), by folder name."""
    return {folder.name: [float(row[ACCEPTANCE_METRIC]) for row in read_log(folder) if ACCEPTANCE_METRIC in row]
            for folder in drafts.values()}


def _plot(path: Path, rows: list[dict[str, Any]], kinds: Sequence[str], ks: Sequence[int]) -> None:
    figure, axes = new_figure(nrows=len(kinds), ncols=2, figsize=(9, 3.4 * len(kinds)), sharey=True, squeeze=False)
    for row_axes, kind in zip(axes, kinds):
        for axis, verify in zip(row_axes, VERIFICATIONS):
            for method in METHODS:
                values = [next(r["as"] for r in rows if r["kind"] == kind and r["method"] == method
                               and r["verify"] == verify and r["k"] == k) for k in ks]
                axis.plot(list(ks), values, marker="o", label=method)
            axis.set_title(f"{kind}, {verify} verification")
            axis.set_xlabel("K")
            axis.set_xticks(list(ks))
        row_axes[0].set_ylabel("AS@K (accepted steps per user)")
    axes[0][1].legend(fontsize=7)
    save_figure(figure, path)


def run(out: Path, target: Path, data: Path, work: Path, ks: Sequence[int] = (1, 3, 5, 10, 20), users: int = 64,
        repeats: int = 3, alpha: float = 0.5, alphas: Sequence[float] = (0.1, 0.3, 0.7), draft_beams: int = 40,
        train_minutes: float = 5.0, epochs: int = 10, temperatures: Sequence[float] = (0.5, 1.0),
        quality_users: int = 1000, heads: bool = False, as_users: int = 256, name: str = "align",
        patience: int = 2, head_minutes: float | None = None) -> str:
    """Train the drafts (or reuse them from ``work``), measure, write ``NAME.*``; the Markdown.
    ``patience``: epochs without a better validation acceptance before a draft stops (``epochs``
    for none: every draft then trains its whole budget). ``head_minutes``: each head's budget
    (default ``train_minutes``)."""
    reuse_freed_memory()
    config = TrainConfig(epochs=epochs, batch_size=64, lr=1e-3, warmup_steps=100, patience=patience,
                         max_minutes=train_minutes)
    head_minutes = train_minutes if head_minutes is None else head_minutes
    kinds = KINDS if heads else KINDS[:1]
    drafts = train_drafts(work, data, target, kinds, alpha, config,
                          head_config=dataclasses.replace(config, max_minutes=head_minutes))
    curve_drafts = {a: _trained(work, f"atspeed-s-alpha{a}", lambda folder, a=a: align_fit(
        data, folder, "atspeed-s", a, target_dir=target, config=config, eval_k=10)) for a in alphas}
    recommender = Recommender.load(target)
    prompts = recommender.encoder.prompts(recommender.examples("test", users))
    as_prompts = recommender.encoder.prompts(recommender.examples("test", as_users))
    models = {key: recommender.with_draft(folder).draft for key, folder in drafts.items()}
    rows = []
    for k in ks:
        options = DecodeOptions(draft_beams=max(draft_beams, k))
        cells = {"beam": ("beam", None)} | {f"{kind}/{method}/{verify}": (f"spec-{verify}", models[(kind, method)])
                                             for kind, method in models for verify in VERIFICATIONS}
        runs: dict[str, list[float]] = {cell: [] for cell in cells}
        items: dict[str, list[torch.Tensor]] = {}
        for repeat in range(repeats):
            for cell in turn_order(list(cells), repeat):
                seconds, items[cell] = _timed(recommender, cells[cell][1], cells[cell][0], prompts, k, options)
                runs[cell].append(seconds)
        beam = statistics.median(runs["beam"])
        for cell, (decoder, draft) in cells.items():
            if cell == "beam":
                continue
            kind, method, verify = cell.split("/")
            same = all(torch.equal(a, b) for a, b in zip(items[cell], items["beam"])) if verify == "strict" else None
            rows.append({"k": k, "kind": kind, "method": method, "verify": verify,
                         "median_s": statistics.median(runs[cell]), "runs_s": runs[cell],
                         "ws": beam / statistics.median(runs[cell]), "beam_s": beam, "same_items_as_beam": same,
                         **_accepted(recommender, draft, decoder, as_prompts, k, options)})
    curve = []
    for a, folder in {**curve_drafts, alpha: drafts[("draft", "atspeed-s")]}.items():
        steps = _accepted(recommender, recommender.with_draft(folder).draft, "spec-strict", as_prompts, 10,
                          DecodeOptions(draft_beams=draft_beams))
        curve.append({"alpha": a, "as@10": steps["as"]})
    curve.sort(key=lambda r: r["alpha"])
    quality = []
    for k in (5, 10):
        quality.append({"k": k, "decoder": "beam", "temperature": 0.0,
                        **_recall(recommender, None, "beam", k, 1.0, quality_users)})
        for temperature in temperatures:
            for decoder in ("beam-sample", "spec-relaxed"):
                quality.append({"k": k, "decoder": decoder, "temperature": temperature,
                                **_recall(recommender, models[("draft", "atspeed-r")], decoder, k, temperature,
                                          quality_users)})
    orders = ranking(rows, kinds, ks)
    valid = validation_curves(drafts)
    table_rows = []
    for verify in VERIFICATIONS:
        for kind in kinds:
            for method in METHODS:
                mine = {r["k"]: r for r in rows if r["kind"] == kind and r["method"] == method and r["verify"] == verify}
                table_rows.append([verify, kind, method] + [f"{mine[k]['ws']:.2f}" for k in ks]
                                  + [f"{mine[k]['as']:.2f}" for k in ks])
    strict_same = all(r["same_items_as_beam"] for r in rows if r["verify"] == "strict")
    markdown = "\n\n".join([
        "# Draft alignment: Table 1 on our models",
        f"Target {target}; drafts ({', '.join(kinds)}) trained on {data} for at most {train_minutes} min each "
        + (f"(heads {head_minutes} min) " if heads and head_minutes != train_minutes else "") +
        f"(patience {patience} epochs; alpha = {alpha}); WS@K: {users} test users at batch 1, median of {repeats} "
        f"runs, speed-up over beam search; AS@K: accepted steps per user over {as_users} test users; N = {draft_beams}; relaxed at T = 1. "
        f"Strict rows returned beam search's items for every timed user: {'yes' if strict_same else 'NO'}.",
        markdown_table(["verification", "kind", "method"] + [f"WS@{k}" for k in ks] + [f"AS@{k}" for k in ks],
                       table_rows),
        "## Methods by AS@K, best first (the paper: AtSpeed-S best under strict, AtSpeed-R under relaxed)",
        markdown_table(["kind", "verification", "K", "order", "paper's best first"],
                       [[r["kind"], r["verify"], r["k"], " > ".join(r["order"]), "yes" if r["agrees"] else "no"]
                        for r in orders]),
        "## Validation acceptance after each epoch (strict, or relaxed for AtSpeed-R; K = 10)",
        markdown_table(["draft", "by epoch"], [[folder, ", ".join(f"{v:.2f}" for v in values)]
                                                for folder, values in valid.items()]),
        "## Relaxed decoding quality, AtSpeed-R draft (Table 2)",
        markdown_table(["K", "decoder", "T", "recall", "ndcg"],
                       [[r["k"], r["decoder"], r["temperature"], r[f"recall@{r['k']}"], r[f"ndcg@{r['k']}"]]
                        for r in quality]),
        "## AS@10 of AtSpeed-S against alpha (Fig. 4c)",
        markdown_table(["alpha", "AS@10"], [[r["alpha"], r["as@10"]] for r in curve]),
        f"![AS@K per method]({name}_as.png)",
    ])
    write_results(out, name, {"users": users, "as_users": as_users, "repeats": repeats, "alpha": alpha,
                              "kinds": list(kinds), "rows": rows, "ranking": orders, "validation": valid,
                              "quality": quality, "alpha_curve": curve, "train_minutes": train_minutes,
                              "head_minutes": head_minutes if heads else None, "patience": patience}, markdown)
    _plot(out / f"{name}_as.png", rows, kinds, ks)  # after the figures are safe on disk
    return markdown
