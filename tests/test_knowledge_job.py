"""The knowledge job on the real SmolLM2 and MovieLens: persisted results, resume without
duplicates after a crash, refusal to mix stores, pool checks, prompt truncation, CLI."""

from __future__ import annotations

import json
import sqlite3
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import typer.testing

from recspec.bench.knowledge import run_knowledge as bench_knowledge
from recspec.cli import app, main
from recspec.errors import RecspecError
from recspec.knowledge.job import KnowledgeConfig, KnowledgeTask, run_job
from recspec.knowledge.prompts import user_prompt_ids
from recspec.knowledge.store import KnowledgeStore, read_rows, read_settings
from recspec.knowledge.verify import Verification

GREEDY = Verification("greedy")
OLD_ITEMS = KnowledgeConfig(side="item", part="old", method="ar", verification=GREEDY, max_new_tokens=6)


@pytest.fixture(scope="module")
def task(smollm2_dir, ml100k) -> KnowledgeTask:
    return KnowledgeTask(str(smollm2_dir), "ml-100k")


@pytest.fixture(scope="module")
def old_store(task, tmp_path_factory) -> Path:
    """Old-part item knowledge of the first 3 existing items (6 tokens each)."""
    out = tmp_path_factory.mktemp("old") / "item-old.db"
    summary = run_job(task, OLD_ITEMS, out, limit=3, progress=False)
    assert summary.requests == 3 and summary.tokens == sum(r.new_tokens for r in read_rows(out))
    return out


def crash_on_second_add(monkeypatch) -> list[list[str]]:
    """Make :meth:`KnowledgeStore.add` raise KeyboardInterrupt on its second call, before storing
    anything of it; returns the entities of each call (filled as the job runs)."""
    original = KnowledgeStore.add
    calls: list[list[str]] = []

    def add(self, results) -> None:
        calls.append([entity for entity, _, _ in results])
        if len(calls) == 2:
            raise KeyboardInterrupt
        original(self, results)

    monkeypatch.setattr(KnowledgeStore, "add", add)
    return calls


def test_crash_loses_only_the_request_in_flight_and_resume_adds_no_duplicates(task, old_store, tmp_path,
                                                                               monkeypatch) -> None:
    out = tmp_path / "items.db"
    calls = crash_on_second_add(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_job(task, OLD_ITEMS, out, limit=3, progress=False)
    monkeypatch.undo()
    assert [r.entity for r in read_rows(out)] == calls[0]
    summary = run_job(task, OLD_ITEMS, out, limit=3, progress=False)
    assert (summary.skipped, summary.requests) == (1, 2)
    rows = list(read_rows(out))
    assert sorted(r.entity for r in rows) == sorted(r.entity for r in read_rows(old_store))
    assert [r.tokens for r in sorted(rows, key=lambda r: r.entity)] == [
        r.tokens for r in sorted(read_rows(old_store), key=lambda r: r.entity)]  # same greedy texts
    assert run_job(task, OLD_ITEMS, out, limit=3, progress=False).requests == 0
    assert all(r.new_tokens == len(r.tokens) <= 6 and r.calls >= 1 and r.wall_s > 0 for r in rows)


def test_batched_hf_job_persists_whole_batches_and_resumes(task, tmp_path, monkeypatch) -> None:
    """--batch-size: one transaction per batch (a crash loses the batch in flight only), resume
    without duplicates, greedy texts (these 6-token ones have no near-tie), batch size recorded."""
    config = replace(OLD_ITEMS, method="hf", batch_size=2)
    out = tmp_path / "batched.db"
    batches = crash_on_second_add(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_job(task, config, out, limit=5, progress=False)
    monkeypatch.undo()
    assert [len(b) for b in batches] == [2, 2]
    assert [r.entity for r in read_rows(out)] == batches[0]
    summary = run_job(task, config, out, limit=5, progress=False)
    assert (summary.skipped, summary.requests) == (2, 3)
    assert read_settings(out)["batch_size"] == 2
    single = tmp_path / "single.db"
    run_job(task, OLD_ITEMS, single, limit=5, progress=False)
    by_entity = {r.entity: r.tokens for r in read_rows(single)}
    assert {r.entity: r.tokens for r in read_rows(out)} == by_entity
    with pytest.raises(RecspecError, match="batch_size=2, this job has batch_size=None"):
        run_job(task, replace(config, batch_size=1), out, limit=5, progress=False)
    with pytest.raises(RecspecError, match="prompt lookup decoding .* one request at a time"):
        KnowledgeConfig(method="prompt-lookup", verification=GREEDY, batch_size=4)
    with pytest.raises(RecspecError, match="--batch-size must be a positive integer"):
        replace(config, batch_size=0)


@pytest.mark.parametrize("method, verify", [("laser", "greedy"), ("laser", "relaxed"), ("resd", "greedy")])
def test_drafted_jobs_in_batches_write_the_texts_of_one_at_a_time(task, old_store, tmp_path, method, verify) -> None:
    """The drafting decoders of the job at --batch-size 4 (one text round loop per batch, the pools
    as they stand when the batch starts) write, for 8 new items, exactly the texts of batch 1."""
    config = KnowledgeConfig(side="item", method=method, verification=Verification(verify), max_new_tokens=20,
                             grouping="attribute")
    texts = {}
    for size in (1, 4):
        out = tmp_path / f"{size}.db"
        summary = run_job(task, replace(config, batch_size=size), out, pool=old_store, limit=8, progress=False)
        assert summary.requests == 8
        texts[size] = {r.entity: r.tokens for r in read_rows(out)}
    assert texts[4] == texts[1]
    assert all(len(tokens) >= 1 for tokens in texts[1].values())


def test_greedy_trees_are_sized_and_a_relaxed_store_records_their_shape_only(task) -> None:
    """Greedy retrieval is sized from the target's call cost unless told not to; relaxed
    verification (its text depends on the tree) and a head's hybrid never are. A relaxed store
    records the limits that shape a tree, not the switch, so a store from before sizing resumes."""
    laser = KnowledgeConfig(method="laser", verification=GREEDY)
    cost = task.retrieval_cost(laser)
    assert cost is not None and cost.fixed_s > 0 and cost.per_token_s > 0
    fixed = replace(laser, retrieval=replace(laser.retrieval, sized=False))
    relaxed = replace(laser, verification=Verification("relaxed"))
    assert task.retrieval_cost(fixed) is task.retrieval_cost(relaxed) is task.retrieval_cost(
        replace(laser, draft="a-head-folder")) is None
    assert relaxed.settings()["pools"]["retrieval"] == {"max_nodes": 16, "max_depth": 12, "max_suffix": 4}
    assert replace(relaxed, retrieval=fixed.retrieval).settings() == relaxed.settings()


def test_a_store_of_other_settings_is_refused(task, old_store, monkeypatch) -> None:
    with pytest.raises(RecspecError, match="max_new_tokens=6, this job has max_new_tokens=7"):
        run_job(task, replace(OLD_ITEMS, max_new_tokens=7), old_store, limit=1, progress=False)
    with pytest.raises(RecspecError, match="method='ar', this job has method='hf'"):
        run_job(task, replace(OLD_ITEMS, method="hf"), old_store, limit=1, progress=False)
    monkeypatch.setitem(task.identity, "prompt_version", "another-prompt")
    with pytest.raises(RecspecError, match="prompt_version='kar-movielens-v1'"):
        run_job(task, OLD_ITEMS, old_store, limit=1, progress=False)
    monkeypatch.setitem(task.identity, "model", {"name": "other", "fingerprint": "0"})
    with pytest.raises(RecspecError, match="written with model="):
        run_job(task, OLD_ITEMS, old_store, limit=1, progress=False)


def test_drafting_methods_use_a_matching_old_part_pool(task, old_store, tmp_path) -> None:
    laser = KnowledgeConfig(side="item", method="laser", max_new_tokens=6, grouping="attribute")
    with pytest.raises(RecspecError, match="pass --pool"):
        run_job(task, laser, tmp_path / "a.db", limit=1, progress=False)
    summary = run_job(task, laser, tmp_path / "a.db", pool=old_store, limit=2, progress=False)
    assert summary.requests == 2
    assert read_settings(tmp_path / "a.db")["verify"] == "relaxed (the argmax, or top-2 with p > 0.1)"
    new_items = tmp_path / "b.db"
    run_job(task, replace(OLD_ITEMS, part="new"), new_items, limit=1, progress=False)
    with pytest.raises(RecspecError, match="part=new"):
        run_job(task, laser, tmp_path / "c.db", pool=new_items, limit=1, progress=False)
    with pytest.raises(RecspecError, match="side='item', this job has side='user'"):
        run_job(task, replace(laser, side="user"), tmp_path / "d.db", pool=old_store, limit=1, progress=False)
    with pytest.raises(RecspecError, match="relaxed verification is LASER's"):
        KnowledgeConfig(method="resd")
    with pytest.raises(RecspecError, match="draft trees hold 1 to 64 nodes"):
        KnowledgeConfig(retrieval=replace(laser.retrieval, max_nodes=65))


def test_user_prompts_truncate_by_the_documented_rule(task) -> None:
    tokenizer, dataset, split = task.tokenizer, task.dataset, task.split
    rows = split.new[0]
    full = user_prompt_ids(tokenizer, dataset, 0, rows, 10, 10_000)
    shorter = user_prompt_ids(tokenizer, dataset, 0, rows, 10, len(full) - 1)
    text = tokenizer.decode(shorter)
    assert len(shorter) < len(full) and "1. " in text and "10. " not in text  # the oldest movie was dropped
    assert tokenizer.decode(full).count("\n1. ") == 1 and "\n10. " in tokenizer.decode(full)
    with pytest.raises(RecspecError, match="even with one movie"):
        user_prompt_ids(tokenizer, dataset, 0, rows, 10, 20)
    with pytest.raises(RecspecError, match="no movies in this part"):
        user_prompt_ids(tokenizer, dataset, 0, rows[:0], 10, 10_000)


def recspec(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run the command line in this process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["recspec", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_cli_show_and_one_line_errors(old_store, tmp_path, monkeypatch, capsys) -> None:
    runner = typer.testing.CliRunner()
    for command in (["knowledge"], ["knowledge", "generate"], ["knowledge", "show"], ["bench", "knowledge"]):
        assert runner.invoke(app, [*command, "--help"]).exit_code == 0
    status, out, _ = recspec(monkeypatch, capsys, "knowledge", "show", str(old_store), "--examples", "1")
    assert status == 0 and "3 item texts (old part), method ar, verify greedy" in out
    for args, message in (
        (["--k", "0"], "error: relaxed verification needs k >= 1 (an integer), got 0"),
        (["--p", "1"], "error: relaxed verification needs p in [0, 1), got 1.0"),
        (["--decoder", "beam"], "error: unknown decoder 'beam'; choose one of ar, hf, prompt-lookup, resd, laser"),
    ):
        status, _, err = recspec(monkeypatch, capsys, "knowledge", "generate", "--out", str(tmp_path / "x.db"), *args)
        assert (status, err.splitlines()) == (2, [message])
    (tmp_path / "bad.db").write_bytes(b"not a database at all, just bytes" * 10)
    status, _, err = recspec(monkeypatch, capsys, "knowledge", "show", str(tmp_path / "bad.db"))
    assert status == 2 and len(err.splitlines()) == 1 and "not a knowledge store" in err
    assert not (tmp_path / "x.db").exists()
    with sqlite3.connect(old_store) as db:  # results are committed, readable by any SQLite client
        assert db.execute("SELECT COUNT(*) FROM knowledge").fetchone()[0] == 3


def test_any_hugging_face_causal_lm_folder_plugs_in(smollm2_dir, ml100k, tmp_path) -> None:
    """A plain model folder (a tiny random Llama with SmolLM2's tokenizer): greedy LASER reproduces
    plain greedy decoding, and relaxed LASER runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from recspec.hub import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    folder = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tiny = KnowledgeTask(str(folder), "ml-100k")
    old = replace(OLD_ITEMS, max_new_tokens=12)
    run_job(tiny, old, tmp_path / "old.db", limit=3, progress=False)
    ar = replace(old, part="new")
    run_job(tiny, ar, tmp_path / "ar.db", limit=3, progress=False)
    laser = replace(ar, method="laser", grouping="global")
    run_job(tiny, replace(laser, verification=GREEDY), tmp_path / "greedy.db", pool=tmp_path / "old.db", limit=3,
            progress=False)
    run_job(tiny, laser, tmp_path / "relaxed.db", pool=tmp_path / "old.db", limit=3, progress=False)
    assert [r.tokens for r in read_rows(tmp_path / "greedy.db")] == [r.tokens for r in read_rows(tmp_path / "ar.db")]
    assert len(list(read_rows(tmp_path / "relaxed.db"))) == 3
    assert read_settings(tmp_path / "ar.db")["model"]["name"] == "tiny"


def test_bench_knowledge_reports_every_variant_against_hf(task, old_store, tmp_path) -> None:
    """`bench knowledge` on two new items: every variant's row, speed-ups against hf, greedy
    variants reproducing hf's tokens, and the pool settings (groups) in the results."""
    base = KnowledgeConfig(groups=3, min_interactions=4)
    markdown = bench_knowledge(tmp_path, {"item": old_store}, limit=2, repeats=1, max_new_tokens=6, base=base,
                   variants=("hf", "resd", "laser-greedy", "laser"), model=str(task.model_dir))
    results = json.loads((tmp_path / "knowledge.json").read_text())
    assert (results["groups"], results["min_interactions"]) == (3, 4)
    rows = results["sides"][0]["rows"]
    assert list(rows) == ["hf", "resd", "laser-greedy", "laser"] and rows["hf"]["speedup"] == 1.0
    assert rows["hf"]["aal"] == 1.0 and rows["hf"]["tokens"] == 12 and rows["laser"]["speedup"] > 0
    assert rows["resd"]["same_as_hf"] == rows["laser-greedy"]["same_as_hf"] == 2
    assert "3 k-means groups, routed from 4 interactions" in markdown and "laser tokens/s ratio: " in markdown
