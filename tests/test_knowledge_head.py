"""A text draft head in the knowledge job: `--decoder ar --draft HEAD` (greedy speculative
decoding drafted by the head) and hybrid trees with retrieval (`--decoder laser|resd --draft
HEAD`) on the real SmolLM2 and MovieLens; greedy texts equal plain greedy decoding token for
token, relaxed stores record the head; the tree union; bad input refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recspec.bench.knowledge import run_knowledge as bench_knowledge
from recspec.cli import main
from recspec.errors import RecspecError
from recspec.decoding.text_rounds import DraftTree
from recspec.decoding.head_trees import HeadTreeConfig
from recspec.knowledge.decode import merge_trees
from recspec.knowledge.job import KnowledgeConfig, run_job
from recspec.knowledge.store import read_rows, read_settings
from recspec.knowledge.verify import Verification
from recspec.models.head import save_head
from recspec.accel.int8 import INT8_PRODUCTS_VERSION, int8_serves
from recspec.models.text_head import TEXT_HEAD, new_text_head, text_head_fingerprint
from tests.test_knowledge_job import OLD_ITEMS, old_store, task  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = Verification("greedy")


@pytest.fixture(scope="module")
def head(task, tmp_path_factory) -> Path:  # noqa: F811
    """An untrained reduced-vocabulary head for SmolLM2 (its drafts are poor; exactness must not
    depend on them), saved as `recspec distill --head` saves one."""
    path = tmp_path_factory.mktemp("head") / "best"
    vocab = torch.arange(0, 4000, dtype=torch.int64)
    save_head(path, new_text_head(task.model, vocab, seed=2), text_head_fingerprint(task.model_dir),
              {"note": "test"}, TEXT_HEAD)
    return path


def test_merge_trees_is_the_union_of_paths() -> None:
    first = DraftTree([5, 6, 7], [-1, 0, -1])
    second = DraftTree([5, 9, 6, 8, 7], [-1, -1, 0, 2, 3])
    merged = merge_trees(first, second)
    assert merged == DraftTree([5, 6, 7, 9, 8, 7], [-1, 0, -1, -1, 1, 4])
    paths = set()
    for i in range(len(merged)):
        path, node = [], i
        while node >= 0:
            path.append(merged.tokens[node])
            node = merged.parents[node]
        paths.add(tuple(reversed(path)))
    assert len(paths) == len(merged)  # no path twice
    assert all(parent < i for i, parent in enumerate(merged.parents))
    assert merge_trees(DraftTree([], []), second) == second and merge_trees(first, DraftTree([], [])) == first


def test_greedy_with_a_head_and_hybrid_trees_equal_greedy(task, old_store, head, tmp_path) -> None:  # noqa: F811
    """`ar` with a head, and `laser` / `resd` with pools and a head under greedy verification,
    write exactly the texts of plain greedy decoding."""
    new = replace(OLD_ITEMS, part="new", max_new_tokens=12)
    run_job(task, new, tmp_path / "plain.db", limit=3, progress=False)
    plain = {row.entity: row.tokens for row in read_rows(tmp_path / "plain.db")}
    tree = HeadTreeConfig(width=3, depth=3, nodes=8)
    for name, config, pool in (
            ("head", replace(new, draft=str(head), head_tree=tree), None),
            ("laser", replace(new, method="laser", grouping="attribute", draft=str(head),
                              head_tree=replace(tree, gate=None)), old_store),
            ("gated", replace(new, method="laser", grouping="attribute", draft=str(head), head_tree=tree), old_store),
            ("resd", replace(new, method="resd", draft=str(head), head_tree=tree), old_store)):
        summary = run_job(task, config, tmp_path / f"{name}.db", pool=pool, limit=3, progress=False)
        rows = list(read_rows(tmp_path / f"{name}.db"))
        assert {row.entity: row.tokens for row in rows} == plain, name
        assert sum(row.drafted for row in rows) > 0 and summary.calls <= sum(len(t) for t in plain.values())
        assert "head_sha256" not in read_settings(tmp_path / f"{name}.db")  # greedy texts do not depend on it


def test_greedy_trees_are_sized_from_the_cost_model(task, head) -> None:  # noqa: F811
    """Greedy verification sizes the head's trees from the model's kept call cost plus the head's
    timed drafting; relaxed verification and --fixed-tree keep the configured size."""
    tree = HeadTreeConfig(width=3, depth=3, nodes=8)
    greedy = replace(OLD_ITEMS, part="new", draft=str(head), head_tree=tree)
    cost = task.head_drafter(greedy).cost
    assert cost is not None and cost.fixed_s > 0 and cost.per_token_s >= 0
    assert not cost.padded  # recspec's products compute 3..128 rows with oneDNN: no call is padded, no free nodes
    assert task.head_drafter(greedy).cost == cost  # measured once per head and tree
    assert (task.model_dir / "calibration-cpu.json").is_file()  # the model's part is kept beside it
    assert task.head_drafter(replace(greedy, head_tree=replace(tree, sized=False))).cost is None
    relaxed = replace(greedy, method="laser", verification=Verification("relaxed"))
    assert task.head_drafter(relaxed).cost is None


def test_relaxed_hybrid_records_the_head_and_bad_input_is_refused(task, old_store, head, tmp_path,  # noqa: F811
                                                                   capsys) -> None:
    laser = KnowledgeConfig(side="item", method="laser", max_new_tokens=8, grouping="attribute", draft=str(head),
                            head_tree=HeadTreeConfig(width=2, depth=2, nodes=4))
    summary = run_job(task, laser, tmp_path / "relaxed.db", pool=old_store, limit=2, progress=False)
    settings = read_settings(tmp_path / "relaxed.db")
    assert summary.requests == 2 and len(settings["head_sha256"]) == 64
    assert settings["head_tree"] == {"width": 2, "depth": 2, "nodes": 4, "gate": 2}
    # the draft's precision changes a relaxed text: recorded where int8 serves (a CPU whose 8-bit products hold)
    int8 = INT8_PRODUCTS_VERSION if int8_serves("cpu") else None
    assert settings.get("head_int8") == int8
    assert task.store_settings(laser).get("head_int8") == int8  # known without binding the head
    fp32 = run_job(task, replace(laser, head_int8=False), tmp_path / "relaxed-fp32.db", pool=old_store, limit=2,
                   progress=False)
    assert fp32.requests == 2 and "head_int8" not in read_settings(tmp_path / "relaxed-fp32.db")
    with pytest.raises(RecspecError, match="method hf does not draft with one"):
        KnowledgeConfig(method="hf", verification=GREEDY, draft=str(head))
    with pytest.raises(RecspecError, match="width, depth and nodes >= 1"):
        HeadTreeConfig(width=0)
    with pytest.raises(RecspecError, match="gate is a retrieved depth of at least 1"):
        HeadTreeConfig(gate=0)
    out = tmp_path / "cli.db"
    with pytest.raises(SystemExit) as exit_info:
        main(["knowledge", "generate", "--out", str(out), "--side", "item", "--part", "old", "--decoder", "hf",
              "--verify", "greedy", "--draft", str(head), "--limit", "1"])
    assert exit_info.value.code == 2 and "does not draft with one" in capsys.readouterr().err
    assert not out.exists()


def test_bench_knowledge_runs_the_head_variants(task, head, tmp_path) -> None:  # noqa: F811
    """`bench knowledge --side item --draft HEAD` without a pool: hf, ar and the head side by side,
    the head's greedy texts equal hf's; pool and head variants refused without what they need."""
    base = replace(KnowledgeConfig(), draft=str(head), head_tree=HeadTreeConfig(width=2, depth=2, nodes=4))
    markdown = bench_knowledge(tmp_path, {"item": None}, limit=2, repeats=1, max_new_tokens=6, base=base,
                               variants=("hf", "ar", "head"), model=str(task.model_dir), name="head")
    rows = json.loads((tmp_path / "head.json").read_text())["sides"][0]["rows"]
    assert list(rows) == ["hf", "ar", "head"] and rows["head"]["same_as_hf"] == 2
    assert rows["head"]["draft_nodes_per_call"] > 0 and "head tokens/s ratio: " in markdown
    with pytest.raises(RecspecError, match="drafts from old-part pools: pass --item-pool"):
        bench_knowledge(tmp_path, {"item": None}, variants=("hf", "laser"), base=base, model=str(task.model_dir))
    with pytest.raises(RecspecError, match="drafts with a text head: pass --draft"):
        bench_knowledge(tmp_path, {"item": None}, variants=("hf", "head"), model=str(task.model_dir))
    with pytest.raises(RecspecError, match="gates the head by retrieval's depth: pass --head-gate"):
        bench_knowledge(tmp_path, {"item": None}, variants=("hf", "laser+head-gated"),
                        base=replace(base, head_tree=replace(base.head_tree, gate=None)), model=str(task.model_dir))
