"""Building item identifiers for a dataset, and loading released ones, with their statistics.

``build_identifiers``: item text -> embeddings (mean-pooled LLM states) -> residual quantisation
(RQ-KMeans or RQ-VAE) -> collision resolution -> :class:`ItemIndex` plus a stats dictionary
(collision rates before and after, code usage per level, timings). ``load_released`` reads an
identifier file such as Beauty's ``item_index.json`` as it is and resolves its collisions the
same way (without distances: the lowest free last-level codes).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.data.dataset import Dataset
from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, write_json_atomic
from recspec.itemids.collisions import (
    RESOLUTIONS,
    collision_groups,
    collision_rate,
    resolve_append,
    resolve_reassign,
)
from recspec.itemids.embed import embed_texts
from recspec.itemids.index import ItemIndex
from recspec.itemids.quantize import Quantization, rq_kmeans, rq_vae

METHODS = ("rqkmeans", "rqvae")
_CODE = re.compile(r"^<[a-z]_(\d+)>$")


def default_codebook_sizes(num_items: int, levels: int = 3) -> list[int]:
    """Codebook sizes for ``num_items``: the smallest power of two from 16 to 256 whose
    ``levels - 1``-th power is at least half the number of items, so that a prefix of the first
    levels holds about two items on average and the last level has room to separate colliding
    items: 3 x 32 for the 1,682 MovieLens movies, 3 x 128 for 12,035 items."""
    size = 16
    while size < 256 and size ** (levels - 1) < num_items / 2:
        size *= 2
    return [size] * levels


def _collision_stats(codes: np.ndarray) -> dict[str, Any]:
    groups = collision_groups(codes)
    return {"rate": collision_rate(codes), "groups": len(groups), "items": int(sum(len(g) for g in groups)),
            "largest_group": int(max((len(g) for g in groups), default=1))}


def _code_usage(codes: np.ndarray, sizes: Sequence[int]) -> list[float]:
    return [len(np.unique(codes[:, level])) / size for level, size in enumerate(sizes)]


def resolve(codes: np.ndarray, sizes: Sequence[int], how: str,
            costs: np.ndarray | None = None) -> tuple[np.ndarray, list[int], dict[str, Any]]:
    """Resolve collisions of per-level ``codes`` (int [n, L]); returns codes, sizes and stats."""
    if how not in RESOLUTIONS:
        raise RecspecError(f"unknown collision resolution {how!r}; choose one of {', '.join(RESOLUTIONS)}")
    before = _collision_stats(codes)
    moved: list[int] = []
    if how == "reassign":
        codes, moved = resolve_reassign(codes, sizes[-1], costs)
        sizes = list(sizes)
    else:
        codes = resolve_append(codes)
        sizes = list(sizes) + [int(codes[:, -1].max()) + 1]
    stats = {"resolution": how, "collisions_before": before, "collisions_after": _collision_stats(codes),
             "moved_items": len(moved), "code_usage": _code_usage(codes, sizes), "codebook_sizes": sizes}
    return codes, moved, stats


def build_identifiers(dataset: Dataset, method: str = "rqkmeans", codebook_sizes: Sequence[int] | None = None,
                      collisions: str = "reassign", embedder: str | Path = "smollm2", seed: int = 0,
                      device: str | torch.device = "cpu", progress: bool = True) -> tuple[ItemIndex, dict[str, Any]]:
    """Semantic identifiers for every item of ``dataset`` from its item text."""
    if method not in METHODS:
        raise RecspecError(f"unknown quantisation method {method!r}; choose one of {', '.join(METHODS)}")
    sizes = list(codebook_sizes) if codebook_sizes else default_codebook_sizes(dataset.num_items)
    if any(s < 2 for s in sizes) or max(sizes) > dataset.num_items:
        raise RecspecError(f"codebook sizes must be between 2 and the number of items "
                           f"({dataset.num_items}), got {sizes}")
    texts = dataset.item_texts()
    started = time.perf_counter()
    embeddings = embed_texts(texts, embedder, device=device, progress=progress)
    embedded = time.perf_counter()
    quantization: Quantization
    if method == "rqkmeans":
        quantization = rq_kmeans(embeddings, sizes, seed=seed)
    else:
        quantization = rq_vae(embeddings, sizes, seed=seed, device=device, progress=progress)
    quantized = time.perf_counter()
    codes, _, stats = resolve(quantization.codes, sizes, collisions, quantization.last_level_costs())
    finished = time.perf_counter()
    index = ItemIndex.from_codes(dataset.item_ids, codes)
    stats = {
        "dataset": dataset.name, "method": method, "embedder": str(embedder), "seed": seed,
        "num_items": len(index), "length": index.length, "vocabulary": len(index.tokens),
        "embedding_dim": int(embeddings.shape[1]), "code_usage_before": quantization.code_usage(), **stats,
        "seconds": {"embed": embedded - started, "quantize": quantized - embedded,
                    "resolve": finished - quantized, "total": finished - started},
    }
    return index, stats


def level_codes(index: ItemIndex) -> tuple[np.ndarray, list[int]]:
    """Per-level integer codes of a loaded index (int [n, L]) and each level's codebook size.

    Tokens named ``<x_K>`` give code K; other names get their rank among the level's tokens.
    """
    columns, sizes = [], []
    for level in range(index.length):
        tokens = [ident[level] for ident in index.identifiers]
        if all(_CODE.match(t) for t in tokens):
            column = np.array([int(_CODE.match(t).group(1)) for t in tokens], dtype=np.int64)
        else:
            _, column = np.unique(np.array(tokens), return_inverse=True)
        columns.append(column.reshape(-1))
        sizes.append(int(column.max()) + 1)
    return np.stack(columns, axis=1), sizes


def load_released(path: str | Path, collisions: str = "reassign") -> tuple[ItemIndex, dict[str, Any]]:
    """A released identifier file, with its collisions resolved; stats name every moved item."""
    index = ItemIndex.load(path)
    codes, sizes = level_codes(index)
    resolved, moved, stats = resolve(codes, sizes, collisions)
    fixed = ItemIndex.from_codes(index.item_keys, resolved)
    changes = {index.item_keys[m]: {"from": list(index.identifiers[m]), "to": list(fixed.identifiers[m])}
               for m in moved}
    stats = {"source": str(index.source), "num_items": len(fixed), "length": fixed.length,
             "vocabulary": len(fixed.tokens), **stats, "changes": changes}
    return ItemIndex(fixed.item_keys, fixed.identifiers, source=index.source), stats


def load_index(path: str | Path) -> tuple[ItemIndex, dict[str, dict[str, list[str]]]]:
    """An identifier file (or a folder holding ``item_index.json``) as recspec uses it: as it is,
    or with its collisions resolved (:func:`load_released`) where it has any; and the items that
    resolution moved (raw id -> ``{"from": tokens, "to": tokens}``)."""
    index = ItemIndex.load(path)
    if not collision_groups(index.codes):
        return index, {}
    resolved, stats = load_released(path)
    return resolved, stats["changes"]


def write_identifiers(out: Path, index: ItemIndex, stats: dict[str, Any], overwrite: bool = False) -> None:
    """Write ``out/item_index.json`` and ``out/stats.json`` atomically (the folder appears complete or not at all)."""
    with atomic_dir(out, overwrite=overwrite) as staging:
        index.save(staging / "item_index.json")
        write_json_atomic(staging / "stats.json", stats)


def dataset_identifiers(dataset: Dataset, ids: str | Path | None = None) -> ItemIndex:
    """The identifiers to use with ``dataset``: ``ids`` (a folder or item_index.json) or the dataset's own.

    Every item of the dataset must have an identifier.
    """
    if ids is None:
        if dataset.item_index_path is None:
            raise RecspecError(f"dataset {dataset.name} ships no identifiers; build them with `recspec ids build` "
                               f"and pass --ids")
        index, _ = load_released(dataset.item_index_path)
    else:
        index, _ = load_index(ids)
    index.positions(dataset.item_ids)  # raises on items without identifiers
    return index
