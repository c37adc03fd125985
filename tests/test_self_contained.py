"""Self-contained model folders: a trained target moved to another folder, on a machine without
its data set (an empty asset cache, so MovieLens-100K cannot be read), answers exactly as before:
`recspec recommend` for the data set's users given as ``--dataset``, ``recspec.load(folder)``
over raw histories, `recspec serve` (uvicorn in a subprocess, ``auto`` measuring on the users the
folder keeps) and the transformers drop-in over the folder's index and tokenizer. What needs the
data set says so in one line. A folder written before recspec kept ``serving.json`` loads where its
data set is, names `recspec upgrade` where it is not, and the upgrade makes it self-contained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import recspec
from recspec.assets import asset_dir
from recspec.data import load_dataset
from recspec.decoding.prompts import left_pad
from recspec.errors import RecspecError
from recspec.fileio import CHECKSUMS, read_json, write_json_atomic
from recspec.hf import trie_beam_search
from recspec.models.checkpoint import BEST_DIR, INDEX_FILE, RUN_FILE
from recspec.models.run_data import SERVING_FILE
from recspec.recommend import Recommender
from recspec.serve.schemas import RecommendRequest
from recspec.serve.service import RecommendService
from tests.test_cli import recspec as run_cli
from tests.test_serve import server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
USERS = 12  # test users whose answers are compared
K = 10


def answers(rows: list) -> list[tuple[list[str], list[float]]]:
    """Items and scores of API answers (:class:`~recspec.serve.service.Answer`) or JSON rows."""
    return [(row["items"], row["scores"]) if isinstance(row, dict) else (row.items, row.scores) for row in rows]


def assert_same(got: list[tuple[list[str], list[float]]], want: list[tuple[list[str], list[float]]]) -> None:
    assert len(got) == len(want)
    for (items, scores), (want_items, want_scores) in zip(got, want):
        assert items == want_items
        assert np.allclose(scores, want_scores, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def before(trained_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """With the data set present: this module's copy of the trained target, `recspec recommend`'s
    answers for the first USERS test users (the API's equal them), their histories as raw ids, and
    the API's answer for the first without its first item (``exclude``)."""
    home = tmp_path_factory.mktemp("trained-here")
    target = Path(shutil.copytree(trained_models / "target", home / "target"))
    out = home / "recs.jsonl"
    run = run_cli("recommend", "--target", str(target), "--decoder", "tree-beam", "--k", str(K), "--users", str(USERS),
                  "--out", str(out))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    recommender = Recommender.load(target)
    examples = recommender.examples("test", USERS)
    histories = [[recommender.dataset.item_ids[item] for item in examples.history_of(i)] for i in range(USERS)]
    model = recspec.load(target, decoder="tree-beam", device="cpu")
    assert_same(answers(model.recommend(histories, k=K)), answers(rows))
    excluded = model.recommend(histories[:1], k=K, exclude=rows[0]["items"][:1])
    data = Path(shutil.copytree(asset_dir("ml-100k"), home / "ml-100k-copy"))  # what --dataset is given later
    return {"target": target, "rows": rows, "histories": histories, "excluded": answers(excluded), "data": data}


@pytest.fixture(scope="module")
def moved(before: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target moved to another folder, as to a serving machine."""
    return Path(shutil.move(before["target"], tmp_path_factory.mktemp("serving-machine") / "model"))


@pytest.fixture
def no_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty asset cache for this process and those it starts: MovieLens-100K cannot be read."""
    monkeypatch.setenv("RECSPEC_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(RecspecError):
        load_dataset("ml-100k")


def one_line(err: pytest.ExceptionInfo[RecspecError], *needles: str) -> None:
    message = str(err.value)
    assert "\n" not in message and all(needle in message for needle in needles), (needles, message)


def test_the_folder_keeps_and_lists_what_serving_needs(moved: Path) -> None:
    """serving.json (the data set's item ids in order, sample users' histories) is listed with the
    run files; the item ids are the data set's own, in its order."""
    assert sorted(read_json(moved / CHECKSUMS)["files"]) == [INDEX_FILE, RUN_FILE, SERVING_FILE]
    serving = read_json(moved / SERVING_FILE)
    assert serving["item_ids"] == load_dataset("ml-100k").item_ids
    assert [len(serving["histories"][part]) for part in ("valid", "test")] == [256, 256]


def test_recommend_for_users_takes_the_data_set_given(before: dict, moved: Path, no_data: None,
                                                      tmp_path: Path) -> None:
    """`recspec recommend` needs the users' histories: with --dataset (a copy of the data) it
    answers as before; without, one line says to pass --dataset."""
    out = tmp_path / "recs.jsonl"
    run = run_cli("recommend", "--target", str(moved), "--dataset", str(before["data"]), "--decoder", "tree-beam",
                  "--k", str(K), "--users", str(USERS), "--out", str(out))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["user"] for row in rows] == [row["user"] for row in before["rows"]]
    assert_same(answers(rows), answers(before["rows"]))
    refused = run_cli("recommend", "--target", str(moved), "--k", str(K), "--users", "2", "--out",
                      str(tmp_path / "none.jsonl"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "cannot be read here" in refused.stderr and "--dataset" in refused.stderr
    assert not (tmp_path / "none.jsonl").exists()


def test_the_python_api_serves_from_the_folder(before: dict, moved: Path, no_data: None) -> None:
    """``recspec.load(folder).recommend(histories)``: the same answers; ``exclude`` and unknown ids
    are checked against the folder's items; --draft items, fitted on the data, says what it needs."""
    model = recspec.load(moved, decoder="tree-beam", device="cpu")
    assert model.service.recommender.dataset is None
    assert_same(answers(model.recommend(before["histories"], k=K)), answers(before["rows"]))
    first = before["rows"][0]["items"]
    assert_same(answers(model.recommend(before["histories"][:1], k=K, exclude=first[:1])), before["excluded"])
    with pytest.raises(RecspecError) as err:
        model.recommend([["no-such-item"]], k=K)
    one_line(err, "unknown item id(s) no-such-item")
    with pytest.raises(RecspecError) as err:
        recspec.load(moved, draft="items", decoder="spec-strict", device="cpu")
    one_line(err, "cannot be read here", "--draft items", "--dataset")


def test_serve_answers_from_the_folder(before: dict, moved: Path, no_data: None) -> None:
    """`recspec serve` with its default decoder auto, whose choices it makes before it is ready on
    the users the folder keeps: every decoder's answer is the one before the move."""
    with server(moved, "--max-batch", "2") as (url, _):
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["items"] == 1682
        for history, row in zip(before["histories"][:4], before["rows"]):
            for decoder in (None, "tree-beam", "beam"):
                got = httpx.post(f"{url}/v1/recommend", json={"history": history, "k": K, "decoder": decoder},
                                 timeout=120)
                assert got.status_code == 200, got.text
                assert_same(answers([got.json()]), answers([row]))
        unknown = httpx.post(f"{url}/v1/recommend", json={"history": ["no-such-item"], "k": K})
        assert unknown.status_code == 422 and unknown.json()["error"]["code"] == "unknown_items"


def test_the_drop_in_decodes_over_the_folder(before: dict, moved: Path, no_data: None) -> None:
    """transformers' generate with ``custom_generate=trie_beam_search(folder's index, tokenizer)``
    over the prompts of the raw histories: the items and log-probabilities of before."""
    recommender = Recommender.load(moved, folder_only=True)
    service = RecommendService(recommender, "tree-beam")
    prompts = [service.parse(RecommendRequest(history=history, k=K)).prompt for history in before["histories"]]
    batch = left_pad(prompts, recommender.encoder.pad_id, torch.device("cpu"))
    trie, width = recommender.trie, batch.input_ids.shape[1]
    out = recommender.model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                     custom_generate=trie_beam_search(moved / INDEX_FILE, recommender.tokenizer),
                                     num_beams=K, num_return_sequences=K, max_new_tokens=trie.depth, do_sample=False,
                                     pad_token_id=recommender.encoder.pad_id, output_scores=True,
                                     return_dict_in_generate=True)
    rows = trie.items(trie.walk(out.sequences[:, width:])).view(USERS, K).tolist()
    scores = (out.sequences_scores * trie.depth).view(USERS, K).tolist()  # log-probabilities (length penalty 1)
    keys = recommender.index.item_keys
    assert_same([([keys[row] for row in items], values) for items, values in zip(rows, scores)],
                answers(before["rows"]))


def test_an_earlier_folder_loads_with_its_data_and_the_upgrade_makes_it_self_contained(
        before: dict, trained_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder without serving.json (removed, and from the listing): with its data set it loads
    and answers as before; without, one line names `recspec upgrade`; the upgrade writes the same
    serving.json from the data set and lists it, and the folder then serves without the data."""
    legacy = Path(shutil.copytree(trained_models / "target", tmp_path / "legacy"))
    kept = (legacy / SERVING_FILE).read_bytes()
    (legacy / SERVING_FILE).unlink()
    listing = read_json(legacy / CHECKSUMS)
    del listing["files"][SERVING_FILE]
    write_json_atomic(legacy / CHECKSUMS, listing)
    model = recspec.load(legacy, decoder="tree-beam", device="cpu")
    assert model.service.recommender.dataset is not None  # read from the data set, as before
    assert_same(answers(model.recommend(before["histories"], k=K)), answers(before["rows"]))
    monkeypatch.setenv("RECSPEC_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(RecspecError) as err:
        recspec.load(legacy, device="cpu")
    one_line(err, "cannot be read here", f"run `recspec upgrade {legacy}`")
    refused = run_cli("upgrade", str(legacy / BEST_DIR))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "cannot be read here" in refused.stderr and not (legacy / SERVING_FILE).exists()
    monkeypatch.undo()
    upgraded = run_cli("upgrade", str(legacy / BEST_DIR))
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.strip() == f"listed {SERVING_FILE} in {legacy / CHECKSUMS}"
    assert (legacy / SERVING_FILE).read_bytes() == kept
    assert sorted(read_json(legacy / CHECKSUMS)["files"]) == [INDEX_FILE, RUN_FILE, SERVING_FILE]
    again = run_cli("upgrade", str(legacy))
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr
    served = Path(shutil.move(legacy, tmp_path / "moved"))
    monkeypatch.setenv("RECSPEC_CACHE", str(tmp_path / "empty-cache"))
    model = recspec.load(served, decoder="tree-beam", device="cpu")
    assert model.service.recommender.dataset is None
    assert_same(answers(model.recommend(before["histories"], k=K)), answers(before["rows"]))
