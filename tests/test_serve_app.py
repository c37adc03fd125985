"""The serve app's parts in-process, without a server: the one builder of the OpenAI answers
(chat and completions, whole and streamed), the app factory ``uvicorn --factory`` takes (its
config from the environment), and the parsing service of a server that decodes in a worker
process, which loads no model weights yet checks and parses requests as the decoding one does."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from recspec.errors import RecspecError
from recspec.recommend import DecodeOptions, UnloadedDraft
from recspec.serve.app import KEY_VARIABLE, SETTINGS_VARIABLE, from_environment
from recspec.serve.config import ServeConfig, load_service
from recspec.serve.routes import CHAT, COMPLETION, openai_answer
from recspec.serve.schemas import RecommendRequest, RecommendStats
from recspec.serve.service import Answer, BadRequest, Query

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "factory-key"
STATS = RecommendStats(accepted_steps=0.0, target_calls=3.0, batch_size=1, queue_ms=1.0, decode_ms=2.0, ms=3.0)
ANSWER = Answer(items=["a", "b"], scores=[-1.0, -2.5], identifiers=["<x><y>", "<x><z>"], decoder="tree-beam",
                accepted_steps=0.0, drafted_steps=0.0, target_calls=3.0, batch_size=1, decode_s=0.002)


def events(response: StreamingResponse) -> list[dict]:
    """The events of a streamed answer (``data: [DONE]`` last)."""
    async def collect() -> str:
        return "".join([chunk async for chunk in response.body_iterator])

    text = asyncio.run(collect())
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("shape", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_one_builder_answers_both_openai_endpoints(shape) -> None:
    query = Query(torch.arange(7), 2, "tree-beam")
    whole = openai_answer(shape, "movies", 3, False, query, ANSWER, STATS)
    assert isinstance(whole, shape.response) and whole.id.startswith(f"{shape.id_prefix}-")
    assert (whole.model, whole.decoder, whole.stats) == ("movies", "tree-beam", STATS)
    assert whole.usage.model_dump() == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    choices = [choice.model_dump() for choice in whole.choices]
    assert [(c["index"], c["item"], c["score"]) for c in choices] == [(0, "a", -1.0), (1, "b", -2.5)]
    texts = [c["message"]["content"] if shape is CHAT else c["text"] for c in choices]
    assert texts == ANSWER.identifiers
    streamed = events(openai_answer(shape, "movies", 3, True, query, ANSWER, STATS))
    assert [event["object"] for event in streamed] == [shape.chunk] * 2
    assert {event["model"] for event in streamed} == {"movies"}
    for event, choice in zip(streamed, choices):
        (sent,) = event["choices"]
        if shape is CHAT:
            assert sent == {"index": choice["index"], "delta": choice["message"], "finish_reason": "stop",
                            "item": choice["item"], "score": choice["score"]}
        else:
            assert sent == choice


def test_settings_name_the_fields_they_give(monkeypatch) -> None:
    """A config in the environment may give ``target`` alone (the other fields keep their
    defaults) or what :meth:`ServeConfig.settings` writes, read back to the same config."""
    assert ServeConfig.from_settings(json.dumps({"target": "models/t"})) == ServeConfig(Path("models/t"))
    config = ServeConfig(Path("models/t"), draft="models/d", options=DecodeOptions(gamma=2), auto_k=(5, 10))
    assert ServeConfig.from_settings(config.settings()) == config
    monkeypatch.delenv(SETTINGS_VARIABLE, raising=False)
    with pytest.raises(RecspecError, match=f"{SETTINGS_VARIABLE} is not set"):
        from_environment()
    monkeypatch.setenv(SETTINGS_VARIABLE, config.settings())
    monkeypatch.setenv(KEY_VARIABLE, " ")
    with pytest.raises(RecspecError, match=f"{KEY_VARIABLE} is empty"):
        from_environment()


def test_the_factory_serves_the_config_in_the_environment(trained_models: Path, monkeypatch) -> None:
    target = trained_models / "target"
    settings = {"target": str(target), "decoder": "tree-beam", "served_model_name": "movies"}
    monkeypatch.setenv(SETTINGS_VARIABLE, json.dumps(settings))
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    app = from_environment()
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        deadline = time.monotonic() + 300
        while client.get("/health/ready").status_code != 200:
            assert time.monotonic() < deadline and app.state.recspec.failure is None
            time.sleep(0.2)
        assert client.get("/v1/models").status_code == 401
        (model,) = client.get("/v1/models", headers=auth).json()["data"]
        assert (model["id"], model["default_decoder"], model["draft"]) == ("movies", "tree-beam", [])
        answer = client.post("/v1/recommend", json={"history": ["1", "2"], "k": 5}, headers=auth).json()
    service = app.state.recspec.service
    (expected,) = service.decode([service.parse(RecommendRequest(history=["1", "2"], k=5))])
    assert (answer["items"], answer["decoder"]) == (expected.items, "tree-beam")


@pytest.mark.parametrize("draft", ["folder", "root"])
def test_a_parsing_service_loads_no_weights_and_parses_as_the_decoding_one(trained_models: Path, draft: str) -> None:
    """``--decode-process``: the server's own service loads the tokenizer, index and trie but no
    model or draft weights, and allows, refuses, parses and describes exactly what the decoding
    service (the worker's) does."""
    named = str(trained_models / "draft") if draft == "folder" else "root"
    config = ServeConfig(trained_models / "target", draft=named, decoder="tree-beam")
    parsing, decoding = load_service(config, decoding=False), load_service(config)
    assert parsing.recommender.model is None and isinstance(parsing.recommender.draft, UnloadedDraft)
    assert decoding.recommender.model is not None and not isinstance(decoding.recommender.draft, UnloadedDraft)
    for service in (parsing, decoding):
        assert service.recommender.draft_names == decoding.recommender.draft_names
        assert (service.decoders, service.num_items, service.max_history) == (
            decoding.decoders, decoding.num_items, decoding.max_history)
        assert service.recommender.trie.depth == decoding.recommender.trie.depth
    request = RecommendRequest(history=["1", "50", "7"], k=4, decoder="spec-strict", exclude=["2"])
    mine, theirs = parsing.parse(request), decoding.parse(request)
    assert torch.equal(mine.prompt, theirs.prompt) and mine.key == theirs.key
    with pytest.raises(BadRequest, match="unknown item"):
        parsing.parse(RecommendRequest(history=["no-such-item"], k=4))


def test_without_a_draft_the_parsing_service_refuses_drafted_decoders(trained_models: Path) -> None:
    parsing = load_service(ServeConfig(trained_models / "target", decoder="tree-beam"), decoding=False)
    assert parsing.recommender.model is None and parsing.recommender.draft is None
    with pytest.raises(BadRequest, match="needs a draft model"):
        parsing.parse(RecommendRequest(history=["1"], k=4, decoder="spec-strict"))
