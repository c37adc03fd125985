"""Knowledge-generation prompts: ask an LLM for a short user or item profile (the kind of text
LLM-enhanced recommenders feed downstream), built from a data set's interactions and side
information. Used by the text sampling decoders (``recspec generate``) and their benchmark."""

from __future__ import annotations

import numpy as np

from recspec.data.dataset import Dataset
from recspec.errors import RecspecError

KINDS = ("users", "items")


def profile_prompts(dataset: Dataset, kind: str, count: int, history: int = 10, seed: int = 0) -> list[str]:
    """``count`` profile requests as plain user messages: for ``users``, a random user's last
    ``history`` rated items (titles, ratings, and age / gender / occupation where known); for
    ``items``, a random item's title and genres. Seeded, so the same call gives the same prompts."""
    if kind not in KINDS:
        raise RecspecError(f"unknown profile kind {kind!r}; choose users or items")
    info = dataset.item_info
    if info is None or info.titles is None:
        raise RecspecError(f"dataset {dataset.name} has no item titles to build profile prompts from")
    rng = np.random.default_rng(seed)
    if kind == "items":
        return [f"Write a short profile of the movie \"{info.text(int(item))}\" for a recommender system: who would "
                f"enjoy it and why, in two or three sentences."
                for item in rng.choice(dataset.num_items, size=min(count, dataset.num_items), replace=False)]
    inter = dataset.interactions
    prompts = []
    for user in rng.choice(dataset.num_users, size=min(count, dataset.num_users), replace=False):
        rows = np.flatnonzero(inter.users == user)
        rows = rows[np.argsort(inter.timestamps[rows], kind="stable")][-history:]
        seen = "; ".join(info.titles[int(inter.items[r])] + ("" if inter.ratings is None else
                                                              f" ({inter.ratings[r]:.0f}/5)") for r in rows)
        about = ""
        users = dataset.user_info
        if users is not None and users.ages is not None:
            about = f" The user is a {users.ages[user]}-year-old {users.genders[user]} {users.occupations[user]}."
        prompts.append(f"A user recently rated these movies: {seen}.{about} Describe this user's movie taste in a "
                       f"short profile of two or three sentences.")
    return prompts
