"""Atomic file and directory writes, checksums, and output-directory rules.

Nothing recspec writes is ever half-written: files go to a temporary name in the same folder
and are renamed into place; output directories are assembled under a temporary name and
renamed as a whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recspec.errors import RecspecError


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (UTF-8)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def read_json(path: Path) -> Any:
    """Read a JSON file; a missing or malformed file raises a :class:`RecspecError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise RecspecError(f"{path}: file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RecspecError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from None


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse to write into an existing, non-empty directory unless ``overwrite`` is set."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise RecspecError(f"{path}: already exists; choose another --out or pass --overwrite")


@contextlib.contextmanager
def atomic_dir(path: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` as a whole when the block succeeds.

    An existing ``path`` is refused unless ``overwrite`` is set, in which case it is replaced
    only after the new contents are complete.
    """
    path = Path(path)
    check_output_dir(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
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
