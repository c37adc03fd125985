"""`recspec serve` for real: uvicorn in a subprocess on 127.0.0.1 (a free port), httpx as the
client, models trained here on MovieLens-100K (and, for the chat endpoint, an LLM preset over
SmolLM2's tokenizer, also through the `openai` client). Results equal `recspec recommend`'s;
concurrency, every bad request, queue overflow, deadlines, a client that goes away, and SIGTERM
with requests in flight (decoding in a thread and in a worker process)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from recspec.bench.serve import running_server
from recspec.decoding import tree_beam_search
from recspec.fit import fit
from recspec.itemids.index import ItemIndex
from recspec.models.presets import LLM_INSTRUCTION, LLM_SEPARATOR, LLM_SYSTEM
from recspec.models.tokenizer import identifier_token_ids
from recspec.models.train import TrainConfig
from recspec.recommend import Recommender
from tests.test_cli import recspec
from tests.test_recommend_cli import small_data  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
USERS = 64  # test users whose answers are checked
K = 10


@pytest.fixture(scope="module")
def models(trained_models: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A draft-tiny target and a weaker draft-tiny draft, trained on MovieLens-100K (leave-one-out)
    over identifiers made from the item number (three levels of 16): this module's own copy of
    :func:`trained_models`, so that what `auto` keeps beside a model (timings) is the module's own."""
    import shutil

    root = tmp_path_factory.mktemp("serve")
    for name in ("target", "draft"):
        shutil.copytree(trained_models / name, root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def expected(models, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The first USERS test users: their history as raw ids and `recspec recommend`'s answer."""
    target, _ = models
    out = tmp_path_factory.mktemp("cli") / "recs.jsonl"
    run = recspec("recommend", "--target", str(target), "--decoder", "tree-beam", "--k", str(K), "--users",
                  str(USERS), "--out", str(out))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    recommender = Recommender.load(target)
    examples = recommender.examples("test", USERS)
    for i, row in enumerate(rows):
        assert row["user"] == recommender.dataset.user_ids[int(examples.users[i])]
        row["history"] = [recommender.dataset.item_ids[item] for item in examples.history_of(i)]
    return rows


@contextmanager
def server(target: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``recspec serve`` over ``target`` with one torch thread on a free loopback port, ready."""
    with running_server(["--target", str(target), "--threads", "1", *args]) as (url, process):
        yield url, process


def series(text: str, name: str, labels: str = "") -> float:
    """The value of one series of a Prometheus text (0 when absent)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def metric(url: str, name: str, labels: str = "") -> float:
    """The value of one series of /metrics (0 when absent)."""
    return series(httpx.get(f"{url}/metrics").text, name, labels)


def same_answer(got: dict, row: dict) -> bool:
    return got["items"] == row["items"] and np.allclose(got["scores"], row["scores"], atol=1e-4, rtol=0)


async def post_all(url: str, bodies: list[dict], path: str = "/v1/recommend", timeout: float = 120) -> list:
    """POST every body at once (one connection each); the responses in order."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        return await asyncio.gather(*(client.post(path, json=body) for body in bodies))


def test_answers_equal_the_cli_and_concurrent_clients_are_batched(models, expected) -> None:
    target, draft = models
    with server(target, "--draft", str(draft), "--decoder", "tree-beam", "--max-wait-ms", "20") as (url, _):
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ready" and len(health["replica"]) == 12
        assert httpx.get(f"{url}/health").json()["replica"] == health["replica"]  # one app, one name
        assert series(httpx.get(f"{url}/metrics").text, "recspec_replica_info", f'replica="{health["replica"]}"') == 1
        listed = httpx.get(f"{url}/v1/models")
        info = listed.json()["data"][0]
        assert info["id"] == target.name and info["object"] == "model"  # the served name, never a server path
        assert str(target.parent) not in listed.text and str(draft.parent) not in listed.text
        assert info["items"] == 1682 and info["draft"] == [draft.name] and len(info["target_sha256"]) == 64
        assert {"tree-beam", "spec-strict", "auto"} <= set(info["decoders"]) and not info["chat"]
        for row in expected[:8]:  # one at a time, each decoder: the CLI's items and scores
            for decoder in ("tree-beam", "beam", "spec-strict", "auto"):
                got = httpx.post(f"{url}/v1/recommend", json={"history": row["history"], "k": K, "decoder": decoder},
                                 timeout=120).json()
                assert same_answer(got, row), (decoder, got, row)
                assert got["requested_decoder"] == decoder and got["stats"]["batch_size"] == 1
        spec = httpx.post(f"{url}/v1/recommend", json={"history": expected[0]["history"], "k": K,
                                                        "decoder": "spec-strict"}).json()
        assert spec["decoder"] == "spec-strict" and spec["stats"]["target_calls"] >= 1
        # 64 concurrent clients: every one its own right answer, decoded in shared batches
        batches_before = metric(url, "recspec_batch_size_count")
        responses = asyncio.run(post_all(url, [{"history": row["history"], "k": K} for row in expected]))
        assert [r.status_code for r in responses] == [200] * USERS
        for response, row in zip(responses, expected):
            assert same_answer(response.json(), row), row["user"]
        batches = metric(url, "recspec_batch_size_count") - batches_before
        assert batches < USERS / 2, f"{batches} batches for {USERS} concurrent requests: no dynamic batching"
        assert max(r.json()["stats"]["batch_size"] for r in responses) > 1
        assert metric(url, "recspec_requests_total", 'endpoint="recommend",status="200"') == 8 * 4 + 1 + USERS


def test_exclusions_search_the_catalogue_without_those_items(models, expected) -> None:
    target, _ = models
    recommender = Recommender.load(target)
    token_ids = identifier_token_ids(recommender.tokenizer, recommender.index)
    with server(target, "--decoder", "tree-beam") as (url, _):
        examples = recommender.examples("test", USERS)
        for i, row in enumerate(expected[:6]):
            exclude = row["items"][:3] + row["history"][-2:]
            got = httpx.post(f"{url}/v1/recommend", json={"history": row["history"], "k": K, "exclude": exclude}).json()
            assert not set(got["items"]) & set(exclude) and len(got["items"]) == K
            keep = np.setdiff1d(np.arange(1682), recommender.index.positions(exclude))
            trie = recommender.index.trie(token_ids, len(recommender.tokenizer), keep)
            prompt = recommender.encoder.prompts(examples, np.array([i]))[0]
            reference = tree_beam_search(recommender.model, [prompt], trie, K, recommender.encoder.pad_id)
            assert got["items"] == [recommender.index.item_keys[item] for item in reference.items[0].tolist()]
            assert np.allclose(got["scores"], reference.scores[0].numpy(), atol=1e-4, rtol=0)


def test_bad_requests_never_reach_the_model(models, expected) -> None:
    target, _ = models
    history = expected[0]["history"]
    cases = [  # (body or raw bytes, status, kind)
        ({"history": [*history[:2], "no-such-item", "nor-this"], "k": 5}, 422, "unknown_items"),
        ({"history": [], "k": 5}, 422, "invalid"),
        ({"history": history, "k": 0}, 422, "bad_k"),
        ({"history": history, "k": 1683}, 422, "bad_k"),
        ({"history": history, "k": 1682, "exclude": history[:1]}, 422, "bad_k"),
        ({"history": [history[0], history[0]]}, 422, "duplicate_items"),
        ({"history": history, "exclude": ["1", "1"]}, 422, "duplicate_items"),
        ({"history": [1, 2]}, 422, "invalid"),
        ({"history": history, "k": "5"}, 422, "invalid"),
        ({"history": history, "decoder": "fastest"}, 422, "unknown_decoder"),
        ({"history": history, "decoder": "spec-strict"}, 422, "needs_draft"),
        ({"history": history, "decoder": "dsbd"}, 422, "needs_draft"),
        ({"history": history, "surprise": 1}, 422, "invalid"),
        ([history], 422, "invalid"),
        (b'{"history": ["1", ', 400, "malformed_json"),
        (b"\xff\xfe", 400, "malformed_json"),
        (json.dumps({"history": ["1"] * 300_000}).encode(), 413, "too_large"),
    ]
    with server(target, "--decoder", "tree-beam", "--max-body-kb", "512") as (url, _):
        batches = metric(url, "recspec_batch_size_count")
        for body, status, kind in cases:
            if isinstance(body, bytes):
                response = httpx.post(f"{url}/v1/recommend", content=body, headers={"content-type": "application/json"})
            else:
                response = httpx.post(f"{url}/v1/recommend", json=body)
            assert response.status_code == status, (body if len(str(body)) < 200 else kind, response.text)
            error = response.json()["error"]
            assert error["code"] == error["type"] == kind and set(error) >= {"message", "param"}, response.text
        unknown = httpx.post(f"{url}/v1/recommend", json=cases[0][0]).json()["error"]
        assert unknown["items"] == ["no-such-item", "nor-this"] and "no-such-item" in unknown["message"]
        form = httpx.post(f"{url}/v1/recommend", data={"history": "1"})
        assert form.status_code == 415 and form.json()["error"]["code"] == "not_json"
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 422 and chat.json()["error"]["code"] == "not_chat"
        assert metric(url, "recspec_batch_size_count") == batches  # nothing was decoded
        assert metric(url, "recspec_errors_total", 'kind="unknown_items"') == 2
        good = httpx.post(f"{url}/v1/recommend", json={"history": history, "k": K})
        assert good.status_code == 200 and same_answer(good.json(), expected[0])


def test_a_full_queue_answers_503_and_loses_nothing(models, expected) -> None:
    target, _ = models
    with server(target, "--decoder", "tree-beam", "--max-queue", "4", "--max-batch", "2") as (url, _):
        bodies = [{"history": row["history"], "k": K} for row in expected[:48]]
        responses = asyncio.run(post_all(url, bodies))
        codes = [r.status_code for r in responses]
        assert set(codes) == {200, 503} and codes.count(503) >= 1, codes
        for response, row in zip(responses, expected):
            if response.status_code == 200:
                assert same_answer(response.json(), row), row["user"]
            else:
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["code"] == "overloaded"
        assert metric(url, "recspec_errors_total", 'kind="overloaded"') == codes.count(503)
        assert metric(url, "recspec_queue_depth") == 0
        again = httpx.post(f"{url}/v1/recommend", json=bodies[0])  # the server recovers
        assert again.status_code == 200 and same_answer(again.json(), expected[0])


def test_deadlines_and_departed_clients_free_their_slots(models, expected) -> None:
    target, _ = models
    body = {"history": expected[0]["history"], "k": K}
    # a batch waits up to 3 s for company: a request can outlive its deadline, or its client, in the queue
    with server(target, "--decoder", "tree-beam", "--max-wait-ms", "3000", "--max-batch", "64") as (url, _):
        started = time.monotonic()
        late = httpx.post(f"{url}/v1/recommend", json={**body, "timeout_ms": 200}, timeout=10)
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline"
        assert time.monotonic() - started < 2.5
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.3 s
            httpx.post(f"{url}/v1/recommend", json=body, timeout=0.3)
        deadline = time.monotonic() + 2.0
        while metric(url, "recspec_errors_total", 'kind="disconnected"') < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(url, "recspec_errors_total", 'kind="disconnected"') == 1
        assert metric(url, "recspec_queue_depth") == 0
        assert metric(url, "recspec_batch_size_count") == 0  # neither was decoded
        assert metric(url, "recspec_errors_total", 'kind="deadline"') == 1
        ok = httpx.post(f"{url}/v1/recommend", json=body, timeout=30)
        assert ok.status_code == 200 and same_answer(ok.json(), expected[0])


@pytest.mark.parametrize("place", ["--no-decode-process", "--decode-process"])
def test_sigterm_answers_every_request_in_flight(models, expected, place: str) -> None:
    target, _ = models
    # a batch waits up to 1.5 s to fill: SIGTERM comes while all twelve requests are queued
    with server(target, "--decoder", "tree-beam", "--max-wait-ms", "1500", "--max-batch", "64", place) as (url,
                                                                                                        process):
        responses = sigterm_while_queued(url, process, expected[:12],
                                         lambda: metric(url, "recspec_queue_depth") == 12)
    assert {r.json()["stats"]["batch_size"] for r in responses} == {12}


def sigterm_while_queued(url: str, process: subprocess.Popen, rows: list[dict], queued: Callable[[], bool],
                         settle: float = 0.0) -> list[httpx.Response]:
    """POST the requests of ``rows`` at once, SIGTERM the server once ``queued()`` holds (and
    ``settle`` s more), and check that every request is answered right after the signal, the
    server exits 0 and nothing listens any more; the responses."""
    async def scenario() -> tuple[list, float]:
        sent = asyncio.ensure_future(post_all(url, [{"history": row["history"], "k": K} for row in rows]))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if await asyncio.to_thread(queued):
                break
        else:
            raise AssertionError("the requests never queued")
        await asyncio.sleep(settle)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        responses = await sent
        return responses, time.monotonic() - signalled

    responses, after = asyncio.run(scenario())
    assert process.wait(120) == 0
    assert after > 0.5, "the answers came before the signal: nothing was in flight"
    assert [r.status_code for r in responses] == [200] * len(rows)
    for response, row in zip(responses, rows):
        assert same_answer(response.json(), row)
    with pytest.raises(httpx.TransportError):  # gone: nothing listens any more
        httpx.get(f"{url}/health", timeout=2)
    return responses


def test_chat_completions_for_an_llm_preset(small_data, smollm2_dir, tmp_path: Path) -> None:  # noqa: F811
    """An LLM-preset model (SmolLM2's tokenizer and chat template): the OpenAI-style endpoint
    renders the messages and returns one choice per item, the same as /v1/recommend."""
    data, ids = small_data
    config = TrainConfig(epochs=1, batch_size=32, lr=3e-3, warmup_steps=2, max_train_examples=96, precision="fp32")
    fit(str(data), tmp_path / "llm", "draft-llm", ids=ids, split_kind="loo", config=config, valid_users=8,
        progress=False)
    recommender = Recommender.load(tmp_path / "llm")
    index = recommender.index
    history = ["i3", "i4", "i5", "i6"]
    text = LLM_SEPARATOR.join("".join(index.identifiers[index.key_to_position[key]]) for key in history)
    messages = [{"role": "system", "content": LLM_SYSTEM},
                {"role": "user", "content": LLM_INSTRUCTION.format(history=text)}]
    with server(tmp_path / "llm", "--decoder", "tree-beam") as (url, _):
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["chat"] is True
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "recspec", "messages": messages, "n": 5,
                                                             "temperature": 0.7}, timeout=60)
        assert chat.status_code == 200, chat.text
        answer = chat.json()
        plain = httpx.post(f"{url}/v1/recommend", json={"history": history, "k": 5}, timeout=60).json()
        assert answer["object"] == "chat.completion" and len(answer["choices"]) == 5
        assert [c["item"] for c in answer["choices"]] == plain["items"]
        assert np.allclose([c["score"] for c in answer["choices"]], plain["scores"], atol=1e-4, rtol=0)
        for i, choice in enumerate(answer["choices"]):
            position = index.key_to_position[choice["item"]]
            assert choice["index"] == i and choice["message"] == {"role": "assistant",
                                                                  "content": "".join(index.identifiers[position])}
        prompt = recommender.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert answer["usage"]["prompt_tokens"] == len(recommender.tokenizer(prompt, add_special_tokens=False)
                                                       ["input_ids"])
        bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": [], "n": 5})
        assert bad.status_code == 422
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "n": 41}).status_code == 422
        # the openai client: content-part arrays (joined with newlines), the developer role (as system), streaming
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        first, rest = messages[1]["content"].split(". ", 1)
        parted = [{"role": "developer", "content": LLM_SYSTEM},
                  {"role": "user", "content": [{"type": "text", "text": first}, {"type": "text", "text": rest}]}]
        joined = [{"role": "system", "content": LLM_SYSTEM}, {"role": "user", "content": f"{first}\n{rest}"}]
        got = client.chat.completions.create(model="any-name", messages=parted, n=5)
        want = httpx.post(f"{url}/v1/chat/completions", json={"messages": joined, "n": 5}, timeout=60).json()
        assert got.model == "llm" and [c.item for c in got.choices] == [c["item"] for c in want["choices"]]
        template = recommender.tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
        assert got.usage.prompt_tokens == len(recommender.tokenizer(template, add_special_tokens=False)["input_ids"])
        chunks = list(client.chat.completions.create(model="llm", messages=parted, n=5, stream=True))
        assert [chunk.choices[0].delta.content for chunk in chunks] == [c.message.content for c in got.choices]
        assert [chunk.choices[0].index for chunk in chunks] == list(range(5))
        assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            client.chat.completions.create(model="llm", messages=image, n=5)
        assert refused.value.code == "invalid" and refused.value.param.startswith("messages.0.content")


def test_trie_over_some_items_reports_their_rows(ml100k) -> None:
    n = len(ml100k.item_ids)
    codes = np.stack([np.arange(n) // 256, (np.arange(n) // 16) % 16, np.arange(n) % 16], axis=1)
    index = ItemIndex.from_codes(ml100k.item_ids, codes)
    keep = np.sort(np.random.default_rng(0).choice(n, 700, replace=False))
    full, part = index.trie(), index.trie(keep=keep)
    ids = torch.as_tensor(index.codes)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[keep] = True
    found = part.items(part.walk(ids))
    assert torch.equal(found[kept], torch.as_tensor(keep)) and (found[~kept] == -1).all()
    assert part.num_items == 700 and torch.equal(full.items(full.walk(ids)), torch.arange(n))


def test_an_auto_server_makes_its_choices_before_it_is_ready(models) -> None:
    target, draft = models
    with server(target, "--draft", str(draft), "--decoder", "auto", "--max-batch", "4") as (url, _):
        described = httpx.get(f"{url}/v1/models").json()["data"][0]["auto"]
        assert [(row["k"], row["batch"]) for row in described] == [(K, 1), (K, 2), (K, 4)]
        assert all(row["decoder"] in ("tree-beam", "spec-strict") and row["reason"].startswith("auto: ")
                   for row in described)
        assert metric(url, "recspec_batch_size_count") == 0  # nothing decoded for a request yet
