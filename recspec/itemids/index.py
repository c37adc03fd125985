"""The item index: each item's identifier (a fixed-length token sequence) and the token vocabulary.

Saved and loaded as ``item_index.json``, the format of the AtSpeed / LC-Rec releases:
``{"<item key>": ["<a_47>", "<b_103>", "<c_234>", "<d_99>"], ...}`` where the key is the item's
raw id and tokens are named ``<{level letter}_{code}>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from recspec.errors import RecspecError
from recspec.fileio import read_json, write_json_atomic
from recspec.itemids.trie import ItemTrie

LEVEL_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TOKEN = re.compile(r"^<([a-z])_(\d+)>$")


def token_name(level: int, code: int) -> str:
    """The identifier token of ``code`` at ``level`` (0-based): ``<a_12>``, ``<b_3>``, ..."""
    return f"<{LEVEL_LETTERS[level]}_{code}>"


def _token_sort_key(token: str) -> tuple[int, int, str]:
    match = _TOKEN.match(token)
    return (ord(match.group(1)), int(match.group(2)), "") if match else (1_000, 0, token)


@dataclass(frozen=True)
class ItemIndex:
    """Identifiers of all items: ``item_keys[i]`` is identified by ``identifiers[i]``."""

    item_keys: list[str]
    identifiers: list[tuple[str, ...]]
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.item_keys:
            raise RecspecError(f"{self.source or 'item index'}: no items")
        if len(self.item_keys) != len(self.identifiers):
            raise ValueError("item_keys and identifiers must have the same length")
        lengths = {len(i) for i in self.identifiers}
        if len(lengths) != 1 or 0 in lengths:
            raise RecspecError(f"{self.source or 'item index'}: identifiers must all have the same, non-zero "
                               f"length (found lengths {sorted(lengths)})")

    @classmethod
    def from_codes(cls, item_keys: Sequence[str], codes: np.ndarray) -> ItemIndex:
        """Name the tokens of a code matrix (int [n, L], code per level) and build the index."""
        identifiers = [tuple(token_name(level, int(c)) for level, c in enumerate(row)) for row in codes]
        return cls(list(item_keys), identifiers)

    @classmethod
    def load(cls, path: str | Path) -> ItemIndex:
        """Read ``item_index.json``; errors name the file and the offending key."""
        path = Path(path)
        if path.is_dir():
            path = path / "item_index.json"
        data = read_json(path)
        if not isinstance(data, dict):
            raise RecspecError(f"{path}: expected a JSON object mapping item ids to token lists")
        for key, tokens in data.items():
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
                raise RecspecError(f"{path}: item {key!r}: expected a non-empty list of token strings")
        return cls(list(data.keys()), [tuple(v) for v in data.values()], source=str(path))

    def save(self, path: str | Path) -> None:
        write_json_atomic(Path(path), {k: list(v) for k, v in zip(self.item_keys, self.identifiers)}, indent=None)

    def __len__(self) -> int:
        return len(self.item_keys)

    @property
    def length(self) -> int:
        """L, the number of tokens per identifier."""
        return len(self.identifiers[0])

    @cached_property
    def tokens(self) -> list[str]:
        """The identifier-token vocabulary, ordered by level and code."""
        return sorted({t for ident in self.identifiers for t in ident}, key=_token_sort_key)

    @cached_property
    def token_to_index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    @cached_property
    def codes(self) -> np.ndarray:
        """int64 [num_items, L]: position of each identifier token in ``tokens``."""
        lookup = self.token_to_index
        return np.array([[lookup[t] for t in ident] for ident in self.identifiers], dtype=np.int64)

    @cached_property
    def key_to_position(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self.item_keys)}

    def positions(self, keys: Sequence[str]) -> np.ndarray:
        """int64 [len(keys)]: index rows of raw item ids; unknown ids raise an error naming them."""
        lookup = self.key_to_position
        unknown = [k for k in keys if k not in lookup]
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise RecspecError(f"{self.source or 'item index'}: unknown item id(s) {shown}")
        return np.fromiter((lookup[k] for k in keys), dtype=np.int64, count=len(keys))

    def trie(self, token_ids: Mapping[str, int] | None = None, vocab_size: int | None = None,
             keep: np.ndarray | None = None, end_token: int | None = None) -> ItemTrie:
        """The prefix trie over all identifiers (``keep``: int64 index rows, the trie over those
        items only, still reporting index rows), with tokens mapped to ``token_ids`` (default:
        ``tokens`` order); ``end_token``: a last level closing every identifier with that id
        (an end-of-sequence token)."""
        if token_ids is None:
            ids = self.codes
            vocab_size = len(self.tokens) if vocab_size is None else vocab_size
        else:
            missing = [t for t in self.tokens if t not in token_ids]
            if missing:
                raise RecspecError(f"the vocabulary lacks identifier token(s) {', '.join(missing[:5])}")
            table = np.array([token_ids[t] for t in self.tokens], dtype=np.int64)
            ids = table[self.codes]
            vocab_size = int(table.max()) + 1 if vocab_size is None else vocab_size
        if end_token is not None:
            ids = np.concatenate((ids, np.full((len(ids), 1), end_token, dtype=np.int64)), axis=1)
        rows = None if keep is None else np.asarray(keep, dtype=np.int64)
        try:
            return ItemTrie(torch.as_tensor(ids if rows is None else ids[rows]), vocab_size,
                            None if rows is None else torch.from_numpy(rows))
        except ValueError as err:  # duplicate identifiers, ids outside the vocabulary
            raise RecspecError(f"{self.source or 'item index'}: {err}; resolve collisions with "
                               f"`recspec ids show` / load_released") from None
