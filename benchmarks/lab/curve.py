"""`python -m benchmarks.lab curve`: the validation curves of training runs side by side, against CPU-minutes.

A run's ``train_log.jsonl`` (:data:`recspec.models.train.LOG_FILE`, one line per evaluation: the
untrained baseline as epoch 0, then every epoch or partial epoch) records the seconds each epoch
trained (``train_seconds``) and evaluated (``eval_seconds``). Their running sum times the torch
threads the run used is its CPU time, the budget the issues state targets in ("0.6 after at most
60 CPU-minutes"). For every run this writes each evaluation's CPU-minutes and metrics, the best
value within ``budget`` CPU-minutes, and a plot of ``metric`` against CPU-minutes with every run on
the same axes (JSON, Markdown, PNG). Runs whose rows carry the trainer's training-loss curve
(``loss_curve``: a point every :data:`~recspec.models.train.LOSS_WINDOW` steps) get it too: in the
JSON, as its last point in the Markdown, and as a second plot against examples trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recspec.bench.report import markdown_table, new_figure, save_figure, write_results
from recspec.errors import RecspecError
from recspec.fileio import loads_unique
from recspec.models.train import LOG_FILE


def read_log(run: Path) -> list[dict[str, Any]]:
    """The evaluations of training folder ``run``, in order, from its ``train_log.jsonl``."""
    path = Path(run) / LOG_FILE
    if not path.is_file():
        raise RecspecError(f"{path}: missing; --run takes a training folder (`recspec train`, `distill`, `align`)")
    rows = [loads_unique(line, f"{path}:{i + 1}") for i, line in enumerate(path.read_text().splitlines()) if line]
    if not rows or not all(isinstance(row, dict) and isinstance(row.get("epoch"), int) for row in rows):
        raise RecspecError(f"{path}: not a training log (one JSON object with an integer epoch per line)")
    return rows


def curve(rows: Sequence[dict[str, Any]], threads: int) -> list[dict[str, Any]]:
    """Each evaluation of a log with its cumulative CPU-minutes (training plus evaluation seconds
    so far, times ``threads``; an epoch's ``train_seconds`` count its training so far, so a
    partial evaluation's are not added again) as ``cpu_minutes``, and its epoch label (``"13 (97/112)"`` for a
    partial epoch)."""
    finished, evaluating, points = 0.0, 0.0, []  # training seconds of finished epochs; all evaluations'
    for row in rows:
        training = float(row.get("train_seconds", 0.0))  # the epoch's so far: a partial row's again in the next
        evaluating += float(row.get("eval_seconds", 0.0))
        seconds = finished + training + evaluating
        if not row.get("partial"):
            finished += training
        label = (f"{row['epoch']} ({row['batches']}/{row['of_batches']})" if row.get("partial")
                 else str(row["epoch"]))
        points.append({**row, "label": label, "cpu_minutes": seconds * threads / 60})
    return points


def loss_points(rows: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """The training-loss curve of a log: every row's ``loss_curve`` points in order, as
    ``{"step", "examples", "loss"}``."""
    return [{"step": int(step), "examples": int(examples), "loss": float(loss)}
            for row in rows for step, examples, loss in row.get("loss_curve", [])]


def best_within(points: Sequence[dict[str, Any]], metric: str, budget: float) -> dict[str, Any] | None:
    """The evaluation with the highest ``metric`` among those reached within ``budget`` CPU-minutes
    (None when none was)."""
    within = [p for p in points if p["cpu_minutes"] <= budget and metric in p]
    return max(within, key=lambda p: p[metric]) if within else None


def run(out: Path, runs: Sequence[Path], labels: Sequence[str], threads: Sequence[int], metric: str,
        columns: Sequence[str], budget: float, target: float | None, name: str, unit: str = "CPU-minutes") -> str:
    """Write ``name.{json,md,png}`` into ``out`` for training folders ``runs`` (named ``labels``,
    trained with ``threads`` torch threads each): ``metric`` and ``columns`` per evaluation, the best
    ``metric`` within ``budget`` minutes, the plot with ``target`` as a dashed line; return the
    Markdown. ``unit`` names the minutes (a run trained on an accelerator, given one thread, is
    timed in that device's minutes, e.g. ``H100-minutes``)."""
    if not (len(runs) == len(labels) == len(threads)):
        raise RecspecError("give one --label and one --threads per --run")
    logs = {label: read_log(path) for path, label in zip(runs, labels)}
    curves = {label: curve(logs[label], n) for label, n in zip(labels, threads)}
    losses = {label: loss_points(rows) for label, rows in logs.items()}
    for label, points in curves.items():
        if not any(metric in p for p in points):
            raise RecspecError(f"run {label!r} logs no {metric!r}; its log has {sorted(points[-1])}")
    best = {label: best_within(points, metric, budget) for label, points in curves.items()}
    summary = markdown_table(
        ["run", "folder", "threads", f"best {metric} within {budget:g} {unit}", "at epoch", unit,
         "training loss (last window: step, examples)"],
        [[label, str(path), n, round(b[metric], 4) if b else "-", b["label"] if b else "-",
          round(b["cpu_minutes"], 1) if b else "-", _last_loss(losses[label])]
         for (label, b), path, n in zip(best.items(), runs, threads)])
    tables = [f"## {label}\n\n" + markdown_table(
        ["epoch", unit, metric, *columns],
        [[p["label"], round(p["cpu_minutes"], 1), *(round(p[c], 4) if c in p else "-" for c in (metric, *columns))]
         for p in points]) for label, points in curves.items()]
    markdown = (f"# Training curves: {metric} against {unit}\n\n{unit}: training plus evaluation "
                f"seconds so far, times the run's torch threads.\n\n{summary}\n\n" + "\n\n".join(tables) + "\n")
    write_results(out, name, {"metric": metric, "unit": unit, "budget_cpu_minutes": budget, "target": target,
                              "runs": [{"label": label, "folder": str(path), "threads": n, "best": best[label],
                                        "curve": curves[label], "loss_curve": losses[label]}
                                       for path, label, n in zip(runs, labels, threads)]}, markdown)
    _plot(out / f"{name}.png", curves, losses, metric, budget, target, unit)
    return markdown


def _last_loss(points: Sequence[dict[str, float]]) -> str:
    if not points:
        return "-"
    last = points[-1]
    return f"{last['loss']:.3f} ({last['step']}, {last['examples']})"


def _plot(path: Path, curves: dict[str, list[dict[str, Any]]], losses: dict[str, list[dict[str, float]]],
          metric: str, budget: float, target: float | None, unit: str) -> None:
    with_loss = any(losses.values())
    figure, axes = new_figure(ncols=2 if with_loss else 1, figsize=(12 if with_loss else 7, 4), squeeze=False)
    axis = axes[0][0]
    colours = {label: f"C{i}" for i, label in enumerate(curves)}  # a run has one colour in both plots
    for label, points in curves.items():
        shown = [p for p in points if metric in p]
        axis.plot([p["cpu_minutes"] for p in shown], [p[metric] for p in shown], marker="o", label=label,
                  color=colours[label])
    if target is not None:
        axis.axhline(target, linestyle="--", color="grey", label=f"target {target:g}")
    axis.axvline(budget, linestyle=":", color="grey", label=f"budget {budget:g} {unit}")
    axis.set_xlabel(f"{unit} (training + validation)")
    axis.set_ylabel(metric)
    axis.grid(alpha=0.3)
    axis.legend()
    if with_loss:
        loss_axis = axes[0][1]
        for label, points in losses.items():
            if points:
                loss_axis.plot([p["examples"] for p in points], [p["loss"] for p in points], label=label,
                               color=colours[label])
        loss_axis.set_xlabel("training examples")
        loss_axis.set_ylabel("training loss (mean of each window of steps)")
        loss_axis.grid(alpha=0.3)
        loss_axis.legend()
    save_figure(figure, path)
