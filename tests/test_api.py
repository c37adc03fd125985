"""The Python API: `recspec.load(...).recommend(histories)` gives the answers of `recspec
recommend` for the same histories, batched or not, with every exact decoder (bad input is one
RecspecError naming the history); `recspec.recommend_users` and `recspec.generate_knowledge` are
the commands' batch jobs (the same outputs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import recspec
from recspec.errors import RecspecError
from recspec.knowledge.store import read_rows
from recspec.knowledge.verify import Verification
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


def test_recommend_users_writes_what_the_cli_writes(models, expected, tmp_path) -> None:  # noqa: F811
    """The batch job of the API is the command's: the same file for the same users, a report
    with what the command prints; speculative statistics for a speculative decoder."""
    target, draft = models
    out = tmp_path / "recs.jsonl"
    report = recspec.recommend_users(target, out, k=K, decoder="tree-beam", users=len(expected), progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["user"], row["items"]) for row in rows] == [(row["user"], row["items"]) for row in expected]
    assert report.users == len(expected) and report.stats is None
    assert report.lines()[-1].startswith(f"{len(expected)} users in ") and report.lines()[-1].endswith(f"wrote {out}")
    spec = recspec.recommend_users(target, tmp_path / "spec.jsonl", k=K, decoder="spec-strict", draft=str(draft),
                                   options=recspec.DecodeOptions(draft_beams=20), users=8, progress=False)
    assert [json.loads(line)["items"] for line in (tmp_path / "spec.jsonl").read_text().splitlines()] == [
        row["items"] for row in expected[:8]]
    assert spec.stats is not None and spec.lines()[-1].startswith("accepted steps ")
    with pytest.raises(RecspecError, match="exists"):
        recspec.recommend_users(target, out, k=K)
    with pytest.raises(RecspecError, match="unknown engine 'spark'"):
        recspec.Engine("spark")
    with pytest.raises(RecspecError, match="--address names a Ray cluster"):
        recspec.Engine("local", address="auto")


def test_generate_knowledge_is_the_command_and_resumes(smollm2_dir, ml100k, tmp_path) -> None:
    """``recspec.generate_knowledge`` writes the store ``recspec knowledge generate`` writes
    (texts equal), resumes it, and reads its texts back."""
    config = recspec.KnowledgeConfig(side="item", part="old", method="ar", verification=Verification("greedy"),
                                     max_new_tokens=5)
    first = recspec.generate_knowledge(tmp_path / "api.db", config, limit=2, model=str(smollm2_dir),
                                       progress=False)
    assert first.summary.requests == 2 and len(first.texts()) == 2
    again = recspec.generate_knowledge(tmp_path / "api.db", config, limit=3, model=str(smollm2_dir), progress=False)
    assert (again.summary.requests, again.summary.skipped) == (1, 2) and len(again.texts()) == 3
    cli = subprocess.run([sys.executable, "-m", "recspec.cli", "knowledge", "generate", "--out",
                          str(tmp_path / "cli.db"), "--side", "item", "--part", "old", "--decoder", "ar", "--verify",
                          "greedy", "--max-new-tokens", "5", "--limit", "3", "--target", str(smollm2_dir),
                          "--threads", "1"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("3 generated (0 already stored): ")
    assert {row.entity: row.tokens for row in read_rows(tmp_path / "cli.db")} == {
        row.entity: row.tokens for row in read_rows(tmp_path / "api.db")}
    with pytest.raises(RecspecError, match="--limit must be at least 1"):
        recspec.generate_knowledge(tmp_path / "x.db", config, limit=0, model=str(smollm2_dir))
