"""`recspec serve` as OpenAI-compatible clients and operators meet it, for real: uvicorn in a
subprocess on 127.0.0.1 (a free port), the `openai` Python client, httpx and curl, the tiny
trained target and draft. API keys on every route but the health checks and metrics (never
logged), served names instead of paths, OpenAI's error shape, /v1/completions with and without
`stream`, metrics that move under load with the decode in a worker process (which stops with
the server), the exposure warning, and `recspec bench serve` side by side and as a short soak."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from recspec.bench.serve import process_tree, running_server
from recspec.recommend import DecodeOptions, Recommender
from recspec.serve.access import exposure_warning, loopback
from recspec.serve.config import ServeConfig
from tests.test_serve import K, expected, metric, models, post_all, series  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "s3cret-key-for-tests"
NAME = "movies"
AUTH = {"Authorization": f"Bearer {KEY}"}
USERS = 8  # users whose prompts are sent


@pytest.fixture(scope="module")
def keyed(models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:  # noqa: F811
    """A server over the target and draft with RECSPEC_API_KEY set and a served name; its URL and
    the file its output goes to."""
    target, draft = models
    log = tmp_path_factory.mktemp("keyed") / "serve.log"
    with running_server(["--target", str(target), "--draft", str(draft), "--threads", "1", "--decoder", "tree-beam",
                         "--served-model-name", NAME], env={"RECSPEC_API_KEY": KEY}, log=log) as (url, _):
        yield url, log


@pytest.fixture(scope="module")
def prompts(models) -> list[str]:  # noqa: F811
    """The prompts of the first USERS test users as text (the answers of `expected` are theirs)."""
    recommender = Recommender.load(models[0])
    tokens = recommender.encoder.prompts(recommender.examples("test", USERS))
    return [recommender.tokenizer.decode(prompt.tolist()) for prompt in tokens]


def test_settings_for_the_worker_carry_no_key() -> None:
    config = ServeConfig(Path("models/target"), draft="models/draft", options=DecodeOptions(gamma=2), threads=3,
                         auto_k=(5, 10), api_key=KEY, decode_process=True)
    assert KEY not in config.settings() and KEY not in repr(config)
    again = ServeConfig.from_settings(config.settings())
    assert again == ServeConfig(Path("models/target"), draft="models/draft", options=DecodeOptions(gamma=2),
                                threads=3, auto_k=(5, 10))
    assert config.model_name == "target" and ServeConfig(Path("x"), served_model_name=NAME).model_name == NAME


def test_exposure_warning_names_hosts_beyond_this_machine() -> None:
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost") and loopback("[::1]")
    assert not loopback("0.0.0.0") and not loopback("::") and not loopback("no-such-host.invalid")
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("0.0.0.0", KEY) is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and "--api-key" in warning and "\n" not in warning


def test_keys_guard_every_route_but_health_and_metrics(keyed, expected) -> None:  # noqa: F811
    url, _ = keyed
    for path in ("/health", "/health/live", "/health/ready", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    assert httpx.get(f"{url}/health/live").json()["status"] == "live"
    body = {"history": expected[0]["history"], "k": K}
    refused = [httpx.get(f"{url}/v1/models"), httpx.post(f"{url}/v1/recommend", json=body),
               httpx.post(f"{url}/v1/completions", json={"prompt": "x"}), httpx.get(f"{url}/no-such-endpoint"),
               httpx.get(f"{url}/v1/models", headers={"Authorization": KEY}),  # no scheme
               httpx.get(f"{url}/v1/models", headers={"Authorization": f"Basic {KEY}"}),
               httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}x"}),
               httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY[:-1]}"})]
    for response in refused:
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", response.text
        error = response.json()["error"]
        assert error["type"] == error["code"] == "invalid_api_key" and error["param"] is None
    assert "needs an API key" in refused[0].json()["error"]["message"]
    assert "wrong" in refused[-1].json()["error"]["message"]
    assert metric(url, "recspec_errors_total", 'kind="invalid_api_key"') >= len(refused)
    answered = httpx.post(f"{url}/v1/recommend", json=body, headers={"Authorization": f"bearer {KEY}"}, timeout=60)
    assert answered.status_code == 200 and answered.json()["items"] == expected[0]["items"]
    listed = httpx.get(f"{url}/v1/models", headers=AUTH).json()
    assert [model["id"] for model in listed["data"]] == [NAME] and listed["data"][0]["draft"] == ["draft"]


def test_the_key_is_never_logged(models, tmp_path: Path) -> None:  # noqa: F811
    target, _ = models
    log = tmp_path / "serve.log"
    with running_server(["--target", str(target), "--threads", "1", "--decoder", "tree-beam", "--api-key", KEY],
                        log=log) as (url, _):
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == target.name
    text = log.read_text()
    assert "ready" in text and KEY not in text


def test_openai_client_completions_equal_recommend(keyed, expected, prompts) -> None:  # noqa: F811
    url, _ = keyed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [model.id for model in client.models.list()] == [NAME]
    for prompt, row in zip(prompts, expected):
        answer = client.completions.create(model=NAME, prompt=prompt, n=K)
        assert answer.model == NAME and answer.object == "text_completion"
        assert [choice.item for choice in answer.choices] == row["items"]
        assert [choice.index for choice in answer.choices] == list(range(K))
        assert all(choice.finish_reason == "stop" and choice.text.startswith("<") for choice in answer.choices)
        streamed = list(client.completions.create(model=NAME, prompt=prompt, n=K, stream=True))
        assert len(streamed) == K  # one event per item, then [DONE]
        assert [chunk.choices[0].text for chunk in streamed] == [choice.text for choice in answer.choices]
        assert [chunk.choices[0].index for chunk in streamed] == list(range(K))
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.completions.create(model=NAME, prompt=prompts[0], n=0)
    assert refused.value.code == refused.value.type == "bad_k" and refused.value.param == "n"
    with pytest.raises(openai.UnprocessableEntityError) as refused:  # a stream refused before it starts
        client.completions.create(model=NAME, prompt=prompts[0], n=K, stream=True, extra_body={"decoder": "fastest"})
    assert refused.value.code == "unknown_decoder" and refused.value.param == "decoder"
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model=NAME, messages=[{"role": "developer", "content": "hi"}])
    assert refused.value.code == "not_chat"
    with pytest.raises(openai.UnprocessableEntityError) as refused:  # a word the vocabulary lacks: no 500
        client.completions.create(model=NAME, prompt="hello", n=K)
    assert refused.value.code == "bad_prompt" and refused.value.param == "prompt"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_curl_sends_the_key_and_reads_the_stream(keyed, expected, prompts) -> None:  # noqa: F811
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    url, _ = keyed
    body = json.dumps({"model": NAME, "prompt": prompts[0], "n": K, "stream": True})
    run = subprocess.run([curl, "-sS", "-N", "-H", f"Authorization: Bearer {KEY}", "-H",
                          "Content-Type: application/json", "-d", body, f"{url}/v1/completions"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    events = [line.removeprefix("data: ") for line in run.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == K + 1, run.stdout
    assert [json.loads(event)["choices"][0]["item"] for event in events[:-1]] == expected[0]["items"]
    denied = subprocess.run([curl, "-sS", "-o", "/dev/null", "-w", "%{http_code}", f"{url}/v1/models"],
                            capture_output=True, text=True, timeout=60)
    assert denied.stdout == "401"


def test_a_server_beyond_loopback_without_a_key_warns_in_one_line(models) -> None:  # noqa: F811
    target, _ = models
    with socket.socket() as busy:  # the port is taken: the command stops right after the warning
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = [sys.executable, "-m", "recspec.cli", "serve", "--target", str(target), "--port", str(port)]
        exposed = subprocess.run([*command, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120,
                                 env={k: v for k, v in os.environ.items() if k != "RECSPEC_API_KEY"})
        keyed = subprocess.run([*command, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "RECSPEC_API_KEY": KEY})
    assert exposed.returncode == keyed.returncode == 2
    lines = exposed.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("warning: --host 0.0.0.0 serves beyond this machine")
    assert lines[1].startswith("error: --port"), exposed.stderr
    assert "warning" not in keyed.stderr and keyed.stderr.startswith("error: --port")


def test_metrics_move_under_load_with_the_decode_in_a_worker(models, expected) -> None:  # noqa: F811
    """Every metric the service declares, read before and after a load (and during it, for the
    gauges): each moves as it should. The decode runs in a worker process, which exits with the server."""
    target, draft = models
    good = [{"history": row["history"], "k": K} for row in expected[:24]]
    bad = [{"history": [*row["history"], "no-such-item"], "k": K} for row in expected[:5]]
    with running_server(["--target", str(target), "--draft", str(draft), "--threads", "1", "--decoder", "spec-strict",
                         "--decode-process", "--max-batch", "64", "--max-wait-ms", "1000"]) as (url, process):
        workers = process_tree(process.pid)[1:]
        assert workers, "no decode worker process"  # (and multiprocessing's resource tracker)
        before = httpx.get(f"{url}/metrics").text
        seen = {"recspec_queue_depth": 0.0, "recspec_batch_in_flight": 0.0}
        stop = threading.Event()

        def watch() -> None:
            with httpx.Client(base_url=url) as client:
                while not stop.is_set():
                    text = client.get("/metrics").text
                    for name in seen:
                        seen[name] = max(seen[name], series(text, name))

        watcher = threading.Thread(target=watch)
        watcher.start()
        rounds = 0
        try:
            while rounds < 5 and not all(seen.values()):  # the decode of a batch is short: a few tries
                responses = asyncio.run(post_all(url, good + bad))
                assert [r.status_code for r in responses] == [200] * len(good) + [422] * len(bad)
                rounds += 1
        finally:
            stop.set()
            watcher.join()
        after = httpx.get(f"{url}/metrics").text
        info = httpx.get(f"{url}/v1/models").json()["data"][0]
        replica = httpx.get(f"{url}/health/ready").json()["replica"]
    assert info["decode_process"] is True
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits once the server has
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in workers), "the decode worker outlived the server"
    assert seen["recspec_queue_depth"] >= len(good) and seen["recspec_batch_in_flight"] >= 1, seen

    def moved(name: str, labels: str = "") -> float:
        return series(after, name, labels) - series(before, name, labels)

    answered = rounds * len(good)
    assert moved("recspec_requests_total", 'endpoint="recommend",status="200"') == answered
    assert moved("recspec_requests_total", 'endpoint="recommend",status="422"') == rounds * len(bad)
    assert moved("recspec_errors_total", 'kind="unknown_items"') == rounds * len(bad)
    batches = moved("recspec_batch_size_count")
    assert 1 <= batches < answered and moved("recspec_batch_size_sum") == answered
    assert moved("recspec_batch_decode_seconds_count") == batches and moved("recspec_batch_decode_seconds_sum") > 0
    assert abs(moved("recspec_batches_total", 'decoder="spec-strict"') - batches) < 1e-6
    assert moved("recspec_request_latency_seconds_count", 'endpoint="recommend"') == answered
    assert moved("recspec_request_latency_seconds_sum", 'endpoint="recommend"') > 0
    assert moved("recspec_target_calls_total") >= answered
    assert 0 < moved("recspec_accepted_steps_total") <= moved("recspec_drafted_steps_total")
    assert series(after, "recspec_queue_depth") == 0 and series(after, "recspec_batch_in_flight") == 0
    assert series(after, "recspec_replica_info", f'replica="{replica}"') == 1
    declared = {line.split()[2] for line in after.splitlines() if line.startswith("# TYPE")}
    assert declared == {"recspec_replica_info", "recspec_requests_total", "recspec_errors_total", "recspec_queue_depth",
                        "recspec_batch_in_flight", "recspec_batch_size", "recspec_batches_total",
                        "recspec_request_latency_seconds", "recspec_batch_decode_seconds",
                        "recspec_drafted_steps_total", "recspec_accepted_steps_total",
                        "recspec_target_calls_total"}, declared  # each one checked above


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (neither gone nor a zombie waiting to be reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recspec.cli", "bench", "serve", *args], capture_output=True,
                          text=True, timeout=600)


def test_bench_serve_puts_the_worker_process_beside_the_thread(models, tmp_path: Path) -> None:  # noqa: F811
    target, _ = models
    run = run_bench("--target", str(target), "--decoder", "tree-beam", "--concurrency", "1", "--concurrency", "4",
                    "--users", "8", "--requests", "8", "--repeats", "1", "--batching", "on", "--max-seconds", "20",
                    "--out", str(tmp_path), "--name", "side")
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((tmp_path / "side.json").read_text())
    assert {(c["decode"], c["concurrency"]) for c in results["cells"] if c["mode"] == "closed"} == {
        ("thread", 1), ("thread", 4), ("process", 1), ("process", 4)}
    assert all(c["wrong"] == 0 and c["lost"] == 0 for c in results["cells"])
    assert [(row["concurrency"], row["rps_ratio"] > 0) for row in results["decode_places"]] == [(1, True), (4, True)]
    assert "Decode worker process against decode thread" in (tmp_path / "side.md").read_text()
    refused = run_bench("--target", str(target), "--decoder", "tree-beam", "--decode", "fork", "--out", str(tmp_path))
    assert refused.returncode == 2 and "--decode takes thread or process, got fork" in refused.stderr


def test_a_short_soak_answers_right_and_loses_nothing(models, tmp_path: Path) -> None:  # noqa: F811
    target, _ = models
    started = time.monotonic()
    run = run_bench("--target", str(target), "--decoder", "tree-beam", "--decode", "process", "--soak", "0.1",
                    "--users", "16", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert time.monotonic() - started < 300, "the soak did not stop by itself"
    results = json.loads((tmp_path / "serve-soak.json").read_text())
    assert results["wrong"] == results["lost"] == results["server_errors"] == results["server_internal_errors"] == 0
    assert results["alive_after"] and results["sent"] > 0 and results["rss_end"] > 0
    kinds = {key.split("/")[0] for key in results["outcomes"]}
    assert kinds <= {"good", "bad_json", "unknown_items", "huge_body", "disconnect", "deadline"} and "good" in kinds
    assert results["outcomes"].get("good/ok", 0) > 0
    assert "accepted requests lost" in (tmp_path / "serve-soak.md").read_text()
