"""Odd input to the Python API, `recspec.load(...).recommend(...)`: any iterable serves as a list
(a generator, a tuple: read once), None or a string where a list belongs is one RecspecError line,
ids that are not valid Unicode and absurd sizes are refused in that line too; a dsbd answer
with fewer than k items says why, and the reason is the decoder's repeated draws (DSBD samples
its k beams independently, with replacement), not lost beams."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import recspec
from recspec.decoding.dsbd import dsbd_beam_search
from recspec.errors import RecspecError
from recspec.models.tokenizer import identifier_token_ids
from recspec.recommend import DecodeOptions, Recommender
from tests.test_serve import K, models  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def histories(models) -> list[list[str]]:  # noqa: F811
    """The raw-id histories of the first 6 test users."""
    return raw_histories(models[0], 6)


def raw_histories(target: Path, users: int) -> list[list[str]]:
    """The raw-id histories of the first ``users`` test users of ``target``'s data set."""
    recommender = Recommender.load(target)
    examples = recommender.examples("test", users)
    return [[recommender.dataset.item_ids[item] for item in examples.history_of(i)] for i in range(users)]


@pytest.fixture(scope="module")
def model(models) -> recspec.RecspecModel:  # noqa: F811
    target, draft = models
    return recspec.load(target, draft=draft, decoder="tree-beam")


def test_generators_and_tuples_serve_as_lists(model, histories) -> None:
    expected = model.recommend(histories, k=K)
    from_generator = model.recommend((history for history in histories), k=K)
    from_tuples = model.recommend(tuple(tuple(history) for history in histories), k=K)
    assert len(from_generator) == len(from_tuples) == len(histories)
    for answers in (from_generator, from_tuples):
        assert [answer.items for answer in answers] == [answer.items for answer in expected]
    banned = expected[0].items[:3]
    excluded = model.recommend(histories[:3], k=K, exclude=(item for item in banned))  # read once, for all
    assert all(not set(answer.items) & set(banned) and len(answer.items) == K for answer in excluded)
    assert all(answer.fewer_reason is None for answer in expected)


@pytest.mark.parametrize(("call", "message"), [
    (lambda model, good: model.recommend(None), r"histories is a list of histories, each a list of raw item ids "
                                                r"\(oldest first\), got None"),
    (lambda model, good: model.recommend("485"), "histories is a list of histories.*got str '485'"),
    (lambda model, good: model.recommend(7), "histories is a list of histories.*got int 7"),
    (lambda model, good: model.recommend([good, None]), "histories is a list of histories.*; history 1, got None"),
    (lambda model, good: model.recommend([good, "485"]), "; history 1, got str '485'"),
    (lambda model, good: model.recommend([good], exclude="12"), "exclude is a list of raw item ids never to "
                                                                "return, got str '12'"),
    (lambda model, good: model.recommend([good], exclude=None), "exclude is a list of raw item ids.*got None"),
    (lambda model, good: model.recommend([good], batch_size="2"), "batch_size must be an integer of at least 1, "
                                                                  "got '2'"),
    (lambda model, good: model.recommend([good], batch_size=True), "batch_size must be an integer"),
    (lambda model, good: model.recommend([good, [good[0], "\ud800"]]), r"history 1: history.1: .*lone surrogate"),
    (lambda model, good: model.recommend([good], exclude=["\udfff"]), r"history 0: exclude.0: .*lone surrogate"),
    (lambda model, good: model.recommend([good], k=int("9" * 401)), "history 0: k: Input should be less than or "
                                                                    "equal to 2147483647"),
    (lambda model, good: model.recommend([good], k=-int("9" * 401)), "history 0: k: Input should be greater"),
    (lambda model, good: model.recommend([good], k=1683), r"history 0: k=1683 is outside \[1, 1682\]"),
    (lambda model, good: model.recommend([good, [1, 2]]), "history 1: history.0: Input should be a valid string"),
], ids=["histories None", "histories a string", "histories a number", "a history None", "a history a string",
        "exclude a string", "exclude None", "batch_size a string", "batch_size a bool", "a lone surrogate",
        "a lone surrogate excluded", "k of 401 digits", "k of -401 digits", "k above the catalogue",
        "numbers as ids"])
def test_odd_input_is_one_line(model, histories, call, message) -> None:
    with pytest.raises(RecspecError, match=message) as caught:
        call(model, histories[0])
    assert "\n" not in str(caught.value)
    str(caught.value).encode("utf-8")  # printable: no lone surrogate is echoed


def test_dsbd_says_why_it_returns_fewer_items(models, histories) -> None:  # noqa: F811
    """With exclusions that leave exactly k items, and over ordinary histories, dsbd's answers may
    hold fewer than k items; each such answer says why, and the decoder's own k beams show the
    reason: all k are live items, some repeated (DSBD draws with replacement, Theorem 3.1)."""
    target, draft = models
    model = recspec.load(target, draft=draft, decoder="dsbd")
    recommender = model.service.recommender
    keep = np.arange(K)  # the catalogue's first K items are left; every other one is excluded
    left = [recommender.index.item_keys[i] for i in keep]
    exclude = [key for key in recommender.index.item_keys if key not in set(left)]
    narrowed = model.recommend(histories, k=K, exclude=exclude)
    ordinary = model.recommend(histories, k=K)
    assert all(set(answer.items) <= set(left) for answer in narrowed)
    for answer in narrowed + ordinary:
        assert len(set(answer.items)) == len(answer.items)
        if len(answer.items) < K:
            assert answer.fewer_reason is not None and "with replacement" in answer.fewer_reason
            assert f"{K - len(answer.items)} of the draws repeated an item" in answer.fewer_reason
        else:
            assert answer.fewer_reason is None
    assert any(len(answer.items) < K for answer in narrowed), "k items left and no repeated draw: nothing shown"
    trie = recommender.index.trie(identifier_token_ids(recommender.tokenizer, recommender.index),
                                  len(recommender.tokenizer), keep)
    prompts = recommender.encoder.prompts(recommender.examples("test", len(histories)))
    beams, _ = dsbd_beam_search(recommender.model, recommender.draft, prompts, trie, K, recommender.encoder.pad_id,
                                DecodeOptions().dsbd(K))
    for row, answer in zip(beams.items.tolist(), narrowed):
        assert len(row) == K and min(row) >= 0  # k live beams: none lost
        assert len(set(row)) == len(answer.items)  # the answer is the distinct ones


def test_the_api_makes_auto_choices_when_first_needed(models, histories, tmp_path: Path) -> None:  # noqa: F811
    """The API (not a server) makes auto's choice when first needed and keeps it beside the
    models, as `recspec recommend --decoder auto` does."""
    import shutil

    target, draft = models
    shutil.copytree(target, tmp_path / "target")
    model = recspec.load(tmp_path / "target", draft=draft, decoder="auto")
    [answer] = model.recommend(histories[:1], k=K)
    assert answer.decoder in ("tree-beam", "spec-strict") and len(answer.items) == K
    assert list((tmp_path / "target").rglob(f"probe-k{K}-b1.json")), "the API keeps its measurements"
