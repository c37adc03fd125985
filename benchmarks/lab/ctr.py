"""The downstream check: CTR prediction on MovieLens with and without generated knowledge
(laser.txt Table 2).

Samples: every interaction of the users under test, labelled 1 when rated 4 or 5; the users'
history interactions (old and new parts) train the model, their *future* interactions (the
stream split's held-out tail, never shown to the LLM) test it. Features: user id, age band,
gender, occupation; item id and genres; the user's previous ``history`` items (DIN attention over
them, keyed by the target item); and, when given, *knowledge vectors*: the target LLM's
mean-pooled last hidden states of the user's knowledge text (new part) and of the item's
(earlier knowledge for existing items, new knowledge for new items), each mapped to ``dim`` by
a small adaptor as in KAR. A zero vector stands for a missing text.

The model is DIN-style (Zhou et al. 2018): embeddings, an activation unit (MLP over the
history item, the target item, their difference and product) weighting the history items, and an
MLP over everything concatenated. Trained with Adam on binary cross-entropy for a fixed number of
epochs; AUC and log loss on the test samples, mean over ``seeds``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import log_loss, roc_auc_score
from torch import nn

from recspec.bench.report import markdown_table, write_results
from recspec.data.dataset import Dataset
from recspec.data.splits import PAD_ITEM, history_windows
from recspec.errors import RecspecError
from recspec.knowledge.router import age_band
from recspec.knowledge.stream import StreamSplit

POSITIVE_RATING = 4.0


@dataclass(frozen=True)
class CtrSamples:
    """``n`` samples: int64 ``users``, ``items`` ``[n]``, ``history`` ``[n, H]`` (previous items,
    most recent last, left-padded with ``PAD_ITEM``), float32 ``labels`` ``[n]``."""

    users: np.ndarray
    items: np.ndarray
    history: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.users)

    def subset(self, keep: np.ndarray) -> CtrSamples:
        return CtrSamples(self.users[keep], self.items[keep], self.history[keep], self.labels[keep])


def ctr_samples(dataset: Dataset, split: StreamSplit, users: Sequence[int], history: int = 10
                ) -> tuple[CtrSamples, CtrSamples]:
    """(train, test) samples of ``users``: their history interactions and their future ones, each
    with the up to ``history`` items the user interacted with before it."""
    inter = dataset.interactions
    if inter.ratings is None:
        raise RecspecError(f"dataset {dataset.name} has no ratings; the CTR check labels ratings >= 4")
    blocks = [(split.history(u), split.future[u]) for u in users]
    rows = np.concatenate([np.concatenate(block) for block in blocks]).astype(np.int64)
    sizes = np.array([len(past) + len(ahead) for past, ahead in blocks])
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)  # where each row's user block begins
    future = np.concatenate([np.arange(len(past) + len(ahead)) >= len(past) for past, ahead in blocks])
    items = inter.items[rows].astype(np.int64)
    samples = CtrSamples(users=inter.users[rows].astype(np.int64), items=items,
                         history=history_windows(items, np.arange(len(rows)), starts, history),
                         labels=(inter.ratings[rows] >= POSITIVE_RATING).astype(np.float32))
    train, test = samples.subset(~future), samples.subset(future)
    if len(test) == 0 or len(set(test.labels.tolist())) < 2:
        raise RecspecError("the CTR test samples need both positive and negative labels; use more users")
    return train, test


@dataclass(frozen=True)
class SideFeatures:
    """Categorical side information as dense codes: per user ``age``, ``gender``, ``occupation``
    (int64 ``[U]``) and per item ``genres`` (float32 multi-hot ``[I, G]``)."""

    age: np.ndarray
    gender: np.ndarray
    occupation: np.ndarray
    genres: np.ndarray

    @staticmethod
    def of(dataset: Dataset) -> SideFeatures:
        def codes(values: Sequence[str] | None, count: int) -> np.ndarray:
            values = list(values) if values is not None else [""] * count
            vocabulary = {v: i for i, v in enumerate(sorted(set(values)))}
            return np.array([vocabulary[v] for v in values], dtype=np.int64)

        info, items = dataset.user_info, dataset.item_info
        ages = [age_band(a) for a in info.ages] if info is not None and info.ages is not None else None
        genre_lists = items.genres if items is not None and items.genres is not None else [[]] * dataset.num_items
        names = sorted({g for genres in genre_lists for g in genres}) or [""]
        multi_hot = np.zeros((dataset.num_items, len(names)), dtype=np.float32)
        for item, genres in enumerate(genre_lists):
            multi_hot[item, [names.index(g) for g in genres]] = 1.0
        return SideFeatures(age=codes(ages, dataset.num_users),
                            gender=codes(info.genders if info is not None else None, dataset.num_users),
                            occupation=codes(info.occupations if info is not None else None, dataset.num_users),
                            genres=multi_hot)


class DIN(nn.Module):
    """DIN-style CTR model over ids, side features, the attended history and knowledge vectors."""

    def __init__(self, num_users: int, num_items: int, side: SideFeatures, knowledge_dim: int, dim: int = 16) -> None:
        super().__init__()
        self.pad = num_items
        self.user = nn.Embedding(num_users, dim)
        self.item = nn.Embedding(num_items + 1, dim, padding_idx=num_items)
        self.age = nn.Embedding(int(side.age.max()) + 1, dim)
        self.gender = nn.Embedding(int(side.gender.max()) + 1, dim)
        self.occupation = nn.Embedding(int(side.occupation.max()) + 1, dim)
        self.genre = nn.Linear(side.genres.shape[1], dim, bias=False)
        self.attention = nn.Sequential(nn.Linear(4 * dim, 36), nn.PReLU(), nn.Linear(36, 1))
        self.adaptors = nn.ModuleList([nn.Sequential(nn.Linear(knowledge_dim, dim), nn.PReLU()) for _ in range(2)]
                                      if knowledge_dim else [])
        width = dim * (7 + len(self.adaptors))
        self.mlp = nn.Sequential(nn.Linear(width, 200), nn.PReLU(), nn.Linear(200, 80), nn.PReLU(), nn.Linear(80, 1))

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``[B]`` from a batch of ``users``, ``items``, ``history`` ``[B, H]`` (pad id for
        none), ``age``, ``gender``, ``occupation``, ``genres`` ``[B, G]`` and, with knowledge,
        ``user_knowledge`` / ``item_knowledge`` ``[B, K]``."""
        target = self.item(batch["items"])  # [B, D]
        past = self.item(batch["history"])  # [B, H, D]
        keys = target[:, None].expand_as(past)
        weights = self.attention(torch.cat((past, keys, past - keys, past * keys), dim=-1))  # [B, H, 1]
        weights = weights * (batch["history"] != self.pad)[..., None]
        interest = (weights * past).sum(1)
        parts = [self.user(batch["users"]), target, self.genre(batch["genres"]), interest, self.age(batch["age"]),
                 self.gender(batch["gender"]), self.occupation(batch["occupation"])]
        if self.adaptors:
            parts += [self.adaptors[0](batch["user_knowledge"]), self.adaptors[1](batch["item_knowledge"])]
        return self.mlp(torch.cat(parts, dim=1))[:, 0]


def _batch(samples: CtrSamples, rows: np.ndarray, side: SideFeatures, pad: int,
           knowledge: tuple[np.ndarray, np.ndarray] | None) -> dict[str, torch.Tensor]:
    users, items = samples.users[rows], samples.items[rows]
    history = samples.history[rows]
    batch = {"users": users, "items": items, "history": np.where(history == PAD_ITEM, pad, history),
             "age": side.age[users],
             "gender": side.gender[users], "occupation": side.occupation[users], "genres": side.genres[items]}
    if knowledge is not None:
        batch["user_knowledge"], batch["item_knowledge"] = knowledge[0][users], knowledge[1][items]
    return {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in batch.items()}


def train_and_evaluate(dataset: Dataset, train: CtrSamples, test: CtrSamples,
                       knowledge: tuple[np.ndarray, np.ndarray] | None, seed: int = 0, epochs: int = 3,
                       batch_size: int = 256, lr: float = 1e-3) -> dict[str, float]:
    """Train a :class:`DIN` and return its test ``auc`` and ``logloss``. ``knowledge``: float32
    ``([U, K], [I, K])`` user and item knowledge vectors, or None for the model without knowledge."""
    torch.manual_seed(seed)
    side = SideFeatures.of(dataset)
    model = DIN(dataset.num_users, dataset.num_items, side, knowledge[0].shape[1] if knowledge is not None else 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    order_rng = np.random.default_rng(seed)
    loss_fn = nn.BCEWithLogitsLoss()
    for _ in range(epochs):
        model.train()
        order = order_rng.permutation(len(train))
        for start in range(0, len(order), batch_size):
            batch = _batch(train, order[start:start + batch_size], side, dataset.num_items, knowledge)
            loss = loss_fn(model(batch), torch.from_numpy(train.labels[order[start:start + batch_size]]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        scores = torch.cat([torch.sigmoid(model(_batch(test, np.arange(start, min(start + 4096, len(test))), side,
                                                     dataset.num_items, knowledge)))
                            for start in range(0, len(test), 4096)]).double().numpy()
    return {"auc": float(roc_auc_score(test.labels, scores)),
            "logloss": float(log_loss(test.labels, np.clip(scores, 1e-7, 1 - 1e-7)))}


def knowledge_vectors(texts: Mapping[int, str], count: int, model: str, max_length: int = 192) -> np.ndarray:
    """float32 ``[count, hidden]``: mean-pooled hidden states of ``texts`` (entity -> text) from
    ``model``; zeros for entities without a text."""
    from transformers import AutoConfig

    from recspec.itemids.embed import embed_texts
    from recspec.hub import resolve_model_dir

    hidden = AutoConfig.from_pretrained(resolve_model_dir(model), trust_remote_code=False).hidden_size
    out = np.zeros((count, hidden), dtype=np.float32)
    if texts:
        entities = sorted(texts)
        out[entities] = embed_texts([texts[e] for e in entities], model=model, max_length=max_length)
    return out


def downstream_check(conditions: Mapping[str, Sequence[str]], old: Sequence[str] = (), model: str = "smollm2",
                     seeds: Sequence[int] = (0, 1, 2), epochs: int = 3) -> dict:
    """AUC and log loss (mean and spread over ``seeds``) without knowledge and with each
    condition's knowledge (e.g. ``{"greedy": [user store, item store], "relaxed": [...]}``: new-part
    stores; ``old``: old-part item stores giving the existing items' knowledge). The users under
    test are those with a text in every condition's user store (all users if none has one)."""
    from recspec.data import load_dataset
    from recspec.knowledge.store import read_rows, read_settings
    from recspec.knowledge.stream import stream_split

    paths = [p for stores in conditions.values() for p in stores] + list(old)
    settings = {p: read_settings(p) for p in paths}
    first = settings[paths[0]]
    for path, values in settings.items():
        for key in ("model", "prompt_version", "dataset", "split"):
            if values.get(key) != first.get(key):
                raise RecspecError(f"{path}: {key}={values.get(key)!r} differs from {paths[0]}'s {first.get(key)!r}; "
                                   f"compare knowledge of one model, prompt version, data set and split")
    dataset = load_dataset(first["dataset"])
    split = stream_split(dataset, **first["split"])
    ids = {"user": {u: i for i, u in enumerate(dataset.user_ids)}, "item": {t: i for i, t in enumerate(dataset.item_ids)}}

    def texts(path: str) -> tuple[str, dict[int, str]]:
        side = settings[path]["side"]
        return side, {ids[side][row.entity]: row.text for row in read_rows(path)}

    old_items = {e: t for path in old for e, t in texts(path)[1].items()}
    by_condition = {name: dict(texts(p) for p in stores) for name, stores in conditions.items()}
    user_sets = [set(c["user"]) for c in by_condition.values() if "user" in c]
    users = sorted(set.intersection(*user_sets)) if user_sets else list(range(dataset.num_users))
    train, test = ctr_samples(dataset, split, users)
    results = {"users": len(users), "train_samples": len(train), "test_samples": len(test), "seeds": list(seeds),
               "epochs": epochs, "embedding_model": model, "conditions": {}}
    variants: dict[str, tuple[np.ndarray, np.ndarray] | None] = {"none": None}
    for name, sides in by_condition.items():
        user_vectors = knowledge_vectors(sides.get("user", {}), dataset.num_users, model)
        item_vectors = knowledge_vectors({**old_items, **sides.get("item", {})}, dataset.num_items, model)
        variants[name] = (user_vectors, item_vectors)
    for name, knowledge in variants.items():
        runs = [train_and_evaluate(dataset, train, test, knowledge, seed, epochs) for seed in seeds]
        results["conditions"][name] = {metric: {"mean": float(np.mean([r[metric] for r in runs])),
                                                "std": float(np.std([r[metric] for r in runs])),
                                                "runs": [r[metric] for r in runs]} for metric in ("auc", "logloss")}
    return results


def run(out: Path, greedy: Sequence[str], relaxed: Sequence[str], old: Sequence[str] = (), model: str = "smollm2",
        seeds: int = 3, epochs: int = 3) -> str:
    """The downstream check of greedy vs relaxed knowledge; writes ``knowledge_ctr.json`` / ``.md``
    into ``out`` and returns the Markdown."""
    results = downstream_check({"greedy": greedy, "relaxed": relaxed}, old, model, range(seeds), epochs)
    conditions = results["conditions"]
    rows = [[name, f"{c['auc']['mean']:.4f} +- {c['auc']['std']:.4f}",
             f"{c['logloss']['mean']:.4f} +- {c['logloss']['std']:.4f}"] for name, c in conditions.items()]
    gap = conditions["relaxed"]["auc"]["mean"] - conditions["greedy"]["auc"]["mean"]
    markdown = "\n\n".join([
        "# Downstream CTR check: knowledge from greedy decoding vs relaxed LASER",
        f"DIN-style model on MovieLens-100K ({results['users']} users, {results['train_samples']} training and "
        f"{results['test_samples']} test samples, rating >= 4 positive), mean +- std over {seeds} seeds, "
        f"{epochs} epochs; knowledge embedded with {model}'s mean-pooled last hidden states.",
        markdown_table(["knowledge", "AUC", "log loss"], rows),
        f"AUC relaxed - greedy: {gap:+.4f}"])
    write_results(out, "knowledge_ctr", {"stores": {"greedy": list(greedy), "relaxed": list(relaxed),
                                                    "old": list(old)}, **results}, markdown)
    return markdown
