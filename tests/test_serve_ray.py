"""`recspec serve --engine ray` for real: the command starts its own local Ray cluster (this
machine's cores) and serves two replicas behind Ray Serve's proxy on 127.0.0.1 (a free port);
httpx as the client, the models and the `recspec recommend` answers of tests/test_serve.py. The
same answers through two replicas at once, the same refusals, SIGTERM with requests in flight,
and one-line errors for what cannot start."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator

import httpx
import pytest

from recspec.serve.on_ray import free_port
from tests.test_cli import recspec_process as recspec
from tests.test_serve import (K, expected, metric, models, post_all, same_answer, series,  # noqa: F401  (fixtures)
                              server, sigterm_while_queued)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
USERS = 32  # concurrent clients per decoder
RAY = ("--engine", "ray", "--replicas", "2")


def test_user_errors_are_one_line(models) -> None:  # noqa: F811
    target, _ = models
    closed = free_port("127.0.0.1")
    too_many = (os.cpu_count() or 1) + 1  # the command's own cluster has this machine's cores
    cases = [  # (arguments, the start of the one line)
        ([*RAY, "--address", f"127.0.0.1:{closed}"], f"no Ray cluster answers at 127.0.0.1:{closed}"),
        (["--engine", "ray", "--replicas", str(too_many)], f"{too_many} workers of 1 CPU(s) and 0 GPU(s) need"),
        (["--engine", "ray", "--replicas", "0"], "--replicas must be at least 1"),
        (["--replicas", "2"], "--replicas counts Ray Serve replicas: use it with --engine ray"),
        ([*RAY, "--decode-process"], "--decode-process works with --engine local only"),
    ]
    for args, start in cases:
        run = recspec("serve", "--target", str(target), "--threads", "1", "--decoder", "tree-beam", *args)
        assert run.returncode == 2, (args, run.stderr)
        assert "Traceback" not in run.stderr, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith(f"error: {start}"), (args, run.stderr)


def test_sigterm_answers_every_request_in_flight_on_every_replica(models, expected) -> None:  # noqa: F811
    target, _ = models
    # no draft; a batch waits up to 2 s to fill: SIGTERM comes while the requests are queued in the replicas
    with server(target, *RAY, "--decoder", "tree-beam", "--max-wait-ms", "2000", "--max-batch", "64") as (url,
                                                                                                         process):
        refused = httpx.post(f"{url}/v1/recommend", json={"history": expected[0]["history"], "decoder": "spec-strict"})
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "needs_draft"
        # /metrics is one replica's: once one has queued some, the rest reach theirs within `settle`
        sigterm_while_queued(url, process, expected[:12], lambda: metric(url, "recspec_queue_depth") > 0, settle=0.3)


@pytest.fixture(scope="module")
def ray_server(models) -> Iterator[str]:  # noqa: F811
    """Two replicas with the target and the draft, tree-beam by default; its URL."""
    target, draft = models
    with server(target, *RAY, "--draft", str(draft), "--decoder", "tree-beam", "--max-wait-ms", "200",
                "--max-batch", "64") as (url, _):
        yield url


def test_health_and_models(ray_server: str, models) -> None:  # noqa: F811
    _, draft = models
    assert httpx.get(f"{ray_server}/health").json()["status"] == "ready"
    # the server was ready only once the proxy routed to both replicas; /health names the one answering
    assert len({httpx.get(f"{ray_server}/health").json()["replica"] for _ in range(30)}) == 2
    listed = httpx.get(f"{ray_server}/v1/models")
    info = listed.json()["data"][0]
    assert info["id"] == models[0].name and str(draft.parent) not in listed.text  # served names, never paths
    assert info["items"] == 1682 and info["draft"] == [draft.name] and info["threads"] == 1
    assert {"tree-beam", "spec-strict"} <= set(info["decoders"]) and info["default_decoder"] == "tree-beam"


def test_answers_equal_the_cli_through_two_replicas(ray_server: str, expected) -> None:  # noqa: F811
    rows = expected[:USERS]
    decoders = ("tree-beam", "spec-strict")
    bodies = [{"history": row["history"], "k": K, "decoder": decoder} for decoder in decoders for row in rows]
    responses = asyncio.run(post_all(ray_server, bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies)
    for i, response in enumerate(responses):
        got, row = response.json(), rows[i % USERS]
        assert same_answer(got, row), (bodies[i]["decoder"], got, row)
        assert got["requested_decoder"] == got["decoder"] == bodies[i]["decoder"]
    assert max(r.json()["stats"]["batch_size"] for r in responses) > 1  # each replica batches its share
    # /metrics is the answering replica's (it names itself): two replicas, each counting its share of the answers
    answered = dict(replica_metric(ray_server, "recspec_requests_total", 'endpoint="recommend",status="200"')
                    for _ in range(30))
    assert len(answered) == 2 and sum(answered.values()) == len(bodies), answered


def replica_metric(url: str, name: str, labels: str) -> tuple[str, float]:
    """(the replica that answered /metrics, the value of one of its series)."""
    text = httpx.get(f"{url}/metrics").text
    replica = re.search(r'^recspec_replica_info\{replica="([0-9a-f]+)"\} 1', text, re.MULTILINE)
    assert replica is not None, text
    return replica.group(1), series(text, name, labels)


def test_bad_requests_are_refused_as_by_one_server(ray_server: str, expected) -> None:  # noqa: F811
    history = expected[0]["history"]
    url = f"{ray_server}/v1/recommend"
    unknown = httpx.post(url, json={"history": [*history[:2], "no-such-item"], "k": 5})
    assert unknown.status_code == 422 and unknown.json()["error"]["items"] == ["no-such-item"]
    malformed = httpx.post(url, content=b'{"history": ["1", ', headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "malformed_json"
    for body, kind in (({"history": history, "decoder": "fastest"}, "unknown_decoder"),
                       ({"history": history, "k": 0}, "bad_k"), ({"history": []}, "invalid")):
        response = httpx.post(url, json=body)
        assert response.status_code == 422 and response.json()["error"]["code"] == kind, response.text
    good = httpx.post(url, json={"history": history, "k": K}, timeout=60)
    assert good.status_code == 200 and same_answer(good.json(), expected[0])
