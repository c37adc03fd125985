"""Dataset loaders: MovieLens-100K (RecBole atomic files or the GroupLens originals), the
AtSpeed / LC-Rec processed Amazon format, raw Amazon review JSON lines and a generic CSV.

``load_dataset`` takes a known name (``ml-100k``, read from the asset cache) or a path; the
format of a path is detected from the files it holds, or named explicitly.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from recspec.data.dataset import Dataset, Interactions, ItemInfo, UserInfo
from recspec.errors import RecspecError
from recspec.fileio import read_json

KNOWN_DATASETS = ("ml-100k",)

GROUPLENS_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
    "Thriller", "War", "Western",
)  # fmt: skip


def _dense(raw: Sequence[str], universe: Sequence[str] | None = None) -> tuple[list[str], np.ndarray]:
    """Map raw ids to dense indices. Ids sort numerically when all are integers, else as text.

    Returns (sorted unique ids, int64 [len(raw)] indices). ``universe`` adds ids that have no
    interaction (e.g. items listed in an identifier file).
    """
    values = set(raw) | set(universe or ())
    numeric = all(v.lstrip("-").isdigit() for v in values)
    ids = sorted(values, key=int if numeric else None)
    position = {v: i for i, v in enumerate(ids)}
    return ids, np.fromiter((position[v] for v in raw), dtype=np.int64, count=len(raw))


def _open_text(path: Path, encoding: str = "utf-8"):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding=encoding)
    return open(path, encoding=encoding, newline="")


def _rows(path: Path, sep: str | None, width: int, encoding: str = "utf-8",
          header: bool = False) -> Iterator[tuple[int, list[str]]]:
    """Yield (line number, fields) of a delimited file (``sep=None``: white space), checking each
    line has at least ``width`` fields; blank lines are skipped."""
    with _open_text(path, encoding) as handle:
        for lineno, line in enumerate(handle, start=1):
            if header and lineno == 1:
                continue
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split(sep)
            if len(fields) < width:
                what = "white-space separated" if sep is None else f"separated by {sep!r}"
                raise RecspecError(f"{path}:{lineno}: expected {width} fields {what}, got {len(fields)}")
            yield lineno, fields


def _number(path: Path, lineno: int, value: object, kind: Callable[[str], float | int]) -> float | int:
    """``value`` as a finite number of ``kind``; anything else (text, ``nan``, ``inf``) is refused
    with the file and line."""
    try:
        number = kind(str(value))
    except ValueError:
        raise RecspecError(f"{path}:{lineno}: {value!r} is not a valid number") from None
    if not math.isfinite(number):
        raise RecspecError(f"{path}:{lineno}: {value!r} is not a finite number")
    return number


MAX_TIMESTAMP = 2**62  # far beyond any real time in seconds or milliseconds, well inside int64


def _timestamp(path: Path, lineno: int, value: object) -> int:
    """A timestamp (an integer, or a number truncated to one) within +-2^62; negative times (before
    1970) are fine, since only their order matters."""
    number = int(_number(path, lineno, value, float))
    if abs(number) >= MAX_TIMESTAMP:
        raise RecspecError(f"{path}:{lineno}: timestamp {value!r} is out of range")
    return number


def _id(path: Path, lineno: int, value: object, what: str) -> str:
    """A user or item id: non-empty text (an empty one would create a phantom user or item)."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise RecspecError(f"{path}:{lineno}: empty {what} id")
    return text


def _single(directory: Path, pattern: str) -> Path | None:
    found = sorted(directory.glob(pattern))
    if len(found) > 1:
        raise RecspecError(f"{directory}: several files match {pattern} ({', '.join(f.name for f in found)}); keep one")
    return found[0] if found else None


def _interactions(users: list[str], items: list[str], times: list[int], ratings: list[float] | None,
                  item_universe: Sequence[str] | None = None) -> tuple[Interactions, list[str], list[str]]:
    user_ids, u = _dense(users)
    item_ids, i = _dense(items, item_universe)
    inter = Interactions(
        users=u, items=i, timestamps=np.asarray(times, dtype=np.int64),
        ratings=None if ratings is None else np.asarray(ratings, dtype=np.float32),
    )
    return inter, user_ids, item_ids


def _check_nonempty(path: Path, inter: Interactions) -> None:
    if len(inter) == 0:
        raise RecspecError(f"{path}: no interactions found")


# --- MovieLens-100K, RecBole atomic files -------------------------------------------------------

def _atomic_table(path: Path) -> tuple[list[str], Iterator[tuple[int, list[str]]]]:
    """Header names (type suffixes stripped) and the data rows of a RecBole atomic file."""
    with open(path, encoding="utf-8") as handle:
        first = handle.readline().rstrip("\r\n")
    names = [column.split(":")[0] for column in first.split("\t")]
    return names, _rows(path, "\t", len(names), header=True)


def _column(path: Path, names: list[str], name: str) -> int:
    if name not in names:
        raise RecspecError(f"{path}:1: missing column {name!r} (have {', '.join(names)})")
    return names.index(name)


def load_recbole_atomic(directory: Path) -> Dataset:
    """MovieLens in RecBole atomic format: ``*.inter`` (+ optional ``*.item``, ``*.user``), tab-separated."""
    inter_path = _single(directory, "*.inter")
    if inter_path is None:
        raise RecspecError(f"{directory}: no .inter file")
    names, rows = _atomic_table(inter_path)
    cu, ci, ct = (_column(inter_path, names, c) for c in ("user_id", "item_id", "timestamp"))
    cr = names.index("rating") if "rating" in names else None
    users, items, times, ratings = [], [], [], []
    for lineno, f in rows:
        users.append(_id(inter_path, lineno, f[cu], "user"))
        items.append(_id(inter_path, lineno, f[ci], "item"))
        times.append(_timestamp(inter_path, lineno, f[ct]))
        if cr is not None:
            ratings.append(float(_number(inter_path, lineno, f[cr], float)))
    inter, user_ids, item_ids = _interactions(users, items, times, ratings if cr is not None else None)
    _check_nonempty(inter_path, inter)
    notes: list[str] = []
    item_info = user_info = None
    item_path = _single(directory, "*.item")
    if item_path is not None:
        names, rows = _atomic_table(item_path)
        ci = _column(item_path, names, "item_id")
        table = {_id(item_path, lineno, f[ci], "item"): f for lineno, f in rows}
        title_col = next((names.index(c) for c in ("movie_title", "title") if c in names), None)
        year_col = names.index("release_year") if "release_year" in names else None
        genre_col = next((names.index(c) for c in ("class", "genre", "genres") if c in names), None)
        missing = [i for i in item_ids if i not in table]
        if missing:
            notes.append(f"{len(missing)} items have no row in {item_path.name}; their text is empty")

        def col(c: int | None) -> list[str] | None:
            return None if c is None else [table[i][c] if i in table else "" for i in item_ids]

        genres = col(genre_col)
        item_info = ItemInfo(titles=col(title_col), years=col(year_col),
                             genres=None if genres is None else [g.split() for g in genres])
    user_path = _single(directory, "*.user")
    if user_path is not None:
        names, rows = _atomic_table(user_path)
        cu = _column(user_path, names, "user_id")
        table = {f[cu]: f for _, f in rows}

        def ucol(name: str) -> list[str] | None:
            if name not in names:
                return None
            c = names.index(name)
            return [table[u][c] if u in table else "" for u in user_ids]

        ages = ucol("age")
        user_info = UserInfo(ages=None if ages is None else [int(a) if a.isdigit() else -1 for a in ages],
                             genders=ucol("gender"), occupations=ucol("occupation"))
    return Dataset(name=directory.name, source_format="recbole", interactions=inter, user_ids=user_ids,
                   item_ids=item_ids, item_info=item_info, user_info=user_info, notes=notes)


# --- MovieLens-100K, GroupLens originals -------------------------------------------------------

_TITLE_YEAR = re.compile(r"^(.*?)\s*\((\d{4})\)\s*$")


def load_grouplens(directory: Path) -> Dataset:
    """The GroupLens ``ml-100k`` folder: ``u.data`` (tab), ``u.item`` and ``u.user`` (pipe, latin-1)."""
    data = directory / "u.data"
    users, items, times, ratings = [], [], [], []
    for lineno, f in _rows(data, "\t", 4):
        users.append(_id(data, lineno, f[0], "user"))
        items.append(_id(data, lineno, f[1], "item"))
        ratings.append(float(_number(data, lineno, f[2], float)))
        times.append(_timestamp(data, lineno, f[3]))
    inter, user_ids, item_ids = _interactions(users, items, times, ratings)
    _check_nonempty(data, inter)
    item_info = user_info = None
    genre_names = list(GROUPLENS_GENRES)
    if (directory / "u.genre").is_file():
        genre_names = [f[0] for _, f in _rows(directory / "u.genre", "|", 2, encoding="latin-1")]
    if (directory / "u.item").is_file():
        table = {_id(directory / "u.item", lineno, f[0], "item"): f
                 for lineno, f in _rows(directory / "u.item", "|", 5 + len(genre_names), encoding="latin-1")}
        titles, years, genres = [], [], []
        for item in item_ids:
            f = table.get(item)
            if f is None:
                titles.append(""), years.append(""), genres.append([])
                continue
            match = _TITLE_YEAR.match(f[1])
            titles.append(match.group(1) if match else f[1])
            years.append(match.group(2) if match else f[2][-4:])
            flags = f[5:5 + len(genre_names)]
            genres.append([g for g, flag in zip(genre_names, flags) if flag == "1"])
        item_info = ItemInfo(titles=titles, years=years, genres=genres)
    if (directory / "u.user").is_file():
        table = {_id(directory / "u.user", lineno, f[0], "user"): f
                 for lineno, f in _rows(directory / "u.user", "|", 5, encoding="latin-1")}
        rows = [table.get(u, ["", "-1", "", "", ""]) for u in user_ids]
        user_info = UserInfo(ages=[int(r[1]) for r in rows], genders=[r[2] for r in rows],
                             occupations=[r[3] for r in rows])
    return Dataset(name=directory.name, source_format="grouplens", interactions=inter, user_ids=user_ids,
                   item_ids=item_ids, item_info=item_info, user_info=user_info)


# --- AtSpeed / LC-Rec processed Amazon data -----------------------------------------------------

ATSPEED_FILES = ("sequential_train.txt", "sequential_valid.txt", "sequential_test.txt")


def load_atspeed(directory: Path) -> Dataset:
    """The processed format released with AtSpeed (``sequential_{train,valid,test}.txt`` + ``item_index.json``).

    Each line is ``USER ITEM ITEM ...`` in chronological order, both 1-based; item k is key
    ``k-1`` of ``item_index.json``, which is the raw item id used here. The files carry no
    timestamps: the loader uses ordinal times (split * 1e6 + position in the user's sequence),
    which order a user's own interactions and put train before valid before test, and keeps the
    released global-time split as ``given_split``.
    """
    index_path = directory / "item_index.json"
    universe = list(read_json(index_path).keys()) if index_path.is_file() else None
    users, items, times, labels = [], [], [], []
    offsets: dict[str, int] = {}
    for label, name in enumerate(ATSPEED_FILES):
        path = directory / name
        if not path.is_file():
            raise RecspecError(f"{path}: file not found (the AtSpeed format needs {', '.join(ATSPEED_FILES)})")
        for lineno, fields in _rows(path, None, 1):
            user = fields[0]
            for position, value in enumerate(fields[1:], start=offsets.get(user, 0)):
                number = int(_number(path, lineno, value, int))
                if number < 1:
                    raise RecspecError(f"{path}:{lineno}: item {number} is not a 1-based item number")
                users.append(user)
                items.append(str(number - 1))
                times.append(label * 1_000_000 + position)
                labels.append(label)
            offsets[user] = offsets.get(user, 0) + len(fields) - 1
    if universe is not None:
        unknown = sorted(set(items) - set(universe), key=int)
        if unknown:
            raise RecspecError(f"{directory}: items {', '.join(str(int(i) + 1) for i in unknown[:5])} of the "
                               f"sequence files are missing from {index_path.name}")
    # users with no interaction at all still appear in the files: keep them as users
    inter, user_ids, item_ids = _interactions(users, items, times, None, item_universe=universe)
    _check_nonempty(directory, inter)
    return Dataset(name=directory.name, source_format="atspeed", interactions=inter, user_ids=user_ids,
                   item_ids=item_ids, given_split=np.asarray(labels, dtype=np.int8),
                   item_index_path=str(index_path) if index_path.is_file() else None)


# --- raw Amazon review JSON lines ---------------------------------------------------------------

def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with _open_text(path) as handle:
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as err:
                    raise RecspecError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None


def load_amazon_json(path: Path) -> Dataset:
    """Raw Amazon reviews: JSON lines with reviewerID, asin, overall, unixReviewTime (plain or .gz).

    ``path`` is the review file or a folder holding one review file and optionally one
    ``meta*.json[.gz]`` file (asin, title, categories) for item text.
    """
    meta_path = None
    if path.is_dir():
        meta_path = _single(path, "meta*.json*")
        candidates = [p for p in sorted(path.glob("*.json*")) if p != meta_path]
        if len(candidates) != 1:
            raise RecspecError(f"{path}: expected exactly one review file (*.json, *.json.gz), found {len(candidates)}")
        review_path = candidates[0]
    else:
        review_path = path
    users, items, times, ratings = [], [], [], []
    for lineno, row in _json_lines(review_path):
        missing = [k for k in ("reviewerID", "asin", "unixReviewTime") if k not in row]
        if missing:
            raise RecspecError(f"{review_path}:{lineno}: missing field(s) {', '.join(missing)}")
        users.append(_id(review_path, lineno, row["reviewerID"], "user"))
        items.append(_id(review_path, lineno, row["asin"], "item"))
        times.append(_timestamp(review_path, lineno, row["unixReviewTime"]))
        ratings.append(float(_number(review_path, lineno, row.get("overall", 0.0), float)))
    inter, user_ids, item_ids = _interactions(users, items, times, ratings)
    _check_nonempty(review_path, inter)
    item_info = None
    if meta_path is not None:
        meta = {str(r.get("asin")): r for _, r in _json_lines(meta_path)}
        titles = [str(meta.get(i, {}).get("title", "")) for i in item_ids]
        genres = [[str(c) for c in _flatten(meta.get(i, {}).get("categories", []))][-3:] for i in item_ids]
        item_info = ItemInfo(titles=titles, genres=genres)
    name = review_path.name.split(".")[0]
    return Dataset(name=name, source_format="amazon-json", interactions=inter, user_ids=user_ids,
                   item_ids=item_ids, item_info=item_info)


def _flatten(value: object) -> list[object]:
    if isinstance(value, list):
        return [x for v in value for x in _flatten(v)]
    return [value]


# --- generic CSV --------------------------------------------------------------------------------

def load_csv(path: Path) -> Dataset:
    """CSV with a header ``user,item,timestamp[,rating]``; a folder may add ``items.csv`` (item,title[,year][,genres|...])."""
    items_path = None
    if path.is_dir():
        items_path = path / "items.csv" if (path / "items.csv").is_file() else None
        main = path / "interactions.csv"
        if not main.is_file():
            raise RecspecError(f"{path}: a CSV dataset folder needs interactions.csv")
        path = main
    users, items, times, ratings = [], [], [], []
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        missing = [c for c in ("user", "item", "timestamp") if c not in header]
        if missing:
            raise RecspecError(f"{path}:1: missing column(s) {', '.join(missing)} (need user,item,timestamp[,rating])")
        has_rating = "rating" in header
        for row in reader:
            lineno = reader.line_num
            if row.get("timestamp") is None or row.get("item") is None:
                raise RecspecError(f"{path}:{lineno}: too few fields")
            users.append(_id(path, lineno, row["user"], "user"))
            items.append(_id(path, lineno, row["item"], "item"))
            times.append(_timestamp(path, lineno, row["timestamp"]))
            if has_rating:
                ratings.append(float(_number(path, lineno, row["rating"], float)))
    inter, user_ids, item_ids = _interactions(users, items, times, ratings if has_rating else None)
    _check_nonempty(path, inter)
    item_info = None
    if items_path is not None:
        with open(items_path, encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            if "item" not in (reader.fieldnames or []) or "title" not in (reader.fieldnames or []):
                raise RecspecError(f"{items_path}:1: need columns item,title[,year][,genres]")
            table = {_id(items_path, reader.line_num, row["item"], "item"): row for row in reader}
        rows = [table.get(i, {}) for i in item_ids]
        item_info = ItemInfo(
            titles=[r.get("title", "") or "" for r in rows],
            years=[r.get("year", "") or "" for r in rows] if "year" in reader.fieldnames else None,
            genres=[[g for g in (r.get("genres") or "").split("|") if g] for r in rows]
            if "genres" in reader.fieldnames else None,
        )
    return Dataset(name=path.parent.name if path.name == "interactions.csv" else path.stem, source_format="csv",
                   interactions=inter, user_ids=user_ids, item_ids=item_ids, item_info=item_info)


# --- dispatch -----------------------------------------------------------------------------------

FORMATS: dict[str, Callable[[Path], Dataset]] = {
    "recbole": load_recbole_atomic,
    "grouplens": load_grouplens,
    "atspeed": load_atspeed,
    "amazon-json": load_amazon_json,
    "csv": load_csv,
}


def detect_format(path: Path) -> str:
    """Name the format of a dataset path from the files it holds."""
    if path.is_file():
        name = path.name.lower()
        if name.endswith((".json", ".json.gz", ".jsonl", ".jsonl.gz")):
            return "amazon-json"
        if name.endswith(".csv"):
            return "csv"
        raise RecspecError(f"{path}: cannot tell the dataset format from the file name; pass --format")
    if all((path / f).is_file() for f in ATSPEED_FILES):
        return "atspeed"
    if (path / "u.data").is_file():
        return "grouplens"
    if any(path.glob("*.inter")):
        return "recbole"
    if (path / "interactions.csv").is_file():
        return "csv"
    if any(path.glob("*.json*")):
        return "amazon-json"
    raise RecspecError(f"{path}: no supported dataset files found (formats: {', '.join(FORMATS)}); see README")


def kcore(dataset: Dataset, k: int) -> Dataset:
    """Keep only users and items with at least ``k`` interactions, repeatedly until stable (k-core)."""
    if k <= 1:
        return dataset
    inter = dataset.interactions
    keep = np.ones(len(inter), dtype=bool)
    while True:
        user_counts = np.bincount(inter.users[keep], minlength=dataset.num_users)
        item_counts = np.bincount(inter.items[keep], minlength=dataset.num_items)
        new_keep = keep & (user_counts[inter.users] >= k) & (item_counts[inter.items] >= k)
        if new_keep.sum() == keep.sum():
            break
        keep = new_keep
    if not keep.any():
        raise RecspecError(f"dataset {dataset.name}: nothing is left after the {k}-core filter")
    return dataset.select(keep, f"{k}-core filter kept {int(keep.sum())} of {len(inter)} interactions")


def keep_items(dataset: Dataset, item_keys: Sequence[str]) -> Dataset:
    """``dataset`` without the interactions of items outside ``item_keys`` (raw ids), for a model
    that knows only those items; unchanged when it has no other item, an error when none of its
    interactions is left."""
    keys = set(item_keys)
    known = np.fromiter((key in keys for key in dataset.item_ids), dtype=bool, count=dataset.num_items)
    if known.all():
        return dataset
    keep = known[dataset.interactions.items]
    if not keep.any():
        raise RecspecError(f"dataset {dataset.name}: none of its items is in the item index (its ids look like "
                           f"{', '.join(dataset.item_ids[:3])}; the index's like {', '.join(list(item_keys)[:3])}); "
                           f"key the index by the data set's raw item ids")
    return dataset.select(keep, f"{int((~known).sum())} of {dataset.num_items} items are not in the item index: "
                                f"they cannot be recommended, and their {int((~keep).sum())} of {len(keep)} "
                                f"interactions are left out of histories and targets")


def recorded_spec(spec: str | Path) -> str:
    """How a model folder records the data set ``spec`` it was made for: a known name as it is,
    a path made absolute (so that the folder works from any working directory)."""
    return str(spec) if str(spec) in KNOWN_DATASETS and not Path(spec).exists() else str(Path(spec).resolve())


def load_dataset(spec: str | Path, format: str | None = None, min_interactions: int = 0) -> Dataset:
    """Load a dataset by known name (``ml-100k``) or path, in a detected or named ``format``."""
    if str(spec) in KNOWN_DATASETS and not Path(spec).exists():
        from recspec.assets import require

        path = require(str(spec))
        dataset = load_recbole_atomic(path)
        dataset = Dataset(**{**dataset.__dict__, "name": str(spec)})
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise RecspecError(f"dataset {spec!r}: not a known name ({', '.join(KNOWN_DATASETS)}) and no such path")
        fmt = format or detect_format(path)
        if fmt not in FORMATS:
            raise RecspecError(f"unknown dataset format {fmt!r}; choose one of {', '.join(FORMATS)}")
        dataset = FORMATS[fmt](path)
    return kcore(dataset, min_interactions)
