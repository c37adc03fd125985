"""A listing covers what it vouches for: a model folder's ``checksums.json`` must name every file that
decides the model's answers (weights, config, tokenizer, ``recspec.json``), and a training folder's
must name its ``run.json``, ``item_index.json`` and ``serving.json``; a listing emptied or cut short
is refused in one line, and so is a folder written before recspec listed its run files, until
``recspec upgrade`` lists them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from recspec.errors import RecspecError
from recspec.fileio import CHECKSUMS, read_json, write_json_atomic
from recspec.itemids.index import ItemIndex
from recspec.models.checkpoint import (BEST_DIR, INDEX_FILE, RUN_FILE, WEIGHTS_FILE, run_info, trained_model_dir,
                                       upgrade_run_dir, write_run_info)
from recspec.models.run_data import SERVING_FILE
from recspec.recommend import Recommender
from tests.test_cli import recspec

pytestmark = pytest.mark.usefixtures("one_thread")


def one_line(err: pytest.ExceptionInfo[RecspecError], *needles: str) -> str:
    """The refusal's message: one line holding every needle."""
    message = str(err.value)
    assert "\n" not in message and all(needle in message for needle in needles), (needles, message)
    return message


def unlist(folder: Path, name: str) -> None:
    """Rewrite ``folder``'s listing without ``name`` (a listing cut short, the rest still true)."""
    listing = read_json(folder / CHECKSUMS)
    del listing["files"][name]
    write_json_atomic(folder / CHECKSUMS, listing)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- run files, without a model

def small_index() -> ItemIndex:
    return ItemIndex.from_codes([f"item{i}" for i in range(8)], np.stack([np.arange(8) // 4, np.arange(8) % 4], 1))


def test_write_run_info_lists_the_run_files(tmp_path: Path) -> None:
    """``write_run_info`` lists exactly ``run.json`` and ``item_index.json`` beside them; ``run_info``
    checks them, so an edited history cap, an edited index or a listing without one is refused."""
    write_run_info(tmp_path, small_index(), {"split": "loo", "max_history": 20})
    assert sorted(read_json(tmp_path / CHECKSUMS)["files"]) == [INDEX_FILE, RUN_FILE]
    assert run_info(tmp_path) == (tmp_path, {"split": "loo", "max_history": 20})
    assert run_info(tmp_path / BEST_DIR)[0] == tmp_path  # from best/, whether or not it exists yet
    written = (tmp_path / RUN_FILE).read_text()
    (tmp_path / RUN_FILE).write_text(written.replace("20", "5"))
    with pytest.raises(RecspecError) as err:
        run_info(tmp_path)
    one_line(err, f"{tmp_path / RUN_FILE}: damaged", "restore it from a copy")
    (tmp_path / RUN_FILE).write_text(written)
    assert run_info(tmp_path)[1]["max_history"] == 20
    unlist(tmp_path, RUN_FILE)
    with pytest.raises(RecspecError) as err:
        run_info(tmp_path)
    one_line(err, f"{tmp_path / CHECKSUMS}: does not list {RUN_FILE}", "restore it from a copy")


def test_run_files_without_a_listing_name_the_upgrade(tmp_path: Path) -> None:
    write_run_info(tmp_path, small_index(), {"split": "loo"})
    (tmp_path / CHECKSUMS).unlink()
    with pytest.raises(RecspecError) as err:
        run_info(tmp_path)
    one_line(err, str(tmp_path), f"run `recspec upgrade {tmp_path}`")


# ---------------------------------------------------------------- trained model folders

@pytest.fixture
def run(trained_models: Path, tmp_path: Path) -> Path:
    """This test's own copy of the trained target (a training folder: best/, checkpoint/, run files)."""
    return Path(shutil.copytree(trained_models / "target", tmp_path / "run"))


@pytest.mark.slow
def test_trained_folders_list_what_decides_the_answers(run: Path) -> None:
    """A folder `recspec train` writes: the model folder lists its weights, config, tokenizer and
    recspec.json, and the training folder lists exactly its run files; it loads."""
    listed = read_json(run / BEST_DIR / CHECKSUMS)["files"]
    assert {"config.json", WEIGHTS_FILE, "recspec.json", "tokenizer.json", "tokenizer_config.json"} <= set(listed)
    assert sorted(read_json(run / CHECKSUMS)["files"]) == [INDEX_FILE, RUN_FILE, SERVING_FILE]
    assert Recommender.load(run).folder == run / BEST_DIR


@pytest.mark.slow
def test_an_empty_listing_vouches_for_nothing(run: Path) -> None:
    """An emptied listing beside flipped weight bytes: refused, naming the listing and the file it
    leaves out, not loaded."""
    flip_byte(run / BEST_DIR / WEIGHTS_FILE)
    write_json_atomic(run / BEST_DIR / CHECKSUMS, {"files": {}})
    with pytest.raises(RecspecError) as err:
        Recommender.load(run)
    one_line(err, f"{run / BEST_DIR / CHECKSUMS}: does not list config.json", "train it again")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.json", WEIGHTS_FILE, "recspec.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_listing_that_omits_a_model_file_is_refused(run: Path, name: str) -> None:
    unlist(run / BEST_DIR, name)
    with pytest.raises(RecspecError) as err:
        trained_model_dir(run)
    one_line(err, f"{run / BEST_DIR / CHECKSUMS}: does not list {name}", "restore it from a copy")


@pytest.mark.slow
def test_an_edited_run_file_is_refused(run: Path) -> None:
    """run.json with another history cap (which would change every prompt silently): refused in one
    line by `recspec recommend`, before any model is loaded."""
    info = read_json(run / RUN_FILE)
    (run / RUN_FILE).write_text(json.dumps({**info, "max_history": 3}))
    result = recspec("recommend", "--target", str(run), "--k", "5", "--users", "2", "--out", str(run / "recs.jsonl"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {run / RUN_FILE}: damaged") and not (run / "recs.jsonl").exists()


@pytest.mark.slow
def test_an_earlier_folder_is_refused_until_upgraded(run: Path) -> None:
    """A training folder without its run listing (written by an earlier recspec): one line naming
    `recspec upgrade`; the upgrade checks the model and lists the run files, and the folder loads;
    a second upgrade finds nothing to do."""
    (run / CHECKSUMS).unlink()
    out = run / "recs.jsonl"
    refused = recspec("recommend", "--target", str(run), "--k", "5", "--users", "2", "--out", str(out))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"run `recspec upgrade {run}` once" in refused.stderr and not out.exists()
    upgraded = recspec("upgrade", str(run / BEST_DIR))
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.strip() == f"listed {INDEX_FILE}, {RUN_FILE}, {SERVING_FILE} in {run / CHECKSUMS}"
    assert sorted(read_json(run / CHECKSUMS)["files"]) == [INDEX_FILE, RUN_FILE, SERVING_FILE]
    assert Recommender.load(run).folder == run / BEST_DIR
    again = recspec("upgrade", str(run))
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr


@pytest.mark.slow
def test_the_upgrade_lists_nothing_it_cannot_vouch_for(run: Path) -> None:
    """The upgrade refuses an earlier folder whose model is damaged, or whose item index is not the
    model's, and writes no listing; a folder with a listing has it checked, never rewritten, so an
    edited run file stays refused."""
    (run / CHECKSUMS).unlink()
    flip_byte(run / BEST_DIR / WEIGHTS_FILE)
    with pytest.raises(RecspecError) as err:
        upgrade_run_dir(run)
    one_line(err, f"{run / BEST_DIR / WEIGHTS_FILE}: damaged")
    flip_byte(run / BEST_DIR / WEIGHTS_FILE)  # the weights as they were
    index = ItemIndex.load(run / INDEX_FILE)
    ItemIndex(index.item_keys, index.identifiers[::-1]).save(run / INDEX_FILE)
    with pytest.raises(RecspecError) as err:
        upgrade_run_dir(run)
    one_line(err, "trained for another item index")
    assert not (run / CHECKSUMS).exists()
    index.save(run / INDEX_FILE)
    assert upgrade_run_dir(run) == (run / CHECKSUMS, (INDEX_FILE, RUN_FILE, SERVING_FILE))
    (run / RUN_FILE).write_text(json.dumps({**read_json(run / RUN_FILE), "split": "random"}))
    with pytest.raises(RecspecError) as err:
        upgrade_run_dir(run)
    one_line(err, f"{run / RUN_FILE}: damaged")
