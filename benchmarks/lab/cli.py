"""``python -m benchmarks.lab``: the research experiments behind BENCHMARKS.md, over recspec's public
modules.

They measure recspec itself (identifiers, decoders, drafts, kernels, training, Ray) on this
project's models, so they live in the repository and are not installed with the package; the
benchmarks a user runs on their own models stay ``recspec bench``. Options and results are those the
same commands had as ``recspec bench`` (``ctr``: ``recspec knowledge ctr``); results go to
``benchmarks/results/``. Run from the repository's root.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from recspec.cli import DatasetArg, ResultNameOpt, ResultsOpt, positive, results_dir
from recspec.cli import main as recspec_main
from recspec.errors import RecspecError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="recspec's research benchmarks (results under benchmarks/results/).")


def _pairs(targets: list[Path], drafts: list[Path]) -> list[tuple[Path, Path]]:
    """``--target`` and ``--draft`` (repeatable) as (target, draft) pairs: one draft per target, in order."""
    if len(targets) != len(drafts):
        raise RecspecError(f"give one --draft per --target ({len(targets)} targets, {len(drafts)} drafts)")
    return list(zip(targets, drafts))


@app.command("ids")
def bench_ids(
    out: ResultsOpt = Path("benchmarks/results"),
    repeats: Annotated[int, typer.Option(help="Timed runs per measurement (median reported).")] = 3,
    beauty: Annotated[Optional[Path], typer.Option(help="AtSpeed Beauty folder for the trie benchmark.")] = None,
) -> None:
    """Time identifier building (embedding, quantisation), collision rates and trie mask throughput."""
    from benchmarks.lab.ids import run

    typer.echo(run(results_dir(out), repeats=repeats, beauty=beauty))


@app.command("decode")
def bench_decode(
    target: Annotated[list[Path], typer.Option(help="Trained target folders (repeatable).")],
    out: ResultsOpt = Path("benchmarks/results"),
    k: Annotated[list[int], typer.Option(help="Beam widths (repeatable).")] = [1, 5, 10, 20],
    batch_size: Annotated[list[int], typer.Option(help="Batch sizes (repeatable).")] = [1, 16],
    users: Annotated[int, typer.Option(help="Test users decoded per cell, in batches of --batch-size.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed runs per cell (median reported).")] = 3,
    name: ResultNameOpt = "decode",
) -> None:
    """hf vs beam vs tree-beam: latency, users/s, peak memory and speed-ups, side by side."""
    from benchmarks.lab.decode import run

    typer.echo(run(results_dir(out), target, k, batch_size, users, repeats, name))


@app.command("spec")
def bench_spec(
    target: Annotated[list[Path], typer.Option(help="Trained target folders (repeatable).")],
    draft: Annotated[list[Path], typer.Option(help="The draft of each target, in the same order.")],
    out: ResultsOpt = Path("benchmarks/results"),
    k: Annotated[list[int], typer.Option(help="Beam widths (repeatable).")] = [1, 3, 5, 10, 20],
    users: Annotated[int, typer.Option(help="Test users timed one at a time (batch 1).")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed runs (median reported).")] = 3,
    draft_beams: Annotated[list[int], typer.Option(help="N of strict verification (repeatable; at least K).")] = [40],
    gamma: Annotated[Optional[int], typer.Option(help="Levels drafted per round (default: the rest).")] = None,
    temperature: Annotated[list[float], typer.Option(help="Temperatures of the quality comparison.")] = [0.5, 1.0],
    quality_k: Annotated[list[int], typer.Option(help="K of the quality comparison (repeatable).")] = [5, 10],
    quality_users: Annotated[int, typer.Option(help="Test users of the quality comparison.")] = 1000,
    name: ResultNameOpt = "spec",
) -> None:
    """AtSpeed: WS@K / AS@K of strict and relaxed verification against hf / beam / tree-beam, the
    oracle ceiling, and Recall / NDCG of relaxed sampling against the target's beam sampling."""
    from benchmarks.lab.spec import run

    typer.echo(run(results_dir(out), _pairs(target, draft), k, users, repeats, draft_beams, gamma, temperature, quality_k,
                   quality_users, name=name))


@app.command("prefix")
def bench_prefix(
    target: Annotated[Path, typer.Option(help="Trained target folder (an LLM preset: its prompt has a shared prefix).")],
    draft: Annotated[Optional[Path], typer.Option(help="Its draft, to time spec-strict too (a folder or items).")] = None,
    out: ResultsOpt = Path("benchmarks/results"),
    k: Annotated[list[int], typer.Option(help="Beam widths (repeatable).")] = [10],
    batch_size: Annotated[list[int], typer.Option(help="Batch sizes (repeatable).")] = [1, 16],
    users: Annotated[int, typer.Option(help="Test users decoded per cell, in batches of --batch-size.")] = 32,
    repeats: Annotated[int, typer.Option(help="Timed runs per cell (median reported).")] = 3,
    draft_beams: Annotated[int, typer.Option(help="N of spec-strict (at least K).")] = 20,
    name: ResultNameOpt = "prefix",
) -> None:
    """Prefix caching on and off, side by side: the prefill, beam, tree-beam (and spec-strict)
    with the template's shared prefix stored, and with every prompt fed whole."""
    from benchmarks.lab.prefix import run

    typer.echo(run(results_dir(out), target, draft, k, batch_size, users, repeats, draft_beams, name))


@app.command("coverage")
def bench_coverage(
    target: Annotated[Path, typer.Option(help="A trained target folder.")],
    draft: Annotated[list[Path], typer.Option(help="Its drafts: model folders or heads (repeatable).")],
    out: ResultsOpt = Path("benchmarks/results"),
    k: Annotated[list[int], typer.Option(help="Beam widths (repeatable).")] = [10],
    factor: Annotated[list[float], typer.Option(help="N = factor * K (repeatable).")] = [1.0, 1.5, 2.0, 4.0],
    users: Annotated[int, typer.Option(help="Test users.")] = 200,
    name: ResultNameOpt = "coverage",
) -> None:
    """Per level: how often the draft's top-N holds the target's top-K (strict acceptance from exact beams)."""
    from benchmarks.lab.coverage import run

    positive(users=users, k=min(k))
    if any(not math.isfinite(f) or f < 1 for f in factor):
        raise RecspecError(f"--factor must be >= 1 (N >= K), got {factor}")
    typer.echo(run(results_dir(out), target, draft, k, factor, users, name))


@app.command("level-prior")
def bench_level_prior(
    target: Annotated[Path, typer.Option(help="A trained target folder.")],
    draft: Annotated[Optional[Path], typer.Option(help="Its draft head (`recspec align train --head`); "
                                                       "without one, the target prior alone.")] = None,
    out: ResultsOpt = Path("benchmarks/results"),
    k: Annotated[int, typer.Option(help="Beam width.")] = 10,
    factor: Annotated[list[float], typer.Option(help="N = factor * K (repeatable).")] = [1.0, 2.0, 4.0],
    users: Annotated[int, typer.Option(help="Test users measured.")] = 200,
    prior_users: Annotated[int, typer.Option(help="The next test users, whose average is the target prior.")] = 1000,
    name: ResultNameOpt = "level-prior",
) -> None:
    """Level 2 taken apart: a head's coverage and recall of the target's top-K pairs against the
    target's own p(x2 | x1) averaged over other users (a table per node) and uniform."""
    from benchmarks.lab.level_prior import run

    positive(users=users, prior_users=prior_users, k=k)
    if any(not math.isfinite(f) or f < 1 for f in factor):
        raise RecspecError(f"--factor must be >= 1 (N >= K), got {factor}")
    typer.echo(run(results_dir(out), target, draft, k, factor, users, prior_users, name=name))


@app.command("auto")
def bench_auto(
    target: Annotated[list[Path], typer.Option(help="Trained target folders (repeatable).")],
    draft: Annotated[list[Path], typer.Option(help="The draft of each target (a model, a head, or MODEL+HEAD).")],
    out: ResultsOpt = Path("benchmarks/results"),
    k: Annotated[list[int], typer.Option(help="Beam widths (repeatable).")] = [1, 5, 10, 20],
    batch_size: Annotated[list[int], typer.Option(help="Users per batch (repeatable).")] = [1, 16],
    users: Annotated[int, typer.Option(help="Test users per cell.")] = 32,
    repeats: Annotated[int, typer.Option(help="Timed runs (median reported).")] = 3,
    name: ResultNameOpt = "auto",
) -> None:
    """`--decoder auto` against beam, tree-beam and spec-strict in every cell of K x batch size."""
    from benchmarks.lab.auto import run

    positive(users=users, repeats=repeats, k=min(k), batch_size=min(batch_size))
    typer.echo(run(results_dir(out), _pairs(target, draft), k, batch_size, users, repeats, name))


@app.command("forward")
def bench_forward(
    target: Annotated[Path, typer.Option(help="A folder written by `recspec train` (a small Llama).")],
    draft: Annotated[Optional[Path], typer.Option(help="Its draft, for speculative decoders.")] = None,
    decoder: Annotated[list[str], typer.Option(help="Decoders timed both ways (repeatable; NAME+root: tree-beam or "
                                                    "beam-sample with --expand-root).")] = ["beam", "tree-beam",
                                                                                           "tree-beam+root"],
    k: Annotated[int, typer.Option(help="Items per user.")] = 10,
    batch_size: Annotated[list[int], typer.Option(help="Users per batch (repeatable).")] = [1, 16],
    users: Annotated[int, typer.Option(help="Test users.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed runs (median reported).")] = 5,
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "forward",
) -> None:
    """Decoders through transformers' forward and through recspec's lean one, side by side: ms per
    user, speed-up, and the same items and scores bit for bit."""
    from benchmarks.lab.forward import run

    positive(users=users, repeats=repeats, k=k, batch_size=min(batch_size))
    typer.echo(run(results_dir(out), target, draft, decoder, k, batch_size, users, repeats, name))


@app.command("ray")
def bench_ray(
    target: Annotated[Path, typer.Option(help="A folder written by `recspec train` (recommend job).")],
    model: Annotated[str, typer.Option(help="LLM of the knowledge job: an asset name or a HF folder.")] = "smollm2",
    decoder: Annotated[str, typer.Option(help="Decoder of the recommend job.")] = "tree-beam",
    k: Annotated[int, typer.Option(help="Items per user.")] = 10,
    batch_size: Annotated[int, typer.Option(help="Users decoded together.")] = 16,
    items: Annotated[int, typer.Option(help="Item texts of the knowledge job.")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per text.")] = 32,
    repeats: Annotated[int, typer.Option(help="Runs per set-up (median reported).")] = 3,
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "ray",
) -> None:
    """Recommend (users/s) and knowledge generation (tokens/s) on Ray with one and with one-per-core
    workers against one process, end to end, outputs checked equal; the overhead of Ray itself."""
    from benchmarks.lab.cluster import run
    from recspec.recommend import check_decoder

    positive(k=k, batch_size=batch_size, items=items, max_new_tokens=max_new_tokens, repeats=repeats)
    check_decoder(decoder)
    typer.echo(run(results_dir(out), target, model, decoder, k, batch_size, items, max_new_tokens, repeats, name))


@app.command("curve")
def bench_curve(
    run: Annotated[list[Path], typer.Option(help="Training folders with a train_log.jsonl (repeatable).")],
    label: Annotated[list[str], typer.Option(help="A name for each --run, in the same order.")],
    threads: Annotated[list[int], typer.Option(help="The torch threads each --run trained with.")],
    metric: Annotated[str, typer.Option(help="The logged metric to plot.")] = "valid_acceptance",
    column: Annotated[Optional[list[str]], typer.Option(help="Further logged values to tabulate.")] = None,
    budget: Annotated[float, typer.Option(help="CPU-minutes within which the best value is reported.")] = 60.0,
    target: Annotated[Optional[float], typer.Option(help="A target value, drawn as a dashed line.")] = None,
    unit: Annotated[str, typer.Option(help="What the minutes are called: CPU-minutes, or for runs trained on "
                                           "an accelerator (--threads 1) its minutes, e.g. H100-minutes.")
                    ] = "CPU-minutes",
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "curve",
) -> None:
    """Validation curves of training runs side by side against CPU-minutes (from their train_log.jsonl)."""
    from benchmarks.lab.curve import run as write_curves

    positive(threads=min(threads), budget=budget)
    typer.echo(write_curves(results_dir(out), run, label, threads, metric, column or [], budget, target, name,
                            unit))


@app.command("pack")
def bench_pack(
    dataset: DatasetArg,
    preset: Annotated[str, typer.Option(help="Model preset trained (a fresh model per mode).")] = "target-mini",
    ids: Annotated[Optional[Path], typer.Option(help="Identifier folder or item_index.json (default: the "
                                                     "dataset's own).")] = None,
    split: Annotated[Optional[str], typer.Option(help="time, loo or given.")] = None,
    max_history: Annotated[int, typer.Option(help="History cap of prompts.")] = 20,
    mode: Annotated[Optional[list[str]], typer.Option(help="PACKxBATCH: pack size and sequences a step "
                                                           "(repeatable; the first is the reference).")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps per timed run.")] = 20,
    repeats: Annotated[int, typer.Option(help="Timed runs per mode (median reported).")] = 5,
    threads: Annotated[int, typer.Option(help="Torch threads.")] = 2,
    seed: int = 0,
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "pack",
) -> None:
    """Training throughput of one-example and packed batches side by side (examples/s, tokens/s)."""
    from benchmarks.lab.packing import run

    positive(steps=steps, repeats=repeats, threads=threads, max_history=max_history)
    typer.echo(run(results_dir(out), dataset, preset, ids, split, max_history, mode or ["1x64", "10x16"], steps,
                   repeats, threads, seed, name))


@app.command("rows")
def bench_rows(
    out: ResultsOpt = Path("benchmarks/results"),
    model: Annotated[str, typer.Option(help="Causal LM: an asset name or a HF model folder.")] = "smollm2",
    past: Annotated[int, typer.Option(help="Cached tokens before the call (a user prompt: 356).")] = 356,
    repeats: Annotated[int, typer.Option(help="Timed calls per size and setting (median).")] = 5,
    rounds: Annotated[int, typer.Option(help="Alternating rounds per size (median over them).")] = 3,
    threads: Annotated[int, typer.Option(help="CPU threads for torch.")] = 2,
    size: Annotated[Optional[list[int]], typer.Option(help="Tree nodes of a call (repeatable; default: 26 sizes "
                                                           "from 1 to 64).")] = None,
    name: ResultNameOpt = "rows",
    pairs: Annotated[Optional[int], typer.Option(help="Compare recspec's default with version 5's products (oneDNN "
                                                      "over packed weights, siblings fused) call by call instead: "
                                                      "this many pairs per size (median of the pairs' ratios).")] = None,
    against: Annotated[Optional[int], typer.Option(help="With --pairs: time each size against a call over this many "
                                                        "nodes instead, under version 5's products and recspec's "
                                                        "(median of the pairs' ratios n / this).")] = None,
    products: Annotated[bool, typer.Option("--products", help="Time one call's products alone instead (MKL, oneDNN "
                                                              "packed, recspec's kernel; --size rows, --repeats "
                                                              "passes).")] = False,
) -> None:
    """One call by the tree nodes it feeds: MKL products (padded to fast row counts and not), oneDNN over the plain
    weights from 7 rows, oneDNN over packed weights from 3 rows (unfused, and with sibling projections fused),
    recspec's default (its own small-row kernel, siblings fused), and packed grouped-query attention against
    transformers' own; with --pairs, the default against version 5's products pair by pair (with --against B, each
    size against a B-node call under each); with --products, the products alone."""
    import torch

    from benchmarks.lab.rows import PRODUCT_SIZES, SIZES, paired, run
    from benchmarks.lab.rows import against as time_against
    from benchmarks.lab.rows import products as time_products

    if min(past, repeats, rounds, threads, pairs or 2, *(size or [1])) < 1 or pairs == 1:
        raise RecspecError("--past, --repeats, --rounds, --threads and --size must be positive and --pairs at least 2")
    torch.set_num_threads(threads)
    if products:
        typer.echo(time_products(results_dir(out), model, tuple(size or PRODUCT_SIZES), repeats,
                                 name="row-products" if name == "rows" else name))
        return
    sizes = tuple(size or SIZES)
    if against is not None:
        if pairs is None or against < 1:
            raise RecspecError("--against goes with --pairs and is a positive node count")
        typer.echo(time_against(results_dir(out), model, past, sizes, pairs, against,
                                name="rows-against" if name == "rows" else name))
        return
    if pairs is not None:
        typer.echo(paired(results_dir(out), model, past, sizes, pairs, name=name))
        return
    typer.echo(run(results_dir(out), model, past, sizes=sizes, repeats=repeats, rounds=rounds, name=name))


@app.command("cost")
def bench_cost(
    target: Annotated[list[Path], typer.Option(help="Trained target folders (repeatable).")],
    draft: Annotated[list[Path], typer.Option(help="The draft of each target, in the same order.")],
    out: ResultsOpt = Path("benchmarks/results"),
    repeats: Annotated[int, typer.Option(help="Timed calls per shape (median reported).")] = 20,
    name: ResultNameOpt = "cost",
) -> None:
    """The draft's cost per call relative to its target's (c), for the call shapes the decoders make."""
    from benchmarks.lab.cost import run

    typer.echo(run(results_dir(out), _pairs(target, draft), repeats, name))


@app.command("align")
def bench_align(
    target: Annotated[Path, typer.Option(help="The trained target.")],
    data: Annotated[Path, typer.Option(help="Its alignment data (`recspec align data`).")],
    work: Annotated[Path, typer.Option(help="Folder of the drafts trained by the benchmark (reused).")] = Path(
        "runs/bench-align"),
    out: ResultsOpt = Path("benchmarks/results"),
    k: Annotated[list[int], typer.Option(help="Beam widths (repeatable).")] = [1, 3, 5, 10, 20],
    users: Annotated[int, typer.Option(help="Test users timed one at a time.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed runs (median reported).")] = 3,
    alpha: float = 0.5,
    curve_alpha: Annotated[list[float], typer.Option(help="Other alphas of the AtSpeed-S curve.")] = [0.1, 0.3, 0.7],
    draft_beams: int = 40,
    train_minutes: Annotated[float, typer.Option(help="Training budget of each draft.")] = 5.0,
    quality_users: Annotated[int, typer.Option(help="Test users of the relaxed-quality comparison.")] = 1000,
    heads: Annotated[bool, typer.Option(help="Also train and measure a feature-level head per method (same "
                                              "budget unless --head-minutes).")] = False,
    head_minutes: Annotated[Optional[float], typer.Option(help="Training budget of each head (default: "
                                                              "--train-minutes).")] = None,
    as_users: Annotated[int, typer.Option(help="Test users AS@K is averaged over (decoded in batches).")] = 256,
    epochs: Annotated[int, typer.Option(help="Epoch cap of each draft (the budget's cosine schedule).")] = 10,
    patience: Annotated[int, typer.Option(help="Epochs without a better validation acceptance before a draft "
                                               "stops (--epochs: none, every draft trains its whole budget).")] = 2,
    name: ResultNameOpt = "align",
) -> None:
    """Table 1 on our models: WS@K / AS@K of every alignment method under strict and relaxed
    verification (independent drafts, and with --heads feature-level heads), the ranking against
    the paper's, relaxed quality against beam sampling (Table 2) and the alpha curve (Fig. 4c)."""
    from benchmarks.lab.align import run

    positive(users=users, repeats=repeats, as_users=as_users, epochs=epochs, quality_users=quality_users,
              patience=patience)
    typer.echo(run(results_dir(out), target, data, work, k, users, repeats, alpha, curve_alpha, draft_beams, train_minutes,
                   epochs=epochs, quality_users=quality_users, heads=heads, as_users=as_users, name=name,
                   patience=patience, head_minutes=head_minutes))


@app.command("ctr")
def bench_ctr(
    greedy: Annotated[list[str], typer.Option(help="New-part store(s) of greedy knowledge (user and/or item).")],
    relaxed: Annotated[list[str], typer.Option(help="New-part store(s) of relaxed (LASER) knowledge.")],
    old: Annotated[list[str], typer.Option(help="Old-part item store(s): the existing items' knowledge.")] = [],
    out: ResultsOpt = Path("benchmarks/results"),
    seeds: Annotated[int, typer.Option(help="Training seeds per condition (mean reported).")] = 3,
    epochs: int = 3,
    model: Annotated[str, typer.Option(help="The target LLM whose hidden states embed the texts.")] = "smollm2",
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for torch.")] = None,
) -> None:
    """Downstream CTR (DIN-style) AUC / log loss: no knowledge vs greedy vs relaxed knowledge."""
    from benchmarks.lab.ctr import run
    from recspec.knowledge.job import set_threads

    set_threads(threads)
    typer.echo(run(results_dir(out), greedy, relaxed, old, model, seeds, epochs))


def main(argv: Optional[list[str]] = None) -> None:
    """Run the lab's command line as ``recspec`` runs its own (:func:`recspec.cli.main`): one line
    and status 2 for a user's error."""
    recspec_main(argv, app)
