"""The streaming split, the pool routing (collaborative, attribute, random, the binary router)
and the lazily built pool tries, on the real MovieLens-100K."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from recspec.errors import RecspecError
from recspec.knowledge.pools import PoolSet
from recspec.knowledge.router import age_band, route_pools
from recspec.knowledge.stream import stream_split


@pytest.fixture(scope="module")
def split(ml100k):
    return stream_split(ml100k)


@pytest.fixture(scope="module")
def user_routing(ml100k, split):
    return route_pools(ml100k, split, "user", "router", groups=4, min_interactions=30)


def test_old_and_new_parts_overlap_and_the_new_part_ends_the_history(ml100k, split) -> None:
    times = ml100k.interactions.timestamps
    for user in range(0, ml100k.num_users, 7):
        old, new, future = split.old[user], split.new[user], split.future[user]
        history = split.history(user)
        n = len(history)
        assert n / 2 < len(old) == len(new) < n  # m with n/2 < m < n, both parts of length m
        assert len(np.intersect1d(old, new)) == 2 * len(old) - n  # the parts overlap
        assert (np.diff(times[old]) >= 0).all() and (np.diff(times[new]) >= 0).all()  # oldest first
        assert times[old[0]] == times[history].min() and times[new[-1]] == times[history].max()
        assert times[history].max() <= times[future].min() and len(np.intersect1d(future, history)) == 0
    items = np.concatenate((split.existing_items, split.new_items))
    assert np.array_equal(np.sort(items), np.arange(ml100k.num_items))
    assert abs(len(split.existing_items) - len(split.new_items)) <= 1
    with pytest.raises(RecspecError, match="old_share"):
        stream_split(ml100k, old_share=0.5)


def test_router_sends_active_users_to_collaborative_pools_and_the_rest_to_attribute_pools(ml100k, split,
                                                                                           user_routing) -> None:
    counts = np.bincount(ml100k.interactions.users[split.old_interactions()], minlength=ml100k.num_users)
    routes = user_routing.routes
    assert np.array_equal(np.char.startswith(routes.astype(str), "collaborative:"), counts >= 30)
    assert np.array_equal(np.char.startswith(routes.astype(str), "attribute:"), counts < 30)
    assert 0 < (counts >= 30).sum() < ml100k.num_users  # both kinds of pool are used
    ages = ml100k.user_info.ages
    for user in np.flatnonzero(counts < 30)[:20]:
        assert routes[user] == f"attribute:{age_band(ages[user])}"


def test_random_pools_have_the_collaborative_group_sizes(user_routing) -> None:
    collaborative = Counter(user_routing.labels["collaborative"].tolist())
    random = Counter(user_routing.labels["random"].tolist())
    assert len(collaborative) == 4
    assert sorted(collaborative.values()) == sorted(random.values())
    assert not np.array_equal(np.char.replace(user_routing.labels["random"].astype(str), "random", "collaborative"),
                              user_routing.labels["collaborative"].astype(str))  # a different partition


def test_item_attribute_pools_are_genre_groups(ml100k, split) -> None:
    routing = route_pools(ml100k, split, "item", "attribute")
    keys = set(routing.routes.tolist())
    assert len(keys) == 6 and "attribute:other" in keys  # the five most common genres and the rest
    for item in range(0, ml100k.num_items, 50):
        genre = routing.routes[item].split(":", 1)[1]
        assert genre == "other" or genre in ml100k.item_info.genres[item]
    with pytest.raises(RecspecError, match="unknown grouping"):
        route_pools(ml100k, split, "item", "genre")


def test_pool_tries_hold_exactly_their_members_earlier_knowledge(user_routing) -> None:
    texts = {user: [1000 + user, 7, 7] for user in range(0, 900, 3)}
    pools = PoolSet(user_routing, texts, window=4)
    user = next(u for u in range(900) if str(user_routing.routes[u]).startswith("collaborative:"))
    trie = pools.trie_for(user)
    members = {int(m) for m in user_routing.members(str(user_routing.routes[user]))}
    assert trie.texts == len(members & set(texts))
    for other in list(texts)[:40]:
        assert (trie.walk([1000 + other]) is not None) == (other in members)
    newcomer = next(m for m in sorted(members) if m not in texts)
    pools.add(newcomer, [5000, 1])
    assert trie.walk([5000, 1]) is not None and pools.trie_for(user) is trie
    assert pools.build_s > 0 and set(pools.sizes()) == {str(user_routing.routes[user])}
