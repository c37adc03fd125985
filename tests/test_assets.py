"""The asset cache: fetch from a local wheel, manifest checksums, damage detection, clear errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
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


@pytest.fixture(scope="session")
def recbole_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real ``recbole==1.2.1`` wheel (2 MB) from the package index, downloaded once."""
    into = tmp_path_factory.mktemp("wheel")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                             "-d", str(into), "recbole==1.2.1"], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pytest.skip(f"the package index cannot be reached here ({result.stderr.strip()[-200:]}); CI reaches it")
    return wheels[0]


def _copy_with(wheel: Path, into: Path, change: dict[str, bytes]) -> Path:
    """A copy of ``wheel`` with the members of ``change`` replaced (a repacked, altered wheel)."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(into, "w") as out:
        for item in source.infolist():
            out.writestr(item, change.get(item.filename, source.read(item.filename)))
    return into


def test_fetch_from_wheel_writes_manifest(tmp_cache: Path, recbole_wheel: Path) -> None:
    folder = assets.fetch("ml-100k", wheel=recbole_wheel, progress=lambda _: None)
    assert folder == tmp_cache / "ml-100k"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"ml-100k.inter", "ml-100k.item", "ml-100k.user"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(folder / name)
        assert entry["sha256"] == assets.ASSETS["ml-100k"].sources[f"recbole/dataset_example/ml-100k/{name}"]
    assert assets.require("ml-100k") == folder
    assert [r["status"].split()[0] for r in assets.list_assets()] == ["ok", "not"]
    # no temporary folders left behind
    assert sorted(p.name for p in tmp_cache.iterdir()) == ["ml-100k"]


def test_only_the_pinned_wheel_is_accepted(tmp_cache: Path, tmp_path: Path, recbole_wheel: Path) -> None:
    from tests.test_cli import recspec

    member = "recbole/dataset_example/ml-100k/ml-100k.item"
    with zipfile.ZipFile(recbole_wheel) as archive:
        original = archive.read(member)
    altered = bytearray(original)
    altered[100] ^= 0x01  # one bit of one data file
    repacked = _copy_with(recbole_wheel, tmp_path / "recbole-1.2.1-py3-none-any.whl", {member: bytes(altered)})
    pinned = assets.ASSETS["ml-100k"].wheel_sha256
    with pytest.raises(RecspecError, match=rf"not the recbole==1.2.1 wheel recspec pins \(sha256 "
                                           rf"{sha256_file(repacked)}, expected {pinned}\); pass the original"):
        assets.fetch("ml-100k", wheel=repacked, progress=lambda _: None)
    flipped = tmp_path / "flipped.whl"  # the real wheel with one byte changed
    data = bytearray(recbole_wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    other = tmp_path / "other.whl"  # a valid zip holding the right data file, but not the pinned wheel
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr(member, original)
    for wrong in (flipped, other):
        with pytest.raises(RecspecError, match="recspec pins"):
            assets.fetch("ml-100k", wheel=wrong, progress=lambda _: None)
        result = recspec("assets", "fetch", "ml-100k", "--wheel", str(wrong), env={"RECSPEC_CACHE": str(tmp_cache)})
        assert result.returncode == 2 and result.stdout == "", result.stdout
        assert result.stderr.strip().splitlines() == [
            f"error: {wrong}: not the recbole==1.2.1 wheel recspec pins (sha256 {sha256_file(wrong)}, expected "
            f"{pinned}); pass the original recbole==1.2.1 wheel from pypi.org, or leave out --wheel to download it"]
    assert not tmp_cache.exists()  # refused before anything was extracted or installed
    assets.fetch("ml-100k", wheel=recbole_wheel, progress=lambda _: None)
    with pytest.raises(RecspecError, match="recspec pins"):  # offered with the cache intact: refused all the same
        assets.fetch("ml-100k", wheel=other, progress=lambda _: None)


def test_a_download_that_is_not_the_pinned_wheel_is_refused(tmp_cache: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """pip, pointed at a local folder that holds another ``recbole-1.2.1`` wheel, downloads it; fetch
    refuses it before extracting anything."""
    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / "recbole-1.2.1-py3-none-any.whl", "w") as archive:
        archive.writestr("recbole-1.2.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: recbole\nVersion: 1.2.1\n")
        archive.writestr("recbole-1.2.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                          "Tag: py3-none-any\n")
        archive.writestr("recbole-1.2.1.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(RecspecError, match=r"recbole-1.2.1-py3-none-any.whl: not the recbole==1.2.1 wheel recspec "
                                           r"pins .*the package index served other bytes"):
        assets.fetch("ml-100k", progress=lambda _: None)
    assert not tmp_cache.exists()


def test_same_size_edit_with_mtime_restored_is_detected(tmp_cache: Path, recbole_wheel: Path) -> None:
    folder = assets.fetch("ml-100k", wheel=recbole_wheel, progress=lambda _: None)
    stamp_file = folder / assets.STAMP
    assets.require("ml-100k")
    assert not stamp_file.exists()  # files changed within RACY_NS are not stamped: re-hashed next time too
    newest = max(path.stat().st_ctime_ns for path in folder.glob("ml-100k.*"))
    time.sleep(max(0.0, (newest + assets.RACY_NS - time.time_ns()) / 1e9) + 0.05)
    assets.require("ml-100k")  # now the stamp lets the next check skip re-hashing
    target = folder / "ml-100k.inter"
    stat = target.stat()
    assert json.loads(stamp_file.read_text())["ml-100k.inter"] == [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns,
                                                                    stat.st_ino]
    data = bytearray(target.read_bytes())
    data[-3] = ord("9") if data[-3] != ord("9") else ord("8")  # another digit: same size
    target.write_bytes(bytes(data))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert target.stat().st_mtime_ns == stat.st_mtime_ns and target.stat().st_size == stat.st_size
    assert target.stat().st_ino == stat.st_ino
    with pytest.raises(RecspecError) as raised:
        assets.require("ml-100k")
    assert str(raised.value) == (f"{target}: checksum mismatch (corrupted cache file); "
                                 f"run `recspec assets fetch ml-100k --force`")


def test_damaged_manifest_or_stamp(tmp_cache: Path, recbole_wheel: Path) -> None:
    """A damaged manifest is a one-line error saying to fetch again; a damaged or unwritable stamp
    only costs a re-hash."""
    folder = assets.fetch("ml-100k", wheel=recbole_wheel, progress=lambda _: None)
    stamp_file = folder / assets.STAMP
    for garbage in ("{not json", "[1, 2]"):
        stamp_file.write_text(garbage)
        assert assets.require("ml-100k") == folder
    stamp_file.unlink()
    stamp_file.mkdir()  # a stamp that cannot be written (as a read-only cache)
    assert assets.require("ml-100k") == folder
    target = folder / "ml-100k.item"
    target.write_bytes(target.read_bytes().replace(b"Heat", b"Hean", 1))
    with pytest.raises(RecspecError, match="ml-100k.item: checksum mismatch"):
        assets.require("ml-100k")
    manifest = folder / assets.MANIFEST
    for garbage in ("{not json", '{"files": {"ml-100k.item": {"sha256": 1}}}', "[]"):
        manifest.write_text(garbage)
        with pytest.raises(RecspecError) as raised:
            assets.require("ml-100k")
        assert str(raised.value) == (f"{manifest}: damaged (not a recspec asset manifest); "
                                     f"run `recspec assets fetch ml-100k --force`")
    assert "damaged" in assets.list_assets()[0]["status"]


def test_assets_verify_rehashes_everything(tmp_cache: Path, recbole_wheel: Path) -> None:
    from tests.test_cli import recspec

    env = {"RECSPEC_CACHE": str(tmp_cache)}
    folder = assets.fetch("ml-100k", wheel=recbole_wheel, progress=lambda _: None)
    result = recspec("assets", "verify", env=env)
    assert result.returncode == 0 and result.stdout.split() == ["ml-100k", "ok"], result.stderr
    # an edit that the quick check could only see through the stamp: forge the stamp, verify still finds it
    target = folder / "ml-100k.user"
    target.write_bytes(target.read_bytes().replace(b"technician", b"tech1ician", 1))
    stat = target.stat()
    (folder / ".verified.json").write_text(json.dumps({"ml-100k.user": [stat.st_size, stat.st_mtime_ns,
                                                                         stat.st_ctime_ns, stat.st_ino]}))
    assets.require("ml-100k")  # the quick check trusts the (forged) stamp
    result = recspec("assets", "verify", "ml-100k", env=env)
    assert result.returncode == 2 and "ml-100k.user: checksum mismatch" in result.stdout
    assert result.stderr.strip().splitlines() == ["error: damaged or missing: ml-100k; run `recspec assets fetch "
                                                  "NAME --force`"]
    result = recspec("assets", "verify", "smollm2", env=env)
    assert result.returncode == 2 and "smollm2  asset smollm2 is not in the cache" in result.stdout


def test_missing_asset_says_what_to_fetch(tmp_cache: Path) -> None:
    with pytest.raises(RecspecError, match=r"run `recspec assets fetch smollm2`"):
        assets.require("smollm2")
    from recspec.data import load_dataset

    with pytest.raises(RecspecError, match=r"recspec assets fetch ml-100k"):
        load_dataset("ml-100k")


def test_corrupted_file_is_detected_and_refetched(tmp_cache: Path, recbole_wheel: Path) -> None:
    folder = assets.fetch("ml-100k", wheel=recbole_wheel, progress=lambda _: None)
    target = folder / "ml-100k.item"
    target.write_text(target.read_text(encoding="utf-8").replace("Heat", "Hean"), encoding="utf-8")  # same size
    with pytest.raises(RecspecError, match=r"ml-100k.item: checksum mismatch .*--force"):
        assets.require("ml-100k")
    messages: list[str] = []
    assets.fetch("ml-100k", wheel=recbole_wheel, progress=messages.append)
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
    with pytest.raises(RecspecError, match="recspec pins"):
        assets.fetch("ml-100k", wheel=bogus, progress=lambda _: None)
    empty = tmp_path / "empty.whl"
    zipfile.ZipFile(empty, "w").close()
    with pytest.raises(RecspecError, match="recspec pins"):
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


def test_embedding_cache_records_are_checked(tmp_path: Path) -> None:
    """``read_cached`` trusts only a plain float32 array that matches its record (size, sha256, shape,
    dtype) and has the expected rows and finite values; never a pickle."""
    import numpy as np

    from recspec.itemids.embed import read_cached, write_cached

    cache_file = tmp_path / "embeddings" / "key.npy"
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_cached(cache_file, array)
    record = json.loads(cache_file.with_suffix(".json").read_text())
    assert record == {"sha256": sha256_file(cache_file), "size": cache_file.stat().st_size, "shape": [3, 4],
                      "dtype": "float32"}
    assert np.array_equal(read_cached(cache_file, 3), array)
    assert read_cached(cache_file, 4) is None  # rows != number of texts
    assert read_cached(tmp_path / "embeddings" / "absent.npy", 3) is None

    def recorded(data: bytes, **change: object) -> Path:
        """``data`` in ``cache_file`` with a record that matches it (then ``change`` applied)."""
        cache_file.write_bytes(data)
        entry = {**record, "sha256": sha256_file(cache_file), "size": len(data), **change}
        cache_file.with_suffix(".json").write_text(json.dumps(entry))
        return cache_file

    def npy(value: np.ndarray, allow_pickle: bool = False) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=allow_pickle)
        return buffer.getvalue()

    assert np.array_equal(read_cached(recorded(npy(array)), 3), array)
    assert read_cached(recorded(npy(array), shape=[3, 5]), 3) is None
    assert read_cached(recorded(npy(array), size=len(npy(array)) + 1), 3) is None
    assert read_cached(recorded(npy(array.astype(np.float64)), dtype="float64"), 3) is None
    assert read_cached(recorded(npy(np.full((3, 4), np.nan, dtype=np.float32))), 3) is None
    assert read_cached(recorded(npy(array[:, 0])), 3) is None  # one dimension
    assert read_cached(recorded(bytes(len(npy(array)))), 3) is None  # zeroed, with a matching record
    pickled = npy(np.array([{"x": 1}, None, 3], dtype=object), allow_pickle=True)
    assert read_cached(recorded(pickled, shape=[3]), 3) is None  # refused, not unpickled
    cache_file.with_suffix(".json").unlink()
    cache_file.write_bytes(npy(array))
    assert read_cached(cache_file, 3) is None  # no record: not trusted


@pytest.mark.slow
def test_damaged_embedding_caches_are_rebuilt_not_used(smollm2_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The real SmolLM2 asset, by name, under a cache that links to it: a truncated, a zeroed and a
    same-size-altered cache file, and one with no record, are each rebuilt and overwritten."""
    import numpy as np

    from recspec.itemids.embed import embed_texts

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "smollm2").symlink_to(smollm2_dir, target_is_directory=True)
    monkeypatch.setenv("RECSPEC_CACHE", str(cache))
    texts = ["Heat (1995); genres: Action", "Toy Story (1995)", "Alien (1979); genres: Horror, Sci-Fi"]
    fresh = embed_texts(texts, "smollm2", use_cache=True, progress=False)  # embedded, then cached
    assert fresh.shape == (3, 576)
    (cache_file,) = (cache / "embeddings").glob("*.npy")
    assert np.array_equal(embed_texts(texts, "smollm2", progress=False), fresh)  # read back intact

    def truncate(data: bytes) -> bytes:
        return data[: len(data) // 2]

    def zero(data: bytes) -> bytes:
        return bytes(len(data))

    def alter(data: bytes) -> bytes:  # same size: the last float's bytes flipped
        return data[:-4] + bytes(b ^ 0xFF for b in data[-4:])

    for damage in (truncate, zero, alter):
        cache_file.write_bytes(damage(cache_file.read_bytes()))
        again = embed_texts(texts, "smollm2", progress=False)
        assert np.allclose(again, fresh, atol=1e-5), damage.__name__
        assert np.array_equal(np.load(cache_file, allow_pickle=False), again), damage.__name__  # rebuilt on disk
    cache_file.with_suffix(".json").unlink()  # an array with no record is not trusted either
    cache_file.write_bytes(zero(cache_file.read_bytes()))
    assert np.allclose(embed_texts(texts, "smollm2", progress=False), fresh, atol=1e-5)
    assert cache_file.with_suffix(".json").is_file()  # rebuilt with its record, then read back intact
    assert np.array_equal(np.load(cache_file, allow_pickle=False), embed_texts(texts, "smollm2", progress=False))
