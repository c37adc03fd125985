"""The one-call Python API (`recspec.load(...).recommend(histories)`): the answers of `recspec
recommend` for the same histories, batched or not, with every exact decoder; bad input is one
RecspecError naming the history."""

from __future__ import annotations

import pytest

import recspec
from recspec.errors import RecspecError
from tests.test_serve import K, expected, models, same_answer  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_recommend_equals_the_cli(models, expected) -> None:  # noqa: F811
    target, draft = models
    model = recspec.load(target, draft=draft, decoder="tree-beam")
    assert {"tree-beam", "spec-strict", "auto"} <= set(model.decoders)
    histories = [row["history"] for row in expected]
    for decoder, batch_size in (("tree-beam", 16), ("spec-strict", 64), ("auto", 7), ("beam", 1)):
        answers = model.recommend(histories, k=K, decoder=decoder, batch_size=batch_size)
        assert len(answers) == len(expected)
        for answer, row in zip(answers, expected):
            assert same_answer({"items": answer.items, "scores": answer.scores}, row), (decoder, row["user"])
    default = model.recommend(histories[:3], k=K)  # the default decoder given to load
    assert {answer.decoder for answer in default} == {"tree-beam"}
    without = model.recommend(histories[:2], k=5, exclude=expected[0]["items"][:3])
    assert all(not set(answer.items) & set(expected[0]["items"][:3]) and len(answer.items) == 5 for answer in without)


def test_bad_input_names_the_history(models, expected) -> None:  # noqa: F811
    target, _ = models
    with pytest.raises(RecspecError, match="needs a draft model"):
        recspec.load(target, decoder="spec-strict")
    model = recspec.load(target)
    good = expected[0]["history"]
    cases = [([good, ["no-such-item"]], {}, "history 1: unknown item id(s) no-such-item"),
             ([good, []], {}, "history 1: history: List should have at least 1 item"),
             ([good], {"k": 0}, "history 0: k=0 is outside"),
             ([good], {"decoder": "greedy"}, "history 0: unknown decoder 'greedy'"),
             ([good + good[:1]], {}, "history 0: history repeats item id"),
             (good, {}, "histories is a list of histories")]
    for histories, options, message in cases:
        with pytest.raises(RecspecError, match=message.replace("(", r"\(").replace(")", r"\)")):
            model.recommend(histories, **options)
