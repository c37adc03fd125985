"""`recspec serve` against hostile and odd clients, for real: uvicorn in a subprocess on
127.0.0.1 (a free port), httpx and raw sockets as clients, the tiny trained target and draft.
Every refusal has the service's error body (a lone surrogate, JSON nested 50,000 deep, invalid
UTF-8, 401-digit numbers, unknown paths); dsbd answers with fewer than k items say why; 300 idle
or slow connections leave /health answering and are closed by the server; a busy port is refused
before anything loads; an auto server answers a k it has not measured at once and measures it in
the background, writing nothing into the model folders."""

from __future__ import annotations

import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from recspec.bench.serve import running_server
from recspec.recommend import Recommender
from tests.test_api_input import raw_histories
from tests.test_serve import K, metric, models, server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
IDLE = 300  # idle or slow connections opened at once
FILE_LIMIT = 256  # the server's open-file limit (soft and hard) in the idle-connection test: below IDLE


@pytest.fixture(scope="module")
def histories(models) -> list[list[str]]:  # noqa: F811
    """The raw-id histories of the first 20 test users."""
    return raw_histories(models[0], 20)


@pytest.fixture(scope="module")
def drafted(models) -> Iterator[str]:  # noqa: F811
    """A tree-beam server with the draft loaded (so dsbd can run); its URL."""
    target, draft = models
    with server(target, "--draft", str(draft), "--decoder", "tree-beam") as (url, _):
        yield url


def post_raw(url: str, body: bytes, path: str = "/v1/recommend") -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)


def refusal(response: httpx.Response, status: int, kind: str) -> str:
    """The message of a refusal in OpenAI's error shape, checked to have ``status`` and ``kind`` (as type and code)."""
    assert response.status_code == status, response.text[:300]
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["type"] == body["error"]["code"] == kind, body
    return body["error"]["message"]


def test_odd_bodies_are_refused_in_the_service_shape(drafted, histories) -> None:
    url, history = drafted, histories[0]
    decoded = metric(url, "recspec_batch_size_count")
    good = b'"' + '", "'.join(history).encode() + b'"'
    surrogates = [b'{"history": [' + good + b', "\\ud800"]}', b'{"history": [' + good + b'], "exclude": ["\\udfff"]}',
                  b'{"history": [' + good + b'], "decoder": "tree-\\ud83d"}']
    for body in surrogates:
        assert "lone surrogate" in refusal(post_raw(url, body), 422, "invalid")
    chat = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    assert "lone surrogate" in refusal(post_raw(url, chat, "/v1/chat/completions"), 422, "invalid")
    nested = b"[" * 50_000 + b"]" * 50_000
    for body in (nested, b'{"history": ' + nested + b"}", b'{"history": ["\xff\xfe\xfa"]}', b"\xc3\x28",
                 b'{"history": ["1"], "k": ' + b"9" * 5000 + b"}"):
        refusal(post_raw(url, body), 400, "malformed_json")
    digits = b"9" * 401
    assert "timeout_ms" in refusal(post_raw(url, b'{"history": [' + good + b'], "timeout_ms": ' + digits + b"}"),
                                   422, "invalid")
    assert "k: Input should be less than" in refusal(
        post_raw(url, b'{"history": [' + good + b'], "k": ' + digits + b"}"), 422, "invalid")
    assert "k: Input should be greater" in refusal(
        post_raw(url, b'{"history": [' + good + b'], "k": -' + digits + b"}"), 422, "invalid")
    refusal(post_raw(url, b'{"messages": [{"role": "user", "content": "hi"}], "n": ' + digits + b"}",
                     "/v1/chat/completions"), 422, "invalid")
    refusal(httpx.get(f"{url}/no-such-endpoint"), 404, "not_found")
    refusal(httpx.get(f"{url}/v1/recommend"), 405, "method_not_allowed")
    assert metric(url, "recspec_batch_size_count") == decoded  # nothing was decoded
    ok = httpx.post(f"{url}/v1/recommend", json={"history": history, "k": K}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["items"]) == K and ok.json()["fewer_reason"] is None


def test_dsbd_answers_with_fewer_items_say_why(models, drafted, histories) -> None:  # noqa: F811
    """dsbd draws its k beams independently, with replacement: repeated draws give fewer distinct
    items (exclusions that leave exactly k items make it likely); every such answer says why."""
    url = drafted
    keys = list(Recommender.load(models[0]).index.item_keys)
    left, exclude = keys[:K], keys[K:]  # exclusions that leave exactly k items
    answers = [httpx.post(f"{url}/v1/recommend", json={"history": history, "k": K, "decoder": "dsbd", **extra},
                          timeout=60).json()
               for history in histories for extra in ({}, {"exclude": exclude})]
    for answer in answers:
        assert answer["decoder"] == "dsbd" and len(set(answer["items"])) == len(answer["items"]), answer
        if len(answer["items"]) < K:
            assert "with replacement" in answer["fewer_reason"]
            assert f"{K - len(answer['items'])} of the draws repeated an item" in answer["fewer_reason"]
        else:
            assert answer["fewer_reason"] is None
    narrowed = answers[1::2]
    assert all(set(answer["items"]) <= set(left) for answer in narrowed)
    assert any(len(answer["items"]) < K for answer in narrowed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def limited_server(target: Path, *args: str) -> Iterator[str]:
    """``recspec serve`` over ``target`` with at most :data:`FILE_LIMIT` open files (soft and hard:
    it cannot raise them), ready; its URL. Stopped with SIGTERM on exit."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))

    with running_server(["--target", str(target), "--threads", "1", *args], setup=limit) as (url, _):
        yield url


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (end of stream or reset), without waiting."""
    sock.settimeout(0.01)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_slow_connections_leave_health_answering(models, histories) -> None:  # noqa: F811
    """300 connections that send nothing, half a request line and headers, or a body that never
    ends, on a server allowed fewer open files than that: /health and a request are answered at
    once (the connections that waited longest are closed to make room), and every idle one is
    closed by the server within the request deadline (--timeout-s 3)."""
    target, _ = models
    with limited_server(target, "--decoder", "tree-beam", "--timeout-s", "3") as url:
        port = int(url.rsplit(":", 1)[1])
        clients: list[socket.socket] = []
        try:
            for i in range(IDLE):
                client = socket.create_connection(("127.0.0.1", port), timeout=5)
                clients.append(client)
                if i % 3 == 1:
                    client.sendall(b"POST /v1/recommend HTTP/1.1\r\nHost: x\r\n")
                elif i % 3 == 2:
                    client.sendall(b"POST /v1/recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: 1000\r\n\r\n{")
            started = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ready"
            answer = httpx.post(f"{url}/v1/recommend", json={"history": histories[0], "k": K}, timeout=10)
            assert answer.status_code == 200 and len(answer.json()["items"]) == K
            assert time.monotonic() - started < 10
            deadline = time.monotonic() + 15  # the request deadline and then some
            while not all(closed_by_server(client) for client in clients) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert all(closed_by_server(client) for client in clients), "idle connections were kept open"
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        finally:
            for client in clients:
                client.close()


def test_a_busy_port_is_refused_before_anything_loads(models) -> None:  # noqa: F811
    target, _ = models
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "recspec.cli", "serve", "--target", str(target), "--port",
                              str(port)], capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - started
    assert run.returncode == 2, run.stderr
    assert run.stderr == (f"error: --port {port}: 127.0.0.1:{port} is already in use; stop what listens there or "
                          f"choose another --port\n")
    assert "Loading" not in run.stdout + run.stderr and "startup" not in run.stdout + run.stderr
    assert seconds < 30, f"{seconds:.1f} s to refuse a busy port"


def listing(*folders: Path) -> list[tuple[str, int, int]]:
    """Every file under ``folders``: path, size and modification time."""
    return sorted((str(path), path.stat().st_size, path.stat().st_mtime_ns)
                  for folder in folders for path in folder.rglob("*") if path.is_file())


def test_auto_answers_an_unmeasured_k_at_once_and_writes_nothing(models, histories,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    """An auto server makes its choices for --auto-k before it is ready; a request for another k
    is answered by tree-beam at once, within its deadline, while that k is measured in the
    background (a request for a measured k meanwhile is not held up), and then by auto's choice.
    Nothing is written into the model folders: the measurements stay in memory."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(models[0], target)
    shutil.copytree(models[1], draft)
    before = listing(target, draft)
    with server(target, "--draft", str(draft), "--decoder", "auto", "--max-batch", "2",
                "--auto-k", str(K)) as (url, _):
        def made() -> set[tuple[int, int]]:
            rows = httpx.get(f"{url}/v1/models").json()["data"][0]["auto"]
            return {(row["k"], row["batch"]) for row in rows}

        assert made() == {(K, 1), (K, 2)}
        first = httpx.post(f"{url}/v1/recommend", json={"history": histories[0], "k": 5, "timeout_ms": 5000},
                           timeout=10)
        assert first.status_code == 200, first.text
        assert first.json()["decoder"] == "tree-beam" and len(first.json()["items"]) == 5
        assert (5, 1) not in made(), "the choice for k=5 was made before the request was answered"
        other = httpx.post(f"{url}/v1/recommend", json={"history": histories[1], "k": K, "timeout_ms": 5000},
                           timeout=10)
        assert other.status_code == 200 and other.json()["requested_decoder"] == "auto"
        deadline = time.monotonic() + 300
        while not {(5, 1), (5, 2)} <= made() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert {(5, 1), (5, 2)} <= made(), "k=5 was never measured in the background"
        again = httpx.post(f"{url}/v1/recommend", json={"history": histories[0], "k": 5}, timeout=30)
        assert again.status_code == 200 and again.json()["items"] == first.json()["items"]
    assert listing(target, draft) == before
