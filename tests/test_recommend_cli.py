"""End to end through the command line on a small CSV data set: train, resume, recommend with
every decoder (identical lists), evaluate, and the errors of each step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.lab.prefix import bench as bench_prefix
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from tests.test_cli import lab, recspec


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """60 users walking through 40 items in a fixed cycle (next item = this item + 1), with identifiers."""
    root = tmp_path_factory.mktemp("small")
    rng = np.random.default_rng(0)
    lines = ["user,item,timestamp"]
    time = 0
    for user in range(60):
        start = int(rng.integers(0, 40))
        for step in range(8):
            time += 1
            lines.append(f"u{user},i{(start + step) % 40},{time}")
    (root / "data").mkdir()
    (root / "data" / "interactions.csv").write_text("\n".join(lines) + "\n")
    codes = np.stack([np.arange(40) // 8, np.arange(40) % 8, (np.arange(40) * 3) % 5], axis=1)
    ItemIndex.from_codes([f"i{i}" for i in range(40)], codes).save(root / "ids" / "item_index.json")
    return root / "data", root / "ids"


def test_train_recommend_eval(small_data: tuple[Path, Path], tmp_path: Path) -> None:
    data, ids = small_data
    out = tmp_path / "model"
    args = ["train", "--dataset", str(data), "--ids", str(ids), "--preset", "draft-tiny", "--out", str(out),
            "--split", "loo", "--epochs", "2", "--batch-size", "32", "--lr", "0.01", "--warmup-steps", "5",
            "--precision", "fp32"]
    result = recspec(*args)
    assert result.returncode == 0, result.stderr
    assert (out / "best" / "model.safetensors").is_file() and (out / "run.json").is_file()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in log] == [1, 2] and all("recall@10" in row for row in log)
    again = recspec(*args)  # finished run: resuming does nothing more and succeeds
    assert again.returncode == 0, again.stderr
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 2

    lists = {}
    for decoder in ("hf", "beam", "tree-beam"):
        recs = tmp_path / f"{decoder}.jsonl"
        result = recspec("recommend", "--target", str(out), "--decoder", decoder, "--k", "5", "--out", str(recs))
        assert result.returncode == 0, result.stderr
        rows = [json.loads(line) for line in recs.read_text().splitlines()]
        assert len(rows) == 60 and all(len(r["items"]) == 5 for r in rows)
        assert all(r["scores"] == sorted(r["scores"], reverse=True) for r in rows)
        lists[decoder] = [r["items"] for r in rows]
    assert lists["hf"] == lists["beam"] == lists["tree-beam"]
    result = recspec("recommend", "--target", str(out), "--k", "41", "--out", str(tmp_path / "r.jsonl"))
    assert result.returncode == 2 and "k=41 is outside [1, 40]" in result.stderr

    # speculative decoders with a second, differently seeded draft-tiny as the draft
    draft, foreign = tmp_path / "draft", tmp_path / "foreign"
    draft_args = ["train", "--dataset", str(data), "--preset", "draft-tiny", "--split", "loo", "--epochs", "1",
                  "--batch-size", "32", "--precision", "fp32", "--seed", "1"]
    result = recspec(*draft_args, "--ids", str(ids), "--out", str(draft))
    assert result.returncode == 0, result.stderr
    other_ids = tmp_path / "other-ids"
    index = ItemIndex.load(ids / "item_index.json")
    ItemIndex.from_codes(index.item_keys, index.codes[::-1].copy()).save(other_ids / "item_index.json")
    result = recspec(*draft_args, "--ids", str(other_ids), "--out", str(foreign))
    assert result.returncode == 0, result.stderr
    strict = tmp_path / "strict.jsonl"
    result = recspec("recommend", "--target", str(out), "--decoder", "spec-strict", "--draft", str(draft), "--k", "5",
                     "--draft-beams", "8", "--out", str(strict))
    assert result.returncode == 0, result.stderr
    assert "accepted steps" in result.stdout and "target calls" in result.stdout
    assert [json.loads(line)["items"] for line in strict.read_text().splitlines()] == lists["beam"]
    items = tmp_path / "items.jsonl"  # the item prior as the draft: no model, the same items
    result = recspec("recommend", "--target", str(out), "--decoder", "spec-strict", "--draft", "items", "--k", "5",
                     "--draft-beams", "10", "--out", str(items))
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["items"] for line in items.read_text().splitlines()] == lists["beam"]
    relaxed = tmp_path / "relaxed.jsonl"
    result = recspec("recommend", "--target", str(out), "--decoder", "spec-relaxed", "--draft", str(draft), "--k", "5",
                     "--temperature", "0.5", "--out", str(relaxed))
    assert result.returncode == 0, result.stderr
    assert all(len(set(json.loads(line)["items"])) == 5 for line in relaxed.read_text().splitlines())
    sampled = tmp_path / "sampled.jsonl"  # exact sampling verification over the unfitted root prior
    result = recspec("recommend", "--target", str(out), "--decoder", "spec-beam-sample", "--draft", "root", "--k", "5",
                     "--draft-beams", "64", "--gamma", "1", "--out", str(sampled))
    assert result.returncode == 0, result.stderr
    assert all(len(set(json.loads(line)["items"])) == 5 for line in sampled.read_text().splitlines())
    result = recspec("bench", "compare", "--target", str(out), "--draft", "root", "--decoder", "beam-sample",
                     "--decoder", "spec-beam-sample", "--k", "5", "--users", "4", "--repeats", "1", "--draft-beams",
                     "64", "--gamma", "1", "--out", str(tmp_path / "compared"), "--name", "sampled")
    assert result.returncode == 0, result.stderr
    compared = json.loads((tmp_path / "compared" / "sampled.json").read_text())
    assert [r["decoder"] for r in compared["rows"]] == ["beam-sample", "spec-beam-sample"]
    assert compared["draft_beams"] == 64 and all(r["same_items"] is None for r in compared["rows"])
    for extra, message in ((["--decoder", "spec-strict"], "needs a draft model"),
                           (["--decoder", "spec-beam-sample", "--draft", "root", "--draft-beams", "3"],
                            "sample verification accepts a step only when all k"),
                           (["--decoder", "spec-strict", "--draft", str(draft), "--draft-beams", "3"], "at least k=5"),
                           (["--decoder", "spec-strict", "--draft", str(draft), "--gamma", "3"], "gamma=3 is outside"),
                           (["--decoder", "spec-relaxed", "--draft", str(draft), "--temperature", "0"],
                            "temperature must be a positive number"),
                           (["--decoder", "spec-strict", "--draft", str(foreign)], "trained for another item index"),
                           (["--decoder", "dsbd", "--draft", "items"], "and a target prior serve")):
        result = recspec("recommend", "--target", str(out), "--k", "5", "--out", str(tmp_path / "x.jsonl"), *extra)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)

    dsbd = tmp_path / "dsbd.jsonl"
    result = recspec("recommend", "--target", str(out), "--decoder", "dsbd", "--draft", str(draft), "--k", "5",
                     "--threshold", "0.5", "--min-width", "2", "--out", str(dsbd))
    assert result.returncode == 0, result.stderr
    assert "accepted steps" in result.stdout
    rows = [json.loads(line) for line in dsbd.read_text().splitlines()]
    assert len(rows) == 60 and all(1 <= len(r["items"]) == len(set(r["items"])) <= 5 for r in rows)
    for extra, message in ((["--draft-width", "3"], "W_S=3 is below W_min=5"),
                           (["--threshold", "1.5"], "threshold t must lie in [0, 1]"),
                           (["--gamma", "0"], "gamma=0 is outside"),
                           (["--temperature", "0"], "temperature must be a positive number")):
        result = recspec("recommend", "--target", str(out), "--k", "5", "--decoder", "dsbd", "--draft", str(draft),
                         "--out", str(tmp_path / "x.jsonl"), *extra)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
    result = recspec("bench", "sampling", "--no-text", "--rec-target", str(out), "--rec-draft", str(draft), "--k", "5",
                     "--users", "3", "--quality-users", "20", "--repeats", "1", "--out", str(tmp_path / "results"))
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "results" / "sampling.json").read_text())["recommend"]
    assert [r["decoder"] for r in rows] == ["beam-sample", "spec-relaxed", "dsbd", "dsbd-dynamic", "dsbd-one-cache"]
    assert all(r["ws"] > 0 and 0 <= r["recall@5"] <= 1 for r in rows), rows

    bench = tmp_path / "results"
    result = lab("decode", "--target", str(out), "--k", "5", "--batch-size", "1", "--batch-size", "4",
                 "--users", "8", "--repeats", "1", "--out", str(bench))
    assert result.returncode == 0, result.stderr
    rows = json.loads((bench / "decode.json").read_text())["rows"]
    assert [(r["batch"], r["decoder"]) for r in rows] == [(b, d) for b in (1, 4) for d in ("hf", "beam", "tree-beam")]
    assert all(r["users"] == 8 and r["same_items_as_hf"] and r["peak_mib"] >= 0 and r["median_s"] > 0 for r in rows), rows
    assert "same as hf" in (bench / "decode.md").read_text()
    result = lab("cost", "--target", str(out), "--draft", str(draft), "--repeats", "3", "--out", str(bench))
    assert result.returncode == 0, result.stderr
    rows = json.loads((bench / "cost.json").read_text())["rows"]
    assert len(rows) == 5 and all(r["target_s"] > 0 and r["draft_s"] > 0 for r in rows)
    assert all(r["c"] == r["draft_s"] / r["target_s"] for r in rows)
    # both models are draft-tiny here: the same parameters, so the same cost up to timing noise
    assert rows[0]["target_parameters"] == rows[0]["draft_parameters"] and 0.2 < rows[0]["c"] < 5
    assert lab("cost", "--target", str(out), "--out", str(bench)).returncode == 2
    with pytest.raises(RecspecError, match="no shared prefix of at least 16 tokens"):  # a small preset's is <bos>
        bench_prefix(out, None, (5,), (1,), 2, 1, 10)
    result = recspec("calibrate", "--target", str(out), "--draft", str(draft), "--repeats", "2", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == ["target", "draft, first round",
                                                                          "draft, later rounds"]
    assert (out / "best" / "calibration-cpu.json").is_file() and (draft / "best" / "calibration-cpu.json").is_file()

    result = recspec("eval", "--recs", str(tmp_path / "beam.jsonl"), "--dataset", str(data), "--split", "loo",
                     "--k", "1", "--k", "5")
    assert result.returncode == 0, result.stderr
    metrics = dict(line.split() for line in result.stdout.splitlines())
    assert metrics["users"] == "60" and 0 <= float(metrics["recall@5"]) <= 1
    assert float(metrics["recall@5"]) >= float(metrics["recall@1"])
    assert 0 <= float(metrics["popular-recall@1"]) <= float(metrics["popular-recall@5"]) <= 1
    baseline = recspec("eval", "--dataset", str(data), "--split", "loo", "--k", "5")  # no recs: every user
    assert baseline.returncode == 0, baseline.stderr
    assert dict(line.split() for line in baseline.stdout.splitlines()).keys() == {"users", "popular-recall@5",
                                                                                 "popular-ndcg@5"}


def test_errors(small_data: tuple[Path, Path], tmp_path: Path) -> None:
    data, ids = small_data
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    result = recspec("train", "--dataset", str(data), "--ids", str(ids), "--preset", "draft-tiny",
                     "--out", str(tmp_path / "busy"))
    assert result.returncode == 2 and "--overwrite" in result.stderr
    result = recspec("train", "--dataset", str(data), "--ids", str(ids), "--preset", "huge", "--out",
                     str(tmp_path / "m"))
    assert result.returncode == 2 and "unknown model preset" in result.stderr
    result = recspec("recommend", "--target", str(tmp_path / "nothing"), "--out", str(tmp_path / "r.jsonl"))
    assert result.returncode == 2 and "not a folder written by `recspec train`" in result.stderr
    (tmp_path / "bad.jsonl").write_text('{"user": "u1", "items": ["i1"]}\n{oops\n')
    result = recspec("eval", "--recs", str(tmp_path / "bad.jsonl"), "--dataset", str(data), "--split", "loo")
    assert result.returncode == 2 and "bad.jsonl:2: malformed JSON" in result.stderr


def test_draft_kinds(tmp_path: Path) -> None:
    """`--draft KIND:PATH` names the kind of each folder; a bare folder is read as before (its kind
    inferred from its files) with one line saying how to write it (kept for one release)."""
    from recspec.recommend import draft_kinds, draft_spelling

    assert draft_kinds("model:a+head:b") == [("model", Path("a")), ("head", Path("b"))]
    assert draft_kinds("prior:p") == [("prior", Path("p"))]
    assert draft_kinds(tmp_path / "m") == [("model", tmp_path / "m")]  # no prior or head files: a draft model
    assert draft_spelling("model:a+head:b") is None and draft_spelling("items") is None
    assert draft_spelling("a") == "model:a"
    missing = tmp_path / "no-draft"
    for draft, warned in ((str(missing), True), (f"model:{missing}", False)):
        result = recspec("recommend", "--target", str(tmp_path / "no-target"), "--draft", draft, "--out",
                         str(tmp_path / "x.jsonl"))
        assert result.returncode == 2, result.stderr
        assert ("warning: --draft without a kind is deprecated" in result.stderr) == warned, result.stderr
