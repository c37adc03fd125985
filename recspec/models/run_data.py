"""The data a trained model folder was made on, and what of it the folder keeps for itself.

A model folder records the data set, split and history cap it was trained with (``run.json``,
:mod:`recspec.models.checkpoint`). Recommending for that data set's users reads the data set
(:func:`run_dataset`, :func:`run_split`); answering raw histories does not: ``serving.json``
beside ``run.json`` keeps what serving needs of the data (:class:`ServingData`), so that a folder
copied to a machine without the data set serves alike. It holds the data set's item ids in the
order of its dense item rows (the rows a prompt encoder maps to identifiers, and the ids a history
may hold) and the histories of the first :data:`SAMPLE_USERS` validation and test users (what
``auto`` and calibration measure on). It is written by ``recspec train`` and ``recspec import``,
and by ``recspec upgrade`` for folders of earlier versions, and listed in the training folder's
``checksums.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recspec.data import Dataset, Examples, SplitData, load_dataset, split_dataset
from recspec.data.loaders import keep_items
from recspec.data.splits import PAD_ITEM
from recspec.errors import RecspecError
from recspec.fileio import read_json, write_json_atomic
from recspec.itemids.index import ItemIndex

SERVING_FILE = "serving.json"
#: Validation and test users whose histories ``serving.json`` keeps: more than ``auto`` measures
#: acceptance on (128) or times candidates on (32).
SAMPLE_USERS = 256
#: The evaluation parts whose first users ``serving.json`` keeps.
SAMPLE_PARTS = ("valid", "test")


def run_dataset(info: dict[str, Any], index: ItemIndex, dataset: Dataset | None = None) -> Dataset:
    """The data set a model is used with: ``dataset``, else the one of its run ``info``; for a
    model trained elsewhere (``only_indexed_items`` in its run info, :mod:`recspec.importer`)
    without the interactions of the items its index lacks (:func:`~recspec.data.loaders.keep_items`)."""
    if dataset is None:
        dataset = load_dataset(info["dataset"], info.get("format"))
    return keep_items(dataset, index.item_keys) if info.get("only_indexed_items") else dataset


def recorded_dataset(info: dict[str, Any], index: ItemIndex, remedy: str) -> Dataset:
    """The data set of run ``info`` (:func:`run_dataset`), where it is wanted (``remedy``: what to
    do instead, ending the one-line error when it cannot be read here)."""
    try:
        return run_dataset(info, index)
    except RecspecError as err:
        raise RecspecError(f"the data set this model was trained on cannot be read here ({err}); {remedy}") from None


def run_split(dataset: Dataset, info: dict[str, Any]) -> SplitData:
    """``dataset`` split as the model of run ``info`` was trained: its split kind and history cap."""
    return split_dataset(dataset, info.get("split"), info.get("max_history", 20))


@dataclass(frozen=True)
class ServingData:
    """What ``serving.json`` holds (module doc): ``item_ids``, the raw id of each dense item row
    of the data set; ``histories``, per evaluation part, the first users' histories as raw ids,
    oldest first (cut to the history cap, as the split cuts them)."""

    item_ids: list[str]
    histories: dict[str, list[list[str]]]

    @classmethod
    def from_split(cls, dataset: Dataset, split: SplitData) -> ServingData:
        """The serving data of ``dataset`` under ``split`` (the one the model is trained with)."""
        histories = {}
        for part in SAMPLE_PARTS:
            examples = getattr(split, part)
            histories[part] = [[dataset.item_ids[item] for item in examples.history_of(i).tolist()]
                               for i in range(min(SAMPLE_USERS, len(examples)))]
        return cls(list(dataset.item_ids), histories)

    def save(self, folder: Path) -> None:
        """Write ``folder/serving.json`` atomically (compact: the item list may be long)."""
        write_json_atomic(Path(folder) / SERVING_FILE, {"item_ids": self.item_ids, "histories": self.histories},
                          indent=None)

    @classmethod
    def load(cls, folder: Path) -> ServingData:
        """``folder/serving.json`` (checked against the folder's listing by the caller), its shape
        checked: a malformed one is a one-line error naming it."""
        path = Path(folder) / SERVING_FILE
        data = read_json(path)
        items = data.get("item_ids") if isinstance(data, dict) else None
        histories = data.get("histories") if isinstance(data, dict) else None
        if not _strings(items) or len(set(items)) != len(items) or not isinstance(histories, dict) \
                or sorted(histories) != sorted(SAMPLE_PARTS) \
                or not all(isinstance(rows, list) and all(_strings(row) for row in rows) for rows in histories.values()):
            raise RecspecError(f"{path}: not recspec's serving data (a list of distinct item ids and the histories of "
                               f"{' and '.join(SAMPLE_PARTS)} users); train the model again or restore it from a copy")
        known = set(items)
        unknown = next((key for rows in histories.values() for row in rows for key in row if key not in known), None)
        if unknown is not None:
            raise RecspecError(f"{path}: a sample history holds item {unknown!r}, which its item ids lack; train the "
                               f"model again or restore it from a copy")
        return cls(items, histories)

    @property
    def valid(self) -> Examples:
        """The kept validation users' histories as examples (no targets)."""
        return self._examples("valid")

    @property
    def test(self) -> Examples:
        """The kept test users' histories as examples (no targets)."""
        return self._examples("test")

    def _examples(self, part: str) -> Examples:
        """The kept histories of ``part`` as examples over the dense item rows of :attr:`item_ids`
        (users numbered from 0, no targets): prompts for measuring, not users to evaluate."""
        rows = {key: i for i, key in enumerate(self.item_ids)}
        histories = self.histories[part]
        width = max((len(history) for history in histories), default=1)
        matrix = np.full((len(histories), width), PAD_ITEM, dtype=np.int64)
        for i, history in enumerate(histories):  # once per kept user
            matrix[i, width - len(history):] = [rows[key] for key in history]
        return Examples(np.arange(len(histories), dtype=np.int64), matrix, np.zeros(len(histories) + 1, dtype=np.int64),
                        np.zeros(0, dtype=np.int64))


def _strings(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(value, str) for value in values)
