"""The downstream CTR check on real MovieLens: samples without leakage, a DIN-style model that
learns and uses knowledge vectors, and the greedy-vs-relaxed comparison over stores."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.lab.ctr import ctr_samples, downstream_check, train_and_evaluate
from recspec.errors import RecspecError
from recspec.decoding.text_rounds import Generation
from recspec.knowledge.prompts import PROMPT_VERSION
from recspec.knowledge.store import KnowledgeStore
from recspec.knowledge.stream import stream_split

USERS = list(range(120))


@pytest.fixture(scope="module")
def split(ml100k):
    return stream_split(ml100k)


def test_samples_train_on_history_and_test_on_the_unseen_future(ml100k, split) -> None:
    train, test = ctr_samples(ml100k, split, USERS, history=5)
    inter = ml100k.interactions
    assert len(train) == sum(len(split.history(u)) for u in USERS)
    assert len(test) == sum(len(split.future[u]) for u in USERS)
    future = {(int(inter.users[r]), int(inter.items[r])): float(inter.ratings[r] >= 4) for u in USERS
              for r in split.future[u]}
    assert all(future[(u, i)] == y for u, i, y in zip(test.users, test.items, test.labels))
    for u, history in zip(test.users[:50], test.history[:50]):  # the history precedes the sample, in time
        earlier = set(inter.items[np.concatenate((split.history(u), split.future[u]))].tolist())
        assert set(history[history >= 0].tolist()) <= earlier
    for u in USERS:  # the future is the latest of every user's interactions
        assert inter.timestamps[split.history(u)].max() <= inter.timestamps[split.future[u]].min()


def test_din_learns_and_uses_knowledge_vectors(ml100k, split) -> None:
    train, test = ctr_samples(ml100k, split, USERS)
    plain = train_and_evaluate(ml100k, train, test, None, seed=0, epochs=2)
    assert 0.6 < plain["auc"] < 0.9 and plain["logloss"] < 0.69
    # an oracle user vector (the share of liked movies in the user's future) must be picked up
    oracle = np.zeros((ml100k.num_users, 4), dtype=np.float32)
    for user in USERS:
        oracle[user] = test.labels[test.users == user].mean()
    informed = train_and_evaluate(ml100k, train, test, (oracle, np.zeros((ml100k.num_items, 4), np.float32)),
                                  seed=0, epochs=2)
    assert informed["auc"] > plain["auc"] + 0.02


def _store(path, split, side: str, texts: dict[str, str]) -> str:
    settings = {"model": {"name": "smollm2", "fingerprint": "test"}, "prompt_version": PROMPT_VERSION,
                "dataset": "ml-100k", "split": split.settings, "side": side, "part": "new"}
    with KnowledgeStore(path, settings) as store:
        store.add([(entity, text, Generation([1], 1, 1, 0, 0, 1, 0.0, 0.0, 0.1)) for entity, text in texts.items()])
    return str(path)


def test_downstream_check_compares_conditions_on_the_same_users(ml100k, split, smollm2_dir, tmp_path) -> None:
    users = [ml100k.user_ids[u] for u in USERS[:80]]
    likes = {u: ("This user loves dramas and romance." if i % 2 else "This user enjoys action and sci-fi.")
             for i, u in enumerate(users)}
    greedy = _store(tmp_path / "g.db", split, "user", likes)
    relaxed = _store(tmp_path / "r.db", split, "user", {u: likes[u] for u in users[:60]})
    results = downstream_check({"greedy": [greedy], "relaxed": [relaxed]}, model=str(smollm2_dir), seeds=(0,),
                               epochs=1)
    assert results["users"] == 60  # the users both conditions have knowledge for
    assert set(results["conditions"]) == {"none", "greedy", "relaxed"}
    assert all(0.5 < c["auc"]["mean"] < 1 for c in results["conditions"].values())
    other = tmp_path / "o.db"
    with KnowledgeStore(other, {"model": {"name": "x", "fingerprint": "y"}, "prompt_version": PROMPT_VERSION,
                                "dataset": "ml-100k", "split": split.settings, "side": "user", "part": "new"}):
        pass
    with pytest.raises(RecspecError, match="compare knowledge of one model"):
        downstream_check({"greedy": [greedy], "relaxed": [str(other)]}, model=str(smollm2_dir))
