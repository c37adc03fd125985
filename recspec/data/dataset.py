"""The in-memory dataset: interactions as parallel arrays plus item and user side information.

Users and items are dense 0-based indices; ``Dataset.user_ids`` / ``Dataset.item_ids`` map them
back to the raw identifiers of the source files (strings), which is also how item identifiers
(``item_index.json``) are keyed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recspec.errors import RecspecError

SPLIT_TRAIN, SPLIT_VALID, SPLIT_TEST = 0, 1, 2
SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Interactions:
    """Parallel arrays, one entry per interaction.

    users, items: int64 [n], dense indices.
    timestamps: int64 [n]; for formats without real times (the released Beauty files) an ordinal
        time consistent with the chronological order of the source.
    ratings: float32 [n] or None.
    """

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    ratings: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.users)
        arrays = [self.items, self.timestamps] + ([self.ratings] if self.ratings is not None else [])
        if any(len(a) != n for a in arrays):
            raise ValueError("interaction arrays must have the same length")

    def __len__(self) -> int:
        return len(self.users)


@dataclass(frozen=True)
class ItemInfo:
    """Item side information, indexed by dense item index; any field may be missing (None)."""

    titles: list[str] | None = None
    years: list[str] | None = None
    genres: list[list[str]] | None = None

    def text(self, item: int) -> str:
        """The item's text for embedding: 'Title (Year); genres: A, B' with missing parts left out."""
        parts = []
        if self.titles is not None:
            title = self.titles[item]
            if self.years is not None and self.years[item]:
                title = f"{title} ({self.years[item]})"
            parts.append(title)
        if self.genres is not None and self.genres[item]:
            parts.append("genres: " + ", ".join(self.genres[item]))
        return "; ".join(parts)


@dataclass(frozen=True)
class UserInfo:
    """User side information, indexed by dense user index; any field may be missing (None)."""

    ages: list[int] | None = None
    genders: list[str] | None = None
    occupations: list[str] | None = None


@dataclass(frozen=True)
class Dataset:
    """A named dataset: interactions, raw ids, side information and, where the source fixes one, its split.

    given_split: int8 [n] (0 train, 1 valid, 2 test) for sources released already split (Beauty).
    item_index_path: the dataset's own item identifiers (``item_index.json``) where it ships them.
    """

    name: str
    source_format: str
    interactions: Interactions
    user_ids: list[str]
    item_ids: list[str]
    item_info: ItemInfo | None = None
    user_info: UserInfo | None = None
    given_split: np.ndarray | None = None
    item_index_path: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    @property
    def density(self) -> float:
        return len(self.interactions) / max(1, self.num_users * self.num_items)

    def select(self, keep: np.ndarray, note: str) -> Dataset:
        """The data set of the interactions where ``keep`` (bool ``[n]``) holds, users and items
        without any left dropped (dense indices renumbered in order, side information and the
        given split kept), ``note`` added to its notes."""
        inter = self.interactions
        users, user_map = np.unique(inter.users[keep], return_inverse=True)
        items, item_map = np.unique(inter.items[keep], return_inverse=True)

        def pick(values: list | None, index: np.ndarray) -> list | None:
            return None if values is None else [values[i] for i in index]

        info, uinfo = self.item_info, self.user_info
        return Dataset(
            name=self.name, source_format=self.source_format,
            interactions=Interactions(users=user_map.astype(np.int64), items=item_map.astype(np.int64),
                                      timestamps=inter.timestamps[keep],
                                      ratings=None if inter.ratings is None else inter.ratings[keep]),
            user_ids=[self.user_ids[u] for u in users], item_ids=[self.item_ids[i] for i in items],
            item_info=None if info is None else ItemInfo(pick(info.titles, items), pick(info.years, items),
                                                         pick(info.genres, items)),
            user_info=None if uinfo is None else UserInfo(pick(uinfo.ages, users), pick(uinfo.genders, users),
                                                          pick(uinfo.occupations, users)),
            given_split=None if self.given_split is None else self.given_split[keep],
            item_index_path=self.item_index_path,
            notes=self.notes + [note],
        )

    def user_positions(self, raw_ids: list[str]) -> np.ndarray:
        """int64 [len(raw_ids)]: dense indices of raw user ids; unknown ids raise an error naming them."""
        lookup = {u: i for i, u in enumerate(self.user_ids)}
        unknown = [u for u in raw_ids if u not in lookup]
        if unknown:
            raise RecspecError(f"dataset {self.name}: unknown user id(s) {', '.join(unknown[:5])}"
                               + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
        return np.array([lookup[u] for u in raw_ids], dtype=np.int64)

    def item_texts(self) -> list[str]:
        """One text per item (dense order); raises if the dataset carries no item text."""
        if self.item_info is None or self.item_info.titles is None:
            raise RecspecError(
                f"dataset {self.name} has no item text; identifiers need item titles (see README, Datasets)"
            )
        return [self.item_info.text(i) for i in range(self.num_items)]
