"""Atomic file and directory writes, checksums, output-path rules and strict JSON.

Nothing recspec writes is ever half-written: files go to a temporary name in the same folder
and are renamed into place; output directories are assembled under a temporary name and
renamed as a whole. Files and folders get the modes the umask allows (``tempfile`` would leave
them 0600 / 0700), or, for a ``private`` folder, the owner's bits alone. Folders recspec writes
(model folders) carry ``checksums.json``, the sha256 of every file (or of the files named), checked
when the folder is loaded; a reader names the files that must be listed, so that a listing cut
short (or emptied) is refused rather than trusted for what it leaves out. JSON is read strictly
(a duplicate key is an error naming the line) and written strictly (never a bare ``NaN``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import math
import re
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from recspec.errors import RecspecError

CHECKSUMS = "checksums.json"
_UMASK_LOCK = threading.Lock()


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def umask_mode(directory: bool) -> int:
    """The mode a new file (0666) or folder (0777) gets under the process umask."""
    with _UMASK_LOCK:  # reading the umask means setting it; keep other threads out meanwhile
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.
    The file ends with the mode the umask gives new files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, umask_mode(directory=False))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (UTF-8)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by ``None``: what strict JSON can hold."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite_json(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(value) for value in obj]
    return obj


def dumps_strict(obj: Any, indent: int | None = None) -> str:
    """JSON text of ``obj``; a non-finite float is a ``ValueError`` (bare ``NaN`` is not JSON)."""
    return json.dumps(obj, indent=indent, allow_nan=False)


def write_json_atomic(path: Path, obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically; non-finite floats are written as ``null``."""
    write_text_atomic(path, dumps_strict(finite_json(obj), indent=indent) + "\n")


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def loads_unique(text: str, source: str) -> Any:
    """Parse JSON ``text`` (read from ``source``), refusing malformed text and duplicate object
    keys (which ``json`` would silently resolve to the last) with a one-line error naming the line."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as err:
        raise RecspecError(f"{source}: line {err.lineno}: malformed JSON ({err.msg})") from None
    except _DuplicateKey as err:
        found = list(re.finditer(re.escape(json.dumps(err.key)) + r"\s*:", text))
        line = text.count("\n", 0, found[1].start()) + 1 if len(found) > 1 else "?"
        raise RecspecError(f"{source}: line {line}: duplicate key {err.key!r}; keep one entry per key") from None


def read_json(path: Path) -> Any:
    """Read a JSON file; a missing or malformed file, or one with a duplicate key, raises a
    :class:`RecspecError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise RecspecError(f"{path}: file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecspecError(f"{path}: not UTF-8 text; the file is damaged") from None
    return loads_unique(text, str(path))


def _existing_ancestor(path: Path) -> Path:
    for folder in (path, *path.parents):
        if folder.exists():
            return folder
    return Path(".")


def check_writable_dir(path: Path) -> None:
    """Refuse a folder recspec is to write into when it cannot be created or written, before any
    work: a file in the way, or a folder where files cannot be made (read-only, no permission)."""
    path = Path(path)
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise RecspecError(f"{path}: {base} is a file, not a folder; choose another output path")
    try:  # the real test: root passes every permission check, a read-only mount fails this
        fd, probe = tempfile.mkstemp(prefix=".recspec-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise RecspecError(f"{path}: cannot write in {base} ({err.strerror}); choose another output path") from None


def check_output_file(path: Path, overwrite: bool = False) -> None:
    """Refuse an output file before any work: a folder, an existing file (unless ``overwrite``),
    or a place where it cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise RecspecError(f"{path}: is a folder; --out takes a file name")
    if path.exists() and not overwrite:
        raise RecspecError(f"{path}: already exists; choose another --out or pass --overwrite")
    check_writable_dir(path.parent)


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse an output folder before any work: an existing file, an existing non-empty folder
    (unless ``overwrite``), or a place where it cannot be created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RecspecError(f"{path}: is a file; --out takes a folder")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise RecspecError(f"{path}: already exists; choose another --out or pass --overwrite")
    check_writable_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(path: Path, overwrite: bool = False, private: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` as a whole when the block succeeds,
    every file and folder in it given the mode the umask gives new ones.

    An existing ``path`` is refused unless ``overwrite`` is set, in which case it is replaced
    only after the new contents are complete. ``private``: the folder stays closed to everyone but
    the owner (0700) while it is filled and keeps only the owner's bits of those modes, whatever
    the umask: for code that is to be loaded, which no one else may alter on its way.
    """
    path = Path(path)
    check_output_dir(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    keep = 0o700 if private else 0o777
    os.chmod(tmp, umask_mode(directory=True) & keep)
    try:
        yield tmp
        for inner in tmp.rglob("*"):  # writers that keep files private (transformers' weights) included
            if not inner.is_symlink():
                os.chmod(inner, umask_mode(directory=inner.is_dir()) & keep)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def record_checksums(folder: Path, names: Sequence[str] | None = None) -> None:
    """Write ``folder/checksums.json``: the size and sha256 of the files ``names`` (relative to
    ``folder``), or of every file below ``folder``."""
    folder = Path(folder)
    paths = sorted(folder / name for name in names) if names is not None else \
        [path for path in sorted(folder.rglob("*")) if path.is_file() and path.name != CHECKSUMS]
    files = {str(path.relative_to(folder)): {"sha256": sha256_file(path), "size": path.stat().st_size}
             for path in paths}
    write_json_atomic(folder / CHECKSUMS, {"files": files})


_VERIFIED: dict[str, tuple[int, ...]] = {}  # folder -> identity of its files when last verified


def _identity(folder: Path, names: list[str]) -> tuple[int, ...]:
    """Size, mtime, ctime and inode of each file: ctime moves on every write and every utime, and
    cannot be set back, so an unchanged identity means unchanged bytes."""
    out: list[int] = []
    for name in (CHECKSUMS, *names):
        stat = (folder / name).stat()
        out += [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    return tuple(out)


def verify_checksums(folder: Path, remedy: str, required: Iterable[str] = ()) -> None:
    """Check every file listed in ``folder/checksums.json`` (present, same size, same sha256) and
    that the listing names each of ``required`` (a listing that leaves a file out vouches for
    nothing about it); a one-line error names the first damaged or unlisted file and ends with
    ``remedy``. A folder is re-hashed only when one of its files changed since this process last
    verified it."""
    folder = Path(folder)
    listing = read_json(folder / CHECKSUMS) if (folder / CHECKSUMS).is_file() else None
    if not isinstance(listing, dict) or not isinstance(listing.get("files"), dict):
        raise RecspecError(f"{folder / CHECKSUMS}: missing or damaged; {remedy}")
    unlisted = next((name for name in required if name not in listing["files"]), None)
    if unlisted is not None:
        raise RecspecError(f"{folder / CHECKSUMS}: does not list {unlisted}, so it cannot be checked; {remedy}")
    names = sorted(listing["files"])
    for name in names:
        path = folder / name
        if not path.is_file():
            raise RecspecError(f"{path}: missing; {remedy}")
    identity = _identity(folder, names)
    key = str(folder.resolve())
    if _VERIFIED.get(key) == identity:
        return
    for name in names:
        path, entry = folder / name, listing["files"][name]
        if not isinstance(entry, dict) or path.stat().st_size != entry.get("size") \
                or sha256_file(path) != entry.get("sha256"):
            raise RecspecError(f"{path}: damaged (its sha256 differs from {CHECKSUMS}); {remedy}")
    _VERIFIED[key] = identity
