"""The knowledge store: one SQLite file per generation job, written one request at a time.

A store holds a ``meta`` table (the settings that determine its texts: model fingerprint, prompt
version, data set and streaming split, side and part, method and verification, token budget) and
a ``knowledge`` table with one row per user or item: the generated text and token ids and how
they were produced (target calls, accepted draft tokens, retrieval seconds, wall seconds).

Crash safety: the file is created atomically with its meta table (built under a temporary name,
then renamed), and every result is inserted in its own transaction, so a crash loses at most the
request in flight; reopening the store skips the entities it already holds, so a job resumes
without duplicates. Opening a store with different settings is refused: texts from another
model, prompt version or method are never mixed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recspec.assets import MANIFEST
from recspec.decoding.text_rounds import Generation
from recspec.errors import RecspecError
from recspec.fileio import atomic_path

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE knowledge (
    entity TEXT PRIMARY KEY,
    text TEXT NOT NULL,
    tokens TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    new_tokens INTEGER NOT NULL,
    calls INTEGER NOT NULL,
    accepted INTEGER NOT NULL,
    drafted INTEGER NOT NULL,
    ceiling_tokens INTEGER NOT NULL,
    retrieval_s REAL NOT NULL,
    wall_s REAL NOT NULL,
    created TEXT NOT NULL
);
"""
COLUMNS = ("entity", "text", "tokens", "prompt_tokens", "new_tokens", "calls", "accepted", "drafted",
           "ceiling_tokens", "retrieval_s", "wall_s", "created")


def model_fingerprint(model_dir: Path) -> str:
    """A stable identity of a model folder: the sha256 of its asset manifest's file checksums, or
    of its config, tokenizer and weight file names and sizes for a plain Hugging Face folder."""
    if (model_dir / MANIFEST).is_file():
        files = json.loads((model_dir / MANIFEST).read_text(encoding="utf-8"))["files"]
        described = {name: entry["sha256"] for name, entry in files.items()}
    else:
        described = {path.name: (path.read_text(encoding="utf-8") if path.suffix == ".json" else path.stat().st_size)
                     for path in sorted(model_dir.iterdir()) if path.is_file()}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Row:
    """One stored result (the columns of the ``knowledge`` table)."""

    entity: str
    text: str
    tokens: list[int]
    prompt_tokens: int
    new_tokens: int
    calls: int
    accepted: int
    drafted: int
    ceiling_tokens: int
    retrieval_s: float
    wall_s: float
    created: str


class KnowledgeStore:
    """An open store; use as a context manager or call :meth:`close`."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        """Open ``path`` (creating it with ``settings`` if absent); refuse a store whose settings
        differ from ``settings``."""
        self.path = Path(path)
        if not self.path.exists():
            with atomic_path(self.path) as tmp, contextlib.closing(sqlite3.connect(tmp)) as fresh, fresh:
                fresh.executescript(SCHEMA)
                fresh.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in settings.items()])
        self.settings = read_settings(self.path)
        for key in sorted(set(settings) | set(self.settings)):
            if self.settings.get(key) != settings.get(key):
                raise RecspecError(f"{self.path}: written with {key}={self.settings.get(key)!r}, this job has "
                                   f"{key}={settings.get(key)!r}; knowledge of different settings is never mixed, "
                                   f"use another --out")
        self.db = sqlite3.connect(self.path)

    def __enter__(self) -> KnowledgeStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    def done(self) -> set[str]:
        return {entity for (entity,) in self.db.execute("SELECT entity FROM knowledge")}

    def add(self, results: Sequence[tuple[str, str, Generation]]) -> None:
        """Insert ``(entity, text, generation)`` results in one transaction (committed before
        returning): one request, or one batch of them."""
        created = time.strftime("%Y-%m-%dT%H:%M:%S")
        with self.db:
            self.db.executemany(f"INSERT INTO knowledge VALUES ({', '.join('?' * len(COLUMNS))})",
                                [(entity, text, json.dumps(g.tokens), g.prompt_tokens, len(g.tokens), g.calls,
                                  g.accepted, g.drafted, g.ceiling_tokens, g.retrieval_s, g.wall_s, created)
                                 for entity, text, g in results])


def read_settings(path: Path) -> dict[str, Any]:
    """The settings a store was written with; a clear error if ``path`` is not a knowledge store."""
    path = Path(path)
    if not path.is_file():
        raise RecspecError(f"{path}: no such knowledge store")
    try:
        with contextlib.closing(_read_only(path)) as db:
            return {key: json.loads(value) for key, value in db.execute("SELECT key, value FROM meta")}
    except sqlite3.DatabaseError as err:
        raise RecspecError(f"{path}: not a knowledge store ({err})") from None


def read_rows(path: Path) -> Iterator[Row]:
    """Every stored result, in insertion order."""
    read_settings(path)
    with contextlib.closing(_read_only(path)) as db:
        for values in db.execute(f"SELECT {', '.join(COLUMNS)} FROM knowledge ORDER BY rowid"):
            fields = dict(zip(COLUMNS, values))
            fields["tokens"] = json.loads(fields["tokens"])
            yield Row(**fields)


def _read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
