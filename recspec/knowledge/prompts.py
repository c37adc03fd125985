"""KAR-style knowledge prompts for MovieLens: user preference prompts and item description prompts.

A *user prompt* describes the user (age, gender, occupation where the data has them) and lists the
movies of one part of the user's history (title, year, genres, rating out of 5), oldest first,
then asks for the user's preferences along KAR's factors (genre, directors and actors, time
period, themes, mood, acclaim). An *item prompt* names a movie (title, year, genres) and asks for
a description along the same factors. Both are wrapped in the target model's chat template with
the assistant turn opened, so the model answers directly.

Truncation rule (documented in the README): a user prompt lists at most ``max_history`` movies,
the most recent ones of the part; if the chat-formatted prompt is still longer than
``max_prompt_tokens`` tokens, the oldest listed movies are dropped one at a time until it fits.
A prompt that cannot fit (even with one movie) or has nothing to list is refused with a
:class:`~recspec.errors.RecspecError`; nothing is ever cut mid-sentence.

``PROMPT_VERSION`` names this wording; a knowledge store records it and refuses to mix texts
generated from different prompt versions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recspec.data.dataset import Dataset
from recspec.errors import RecspecError

PROMPT_VERSION = "kar-movielens-v1"
FACTORS = ("genres, directors and actors, time period and country, characters, plot and themes, "
           "mood and tone, critical acclaim and awards")
_ARTICLES = ("The", "A", "An")


def movie_title(dataset: Dataset, item: int) -> str:
    """'Title (Year)' with MovieLens' trailing article moved to the front ('Usual Suspects, The'
    becomes 'The Usual Suspects')."""
    info = dataset.item_info
    if info is None or info.titles is None:
        raise RecspecError(f"dataset {dataset.name} has no item titles; knowledge prompts need them")
    title = info.titles[item].strip()
    head, _, tail = title.rpartition(", ")
    if head and tail in _ARTICLES:
        title = f"{tail} {head}"
    year = info.years[item] if info.years is not None else ""
    return f"{title} ({year})" if year else title


def _genres(dataset: Dataset, item: int) -> str:
    info = dataset.item_info
    genres = info.genres[item] if info is not None and info.genres is not None else []
    return ", ".join(g for g in genres if g != "unknown") or "unknown genre"


def _user_description(dataset: Dataset, user: int) -> str:
    info = dataset.user_info
    if info is None:
        return "The user"
    parts = []
    if info.ages is not None and info.ages[user] > 0:
        parts.append(f"{info.ages[user]}-year-old")
    if info.genders is not None and info.genders[user] in ("M", "F"):
        parts.append({"M": "man", "F": "woman"}[info.genders[user]])
    else:
        parts.append("person")
    who = "The user is a " + " ".join(parts)
    occupation = info.occupations[user] if info.occupations is not None else ""
    if occupation and occupation not in ("other", "none"):
        who += f" working as {'an' if occupation[0] in 'aeiou' else 'a'} {occupation}"
    return who


def user_prompt_text(dataset: Dataset, user: int, interactions: Sequence[int]) -> str:
    """The user prompt for the interactions ``interactions`` (indices into
    ``dataset.interactions``, oldest first) of dense user ``user``."""
    inter = dataset.interactions
    lines = []
    for number, row in enumerate(interactions, start=1):
        item = int(inter.items[row])
        rating = f": {inter.ratings[row]:g} out of 5" if inter.ratings is not None else ""
        lines.append(f"{number}. {movie_title(dataset, item)}, {_genres(dataset, item)}{rating}")
    return (f"{_user_description(dataset, user)}. These are the movies the user watched most "
            f"recently, oldest first, with the user's ratings:\n" + "\n".join(lines) + "\n"
            f"Analyse this user's movie preferences ({FACTORS}). Base your answer on the movies "
            f"above and explain it briefly.")


def item_prompt_text(dataset: Dataset, item: int) -> str:
    """The item prompt for dense item ``item``."""
    return (f"Introduce the movie {movie_title(dataset, item)} (genres: {_genres(dataset, item)}). "
            f"Describe its {FACTORS}, production quality and soundtrack, precisely and briefly.")


def random_prompt_texts(dataset: Dataset, side: str, count: int, max_history: int = 10, seed: int = 0) -> list[str]:
    """``count`` prompts (seeded, so the same call gives the same prompts) for distinct random
    users (their last ``max_history`` interactions) or items: ``side`` is ``user`` or ``item``.
    Text prompts for the sampling decoders and their benchmark (``recspec generate``)."""
    if side not in ("user", "item"):
        raise RecspecError(f"unknown prompt side {side!r}; choose user or item")
    rng = np.random.default_rng(seed)
    if side == "item":
        return [item_prompt_text(dataset, int(item))
                for item in rng.choice(dataset.num_items, size=min(count, dataset.num_items), replace=False)]
    inter = dataset.interactions
    texts = []
    for user in rng.choice(dataset.num_users, size=min(count, dataset.num_users), replace=False):
        rows = np.flatnonzero(inter.users == user)
        rows = rows[np.argsort(inter.timestamps[rows], kind="stable")]
        texts.append(user_prompt_text(dataset, int(user), rows[-max_history:]))
    return texts


def chat_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one user turn in the tokenizer's chat template, assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecspecError(f"the tokenizer of {tokenizer.name_or_path} has no chat template; knowledge prompts need "
                           f"an instruction-tuned model with one")
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def chat_prompts(tokenizer, texts: Sequence[str]) -> list[torch.Tensor]:
    """Each of ``texts`` as :func:`chat_ids`, a 1-D int64 tensor: the text decoders' prompts."""
    return [torch.tensor(chat_ids(tokenizer, text)) for text in texts]


def user_prompt_ids(tokenizer, dataset: Dataset, user: int, interactions: np.ndarray, max_history: int,
                    max_prompt_tokens: int) -> list[int]:
    """Chat-formatted token ids of a user prompt, truncated by the module's rule (most recent
    ``max_history`` movies, then the oldest dropped until ``max_prompt_tokens`` fit)."""
    if len(interactions) == 0:
        raise RecspecError(f"user {dataset.user_ids[user]}: no movies in this part of the history; "
                           f"an empty prompt cannot be generated for")
    shown = list(interactions[-max_history:])
    while True:
        ids = chat_ids(tokenizer, user_prompt_text(dataset, user, shown))
        if len(ids) <= max_prompt_tokens:
            return ids
        if len(shown) == 1:
            raise RecspecError(f"user {dataset.user_ids[user]}: the prompt needs {len(ids)} tokens even with one "
                               f"movie, above --max-prompt-tokens {max_prompt_tokens}; raise it")
        shown = shown[1:]


def item_prompt_ids(tokenizer, dataset: Dataset, item: int, max_prompt_tokens: int) -> list[int]:
    """Chat-formatted token ids of an item prompt; refused if longer than ``max_prompt_tokens``."""
    ids = chat_ids(tokenizer, item_prompt_text(dataset, item))
    if len(ids) > max_prompt_tokens:
        raise RecspecError(f"item {dataset.item_ids[item]}: the prompt needs {len(ids)} tokens, above "
                           f"--max-prompt-tokens {max_prompt_tokens}; raise it")
    return ids
