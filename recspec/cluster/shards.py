"""Sharded job output: one file per shard, each committed atomically with its checksum.

A :class:`ShardFolder` is the state of a job spread over workers: ``manifest.json`` (the settings
that determine the output and the number of shards, written once when the folder is made) and,
per finished shard ``i``, ``shard-0000i.jsonl`` plus ``shard-0000i.json`` (its sha256 and line
count), both written atomically, the record last. A shard is done when its record exists and its
file still has that checksum; a re-run with the same settings redoes only the others, so a job
killed at any moment resumes with nothing lost or written twice. A folder written with other
settings is refused (or, asked to overwrite, replaced). :meth:`ShardFolder.merge` writes the
shards in order as one file, checking each checksum on the way.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from recspec.errors import RecspecError
from recspec.fileio import read_json, write_json_atomic, write_text_atomic

MANIFEST = "manifest.json"
FORMAT = "recspec-shards/1"


class ShardFolder:
    """The shards of one job under ``folder`` (module doc)."""

    def __init__(self, folder: Path, settings: dict[str, Any], count: int, overwrite: bool = False) -> None:
        """Open or create ``folder`` for ``count`` shards of a job with ``settings`` (JSON data);
        an existing folder of other settings is an error, or removed with ``overwrite``."""
        self.folder, self.count = Path(folder), count
        manifest = {"format": FORMAT, "settings": settings, "shards": count}
        path = self.folder / MANIFEST
        if path.is_file() and read_json(path) != manifest:
            if not overwrite:
                raise RecspecError(f"{self.folder}: holds shards of a job with other settings (model, decoder, "
                                   f"users, ...); pass --overwrite to start over, or use another --out")
            shutil.rmtree(self.folder)
        elif self.folder.exists() and not path.is_file():
            if any(self.folder.iterdir()):
                raise RecspecError(f"{self.folder}: exists and is not a shard folder of recspec; remove it or use "
                                   f"another --out")
        if not path.is_file():
            write_json_atomic(path, manifest)

    def file(self, shard: int) -> Path:
        return self.folder / f"shard-{shard:05d}.jsonl"

    def record(self, shard: int) -> Path:
        return self.folder / f"shard-{shard:05d}.json"

    def committed(self, shard: int) -> str | None:
        """The lines of ``shard`` if it was committed and its file still has the recorded
        checksum, else None."""
        record, file = self.record(shard), self.file(shard)
        if not (record.is_file() and file.is_file()):
            return None
        data = file.read_bytes()
        return data.decode("utf-8") if read_json(record).get("sha256") == hashlib.sha256(data).hexdigest() else None

    def todo(self) -> list[int]:
        """The shards not done yet, in order."""
        return [shard for shard in range(self.count) if self.committed(shard) is None]

    def commit(self, shard: int, text: str) -> None:
        """Write ``shard``'s lines (its file, then its record), each atomically."""
        if not 0 <= shard < self.count:
            raise RecspecError(f"shard {shard} is outside the job's {self.count} shards")
        write_text_atomic(self.file(shard), text)
        write_json_atomic(self.record(shard), {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                                               "lines": text.count("\n")})

    def merge(self, out: Path) -> int:
        """Write every shard, in order, as the one file ``out`` (atomically); the line count.
        A shard missing or changed since it was committed is an error."""
        parts = [self.committed(shard) for shard in range(self.count)]
        missing = [shard for shard, part in enumerate(parts) if part is None]
        if missing:
            raise RecspecError(f"{self.file(missing[0])}: missing or changed since it was written; run the job "
                               f"again to redo it")
        text = "".join(parts)
        write_text_atomic(Path(out), text)
        return text.count("\n")
