"""Plain-text summaries of data sets and splits for the command line."""

from __future__ import annotations

import numpy as np

from recspec.data.dataset import Dataset
from recspec.data.splits import SplitData


def describe(dataset: Dataset, split: SplitData) -> str:
    """Users, items, interactions, density, split sizes and example counts."""
    inter = dataset.interactions
    per_user = np.bincount(inter.users, minlength=dataset.num_users)
    lines = [
        f"dataset       {dataset.name} ({dataset.source_format})",
        f"users         {dataset.num_users:,}",
        f"items         {dataset.num_items:,}",
        f"interactions  {len(inter):,}",
        f"density       {dataset.density:.4%}",
        f"per user      median {np.median(per_user):.0f}, max {per_user.max()}",
        f"ratings       {'yes' if inter.ratings is not None else 'no'}",
        f"item text     {'yes' if dataset.item_info is not None and dataset.item_info.titles else 'no'}",
        f"split         {split.kind} (history capped at {split.max_history})",
    ]
    for name, size in split.sizes().items():
        lines.append(f"  {name:<6}      {size:,} interactions ({size / max(1, len(inter)):.1%})")
    for name, examples in (("train", split.train), ("valid", split.valid), ("test", split.test)):
        extra = f", {split.dropped[name]} cold-start users left out" if name in split.dropped else ""
        targets = len(examples.target_items)
        lines.append(f"  {name} examples {len(examples):,} ({targets:,} targets{extra})")
    lines.extend(f"note: {n}" for n in dataset.notes)
    return "\n".join(lines)
