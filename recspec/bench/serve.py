"""`recspec bench serve`: the HTTP service under load, batching on and off, side by side.

For every decoder and for batching on (``--max-batch``) and off (``--max-batch 1``: one request
at a time), one real server (``recspec serve`` in a subprocess on a free loopback port) answers
a load generator (httpx, asyncio) run from this process:

* closed loop at each concurrency (C clients, each sending its next request when the last is
  answered; a bounded number of requests and seconds per run; run order rotated between
  repeats, the median of the repeats reported): requests/s, p50 / p95 / p99 latency, the batch
  sizes the requests were decoded in;
* open loop at twice the sustainable rate (Poisson arrivals at 2x the best closed-loop
  requests/s of batching on): every request is answered right, refused with 503, or counted
  lost (anything else), so overload is shown to shed load without losing or mixing answers.

Every 200 is checked against the answer of tree-beam computed in this process before the
servers start (same items, scores within 1e-4). The server gets the cores the load generator
does not use (pinned, when the machine has two or more), so client and decoder do not fight
over a core: on two cores the server runs one torch thread, the generator the other core.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from recspec.bench.report import markdown_table, new_figure, save_figure, write_results
from recspec.errors import RecspecError
from recspec.recommend import TREE_BEAM, Recommender
from recspec.ready import wait_until_ready

READY_SECONDS = 300  # model loading and auto's first measurements
#: Where a measured server decodes: a thread of its own process, or a worker process.
DECODES = ("thread", "process")


def _cores() -> tuple[set[int], set[int]]:
    """(load generator's cores, server's cores): one core for the generator when there are two or more."""
    cores = sorted(os.sched_getaffinity(0))
    return (set(cores), set(cores)) if len(cores) < 2 else ({cores[0]}, set(cores[1:]))


def prepare(cores: set[int] | None, setup: Callable[[], None] | None) -> None:
    """In a server's process before it starts: pin it to ``cores``, then run ``setup``."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if setup is not None:
        setup()


@contextmanager
def running_server(args: Sequence[str], cores: set[int] | None = None, setup: Callable[[], None] | None = None,
                   env: dict[str, str] | None = None, log: Path | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """``recspec serve ARGS`` on a free loopback port (pinned to ``cores``; ``setup`` run in the
    server's process before it starts, e.g. to set its limits; ``env`` added to its environment),
    ready (GET /health is 200, from each of its ``--replicas``); yields its URL and process;
    stopped with SIGTERM on exit. Its output goes to ``log`` (default a temporary file), quoted
    when it fails to start."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    output = tempfile.TemporaryFile("w+") if log is None else log.open("w+")
    process = subprocess.Popen([sys.executable, "-m", "recspec.cli", "serve", "--port", str(port), *args],
                               stdout=output, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                               preexec_fn=lambda: prepare(cores, setup))
    url = f"http://127.0.0.1:{port}"

    def failed(why: str) -> RecspecError:
        output.seek(0)
        return RecspecError(f"{why}: {' | '.join(output.read().strip().splitlines()[-3:])}")

    def running() -> None:
        if process.poll() is not None:
            raise failed(f"the server exited with status {process.returncode}")

    replicas = int(args[list(args).index("--replicas") + 1]) if "--replicas" in args else 1
    try:
        if not wait_until_ready(url, READY_SECONDS, running, replicas):
            raise failed(f"the server (its {replicas} replica(s)) was not ready within {READY_SECONDS} s")
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        output.close()


class Load:
    """Requests over the histories ``bodies`` and a check of each answer against ``expected``."""

    def __init__(self, url: str, bodies: list[dict], expected: list[dict]) -> None:
        self.url, self.bodies, self.expected = url, bodies, expected

    def check(self, i: int, response: httpx.Response) -> str:
        """'ok', 'wrong', 'rejected' (503) or 'lost' (anything else)."""
        if response.status_code == 503:
            return "rejected"
        if response.status_code != 200:
            return "lost"
        got, want = response.json(), self.expected[i]
        close = len(got["scores"]) == len(want["scores"]) and np.allclose(got["scores"], want["scores"], atol=1e-4)
        return "ok" if got["items"] == want["items"] and close else "wrong"

    async def one(self, client: httpx.AsyncClient, i: int, log: list) -> None:
        started = time.perf_counter()
        try:
            response = await client.post("/v1/recommend", json=self.bodies[i])
        except httpx.HTTPError:
            log.append(("lost", time.perf_counter() - started, 0))
            return
        outcome = self.check(i, response)
        size = response.json()["stats"]["batch_size"] if outcome in ("ok", "wrong") else 0
        log.append((outcome, time.perf_counter() - started, size))

    def client(self, connections: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                              keepalive_expiry=CLIENT_KEEPALIVE_S)
        return httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits)

    async def closed(self, concurrency: int, requests: int, max_seconds: float) -> dict[str, Any]:
        log: list = []
        order = iter(range(requests))
        stop = time.perf_counter() + max_seconds

        async def worker(client: httpx.AsyncClient) -> None:
            for i in order:
                if time.perf_counter() > stop:
                    return
                await self.one(client, i % len(self.bodies), log)

        async with self.client(concurrency) as client:
            started = time.perf_counter()
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
            seconds = time.perf_counter() - started
        return summarize(log, seconds)

    async def open(self, rate: float, requests: int, max_seconds: float, seed: int = 0) -> dict[str, Any]:
        log: list = []
        rng = random.Random(seed)
        async with self.client(256) as client:
            started = time.perf_counter()
            tasks = []
            due = 0.0
            for i in range(requests):
                due += rng.expovariate(rate)
                if due > max_seconds:
                    break
                await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
                tasks.append(asyncio.ensure_future(self.one(client, i % len(self.bodies), log)))
            await asyncio.gather(*tasks)
            seconds = time.perf_counter() - started
        return {**summarize(log, seconds), "rate": rate, "sent": len(tasks)}


def summarize(log: list, seconds: float) -> dict[str, Any]:
    """Counts by outcome, answered requests/s, latency percentiles of answered requests (ms), batch sizes."""
    outcomes = Counter(outcome for outcome, _, _ in log)
    latencies = sorted(1e3 * seconds_ for outcome, seconds_, _ in log if outcome in ("ok", "wrong"))

    def percentile(q: float) -> float:
        return latencies[min(len(latencies) - 1, math.ceil(q * len(latencies)) - 1)] if latencies else math.nan

    sizes = Counter(size for outcome, _, size in log if outcome in ("ok", "wrong"))
    return {"requests": len(log), "ok": outcomes["ok"], "wrong": outcomes["wrong"], "rejected": outcomes["rejected"],
            "lost": outcomes["lost"], "seconds": seconds, "rps": (outcomes["ok"] + outcomes["wrong"]) / seconds,
            "p50_ms": percentile(0.5), "p95_ms": percentile(0.95), "p99_ms": percentile(0.99),
            "batch_sizes": {str(size): count for size, count in sorted(sizes.items())}}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over repeats (counts summed)."""
    out = {key: statistics.median(run[key] for run in runs) for key in ("rps", "p50_ms", "p95_ms", "p99_ms")}
    for key in ("requests", "ok", "wrong", "rejected", "lost"):
        out[key] = sum(run[key] for run in runs)
    sizes: Counter = Counter()
    for run in runs:
        sizes.update({int(k): v for k, v in run["batch_sizes"].items()})
    out["batch_sizes"] = {str(k): v for k, v in sorted(sizes.items())}
    out["runs"] = runs
    return out


def expected_answers(target: Path, device: str, k: int, users: int) -> tuple[list[dict], list[dict]]:
    """Request bodies of the first ``users`` test users and tree-beam's answers to them, computed
    here with the server's models on ``device`` (what every 200 is checked against)."""
    recommender = Recommender.load(target, device=device)
    examples = recommender.examples("test", users)
    decoded = recommender.recommend(examples, k, TREE_BEAM, 16)
    keys = recommender.index.item_keys
    item_ids = recommender.dataset.item_ids
    bodies = [{"history": [item_ids[i] for i in examples.history_of(row)], "k": k} for row in range(len(examples))]
    expected = [{"items": [keys[i] for i in items], "scores": scores}
                for items, scores in zip(decoded.topk.items.tolist(), decoded.topk.scores.tolist())]
    return bodies, expected


def server_args(target: Path, draft: Path | None, decoder: str, max_batch: int, cores: set[int], device: str,
                decode: str) -> list[str]:
    """``recspec serve`` arguments of one measured server (``decode``: "thread" or "process")."""
    args = ["--target", str(target), "--decoder", decoder, "--max-batch", str(max_batch), "--threads",
            str(len(cores)), "--device", device, "--decode-process" if decode == "process" else "--no-decode-process"]
    return args + (["--draft", str(draft)] if draft is not None and decoder != TREE_BEAM else [])


def run_serve(out: Path, target: Path, draft: Path | None, decoders: Sequence[str], concurrency: Sequence[int], k: int,
              users: int, requests: int, repeats: int, max_batch: int, max_seconds: float, name: str,
              device: str = "cpu", decodes: Sequence[str] = DECODES, batchings: Sequence[str] = ("on", "off")) -> str:
    """Measure every decoder x decode place (``decodes``: in a thread of the server, in a worker
    process) x batching (``batchings``) x concurrency (module doc) with the server's models on
    ``device``; write ``name``.json/.md/.png."""
    client_cores, server_cores = _cores()
    os.sched_setaffinity(0, client_cores)
    import torch

    torch.set_num_threads(len(client_cores))
    bodies, expected = expected_answers(target, device, k, users)
    cells: list[dict[str, Any]] = []
    for decoder in decoders:
        for decode in decodes:
            for batching in batchings:
                size = max_batch if batching == "on" else 1
                args = server_args(target, draft, decoder, size, server_cores, device, decode)
                with running_server(args, server_cores) as (url, _):
                    load = Load(url, bodies, expected)
                    for c in sorted(set(concurrency)):  # warm-up: auto's choices, caches, allocator
                        asyncio.run(load.closed(c, max(8, 2 * c), max_seconds))
                    runs: dict[int, list] = {c: [] for c in concurrency}
                    for r in range(repeats):
                        order = list(concurrency)[r % len(concurrency):] + list(concurrency)[:r % len(concurrency)]
                        for c in order:
                            runs[c].append(asyncio.run(load.closed(c, max(requests, 4 * c), max_seconds)))
                    mine = {"decoder": decoder, "decode": decode, "batching": batching}
                    for c in concurrency:
                        cells.append({**mine, "mode": "closed", "concurrency": c, **_median_run(runs[c])})
                    if batching == "on":
                        best = max(cell["rps"] for cell in cells if _matches(cell, mine) and cell["mode"] == "closed")
                        overload = asyncio.run(load.open(2 * best, 4 * requests, max_seconds))
                        cells.append({**mine, "mode": "open", **overload})
    results = {"target": str(target), "draft": str(draft) if draft else None, "k": k, "users": users,
               "requests_per_run": requests, "repeats": repeats, "max_batch": max_batch, "device": device,
               "client_cores": sorted(client_cores), "server_cores": sorted(server_cores),
               "summary": _summary(cells, decoders, decodes), "decode_places": _places(cells, decoders, concurrency),
               "cells": cells}
    markdown = _markdown(results)
    json_path, md_path = write_results(out, name, results, markdown)
    _plot(out / f"{name}.png", cells)
    return f"{markdown}\nwrote {json_path}, {md_path} and {out / f'{name}.png'}"


def _matches(cell: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return all(cell.get(key) == value for key, value in wanted.items())


def _cell(cells: list[dict], decoder: str, batching: str, concurrency: int, decode: str) -> dict | None:
    wanted = {"decoder": decoder, "batching": batching, "mode": "closed", "concurrency": concurrency, "decode": decode}
    return next((cell for cell in cells if _matches(cell, wanted)), None)


def _summary(cells: list[dict], decoders: Sequence[str], decodes: Sequence[str]) -> list[dict[str, Any]]:
    """Per decoder and decode place: requests/s of batching on over off at concurrency 16
    (target >= 3x), p99 at 16 over the unloaded p50 (concurrency 1; target < 4x), and the overload
    run's outcome."""
    rows = []
    for decoder in decoders:
        for decode in decodes:
            on, off = _cell(cells, decoder, "on", 16, decode), _cell(cells, decoder, "off", 16, decode)
            idle = _cell(cells, decoder, "on", 1, decode)
            overload = next((c for c in cells if _matches(c, {"decoder": decoder, "decode": decode, "mode": "open"})),
                            None)
            rows.append({"decoder": decoder, "decode": decode,
                         "speedup_c16": on["rps"] / off["rps"] if on and off else None,
                         "p99_c16_over_unloaded_p50": on["p99_ms"] / idle["p50_ms"] if on and idle else None,
                         "overload": None if overload is None else {
                             key: overload[key] for key in ("rate", "sent", "ok", "wrong", "rejected", "lost")}})
    return rows


def _places(cells: list[dict], decoders: Sequence[str], concurrency: Sequence[int]) -> list[dict[str, Any]]:
    """Per decoder and concurrency (batching on): the decode worker process against the decode
    thread, requests/s and p50 / p99 side by side, and their ratios (process over thread)."""
    rows = []
    for decoder in decoders:
        for c in concurrency:
            thread, process = _cell(cells, decoder, "on", c, "thread"), _cell(cells, decoder, "on", c, "process")
            if thread is None or process is None:
                continue
            rows.append({"decoder": decoder, "concurrency": c,
                         **{f"{key}_{place}": cell[key] for place, cell in (("thread", thread), ("process", process))
                            for key in ("rps", "p50_ms", "p99_ms")},
                         "rps_ratio": process["rps"] / thread["rps"], "p50_ratio": process["p50_ms"] / thread["p50_ms"],
                         "p99_ratio": process["p99_ms"] / thread["p99_ms"]})
    return rows


def _markdown(results: dict[str, Any]) -> str:
    cells = results["cells"]
    closed = [c for c in cells if c["mode"] == "closed"]
    lines = ["# Serving under load (`recspec bench serve`)\n",
             f"Target `{results['target']}`, draft `{results['draft']}`, K = {results['k']}, histories of "
             f"{results['users']} test users; closed loop: at least {results['requests_per_run']} requests per run, "
             f"median of {results['repeats']} runs; server on cores {results['server_cores']}, load generator on "
             f"{results['client_cores']}; batching on = `--max-batch {results['max_batch']}`, off = `--max-batch 1`; "
             f"decode in a thread of the server (`--no-decode-process`) or a worker process (`--decode-process`).\n",
             markdown_table(["decoder", "decode", "batching", "clients", "req/s", "p50 ms", "p95 ms", "p99 ms",
                             "answered", "wrong", "503", "lost", "batch sizes (requests)"],
                            [[c["decoder"], c["decode"], c["batching"], c["concurrency"], c["rps"], c["p50_ms"],
                              c["p95_ms"], c["p99_ms"], c["ok"] + c["wrong"], c["wrong"], c["rejected"], c["lost"],
                              " ".join(f"{s}:{n}" for s, n in c["batch_sizes"].items())] for c in closed])]
    if results["decode_places"]:
        lines += ["\nDecode worker process against decode thread (batching on; ratios process / thread).\n",
                  markdown_table(["decoder", "clients", "req/s thread", "req/s process", "p50 ms thread",
                                  "p50 ms process", "p99 ms thread", "p99 ms process", "req/s ratio", "p50 ratio",
                                  "p99 ratio"],
                                 [[r["decoder"], r["concurrency"], r["rps_thread"], r["rps_process"],
                                   r["p50_ms_thread"], r["p50_ms_process"], r["p99_ms_thread"], r["p99_ms_process"],
                                   r["rps_ratio"], r["p50_ratio"], r["p99_ratio"]] for r in results["decode_places"]])]
    lines += ["\nOverload: open loop, Poisson arrivals at twice the best closed-loop rate of batching on.\n",
              markdown_table(["decoder", "decode", "rate req/s", "sent", "answered right", "wrong", "503", "lost",
                              "p50 ms", "p99 ms"],
                             [[c["decoder"], c["decode"], c["rate"], c["sent"], c["ok"], c["wrong"], c["rejected"],
                               c["lost"], c["p50_ms"], c["p99_ms"]] for c in cells if c["mode"] == "open"]),
              "\nTargets: batching >= 3x the requests/s of one-at-a-time at 16 clients, p99 there < 4x the "
              "unloaded p50.\n",
              markdown_table(["decoder", "decode", "req/s on / off at 16 clients", "p99 at 16 / unloaded p50"],
                             [[row["decoder"], row["decode"], row["speedup_c16"], row["p99_c16_over_unloaded_p50"]]
                              for row in results["summary"]])]
    return "\n".join(lines)


def _plot(path: Path, cells: list[dict]) -> None:
    figure, axis = new_figure(figsize=(7, 4.5))
    for decoder, decode in sorted({(c["decoder"], c["decode"]) for c in cells}):
        for batching, style in (("on", "-o"), ("off", "--s")):
            points = sorted((c["concurrency"], c["rps"], c["p50_ms"]) for c in cells if c["mode"] == "closed"
                            and _matches(c, {"decoder": decoder, "decode": decode, "batching": batching}))
            if points:
                axis.plot([p[1] for p in points], [p[2] for p in points], style,
                          label=f"{decoder}, {decode}, batching {batching}")
                for concurrency, rps, p50 in points:
                    axis.annotate(str(concurrency), (rps, p50), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axis.set_xlabel("requests / s")
    axis.set_ylabel("p50 latency (ms)")
    axis.set_yscale("log")
    axis.set_title("recspec serve: latency vs throughput (labels: concurrent clients)")
    axis.legend(fontsize=8)
    save_figure(figure, path)


#: Seconds a client keeps an idle connection: well under the server's keep-alive timeout (uvicorn's
#: 5 s), so that no request is sent on a connection the server is closing at that moment (which
#: ends in "server disconnected", a request lost that the server never saw).
CLIENT_KEEPALIVE_S = 1.0
#: The mix of a soak's requests, kind: share (module doc of :func:`run_soak`).
SOAK_MIX = {"good": 0.70, "bad_json": 0.06, "unknown_items": 0.06, "huge_body": 0.06, "disconnect": 0.06,
            "deadline": 0.06}
#: What each kind of a soak's request may be answered, besides 503 (overloaded, counted apart).
SOAK_EXPECTED = {"good": {200}, "bad_json": {400}, "unknown_items": {422}, "huge_body": {413},
                 "disconnect": {200}, "deadline": {200, 504}}
#: The soak's server: its body limit in KiB (a huge body is twice it) and request deadline.
SOAK_BODY_KB, SOAK_TIMEOUT_S = 64, 10.0
#: Requests a soak keeps in flight at most: beyond it the next arrival waits, so the load is bounded.
SOAK_IN_FLIGHT = 256
#: Seconds between samples of the server's resident memory and open files during a soak.
SOAK_SAMPLE_S = 5.0
#: The soak's rate, as a share of the requests/s measured first in a closed loop of 16 clients.
SOAK_LOAD = 0.9
#: How long a disconnecting client waits for its answer before it hangs up (seconds).
HANG_UP_S = 0.005


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a decode worker), from /proc."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                queue += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def resources(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of ``pid`` and its descendants, from /proc."""
    rss = fds = 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
            rss += 1024 * int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
            fds += len(os.listdir(f"/proc/{member}/fd"))
        except (OSError, StopIteration):  # it exited meanwhile
            pass
    return rss, fds


class Soak:
    """A soak's requests over ``load``'s histories: good ones checked against the expected answers,
    and bad ones (:data:`SOAK_MIX`), each given an outcome: ``ok`` (an expected answer, a good one
    right), ``wrong``, ``rejected`` (503), ``server_error`` (another 5xx), ``lost`` (a request that
    should have been answered was not: a transport error or an unexpected status), ``hung_up`` (a
    disconnecting client that did hang up)."""

    def __init__(self, load: Load, body_limit: int, seed: int = 0) -> None:
        self.load, self.rng = load, random.Random(seed)
        filler = ", ".join(['"1"'] * (body_limit // 2))
        self.huge = f'{{"history": [{filler}]}}'.encode()
        self.kinds, self.weights = list(SOAK_MIX), list(SOAK_MIX.values())

    def request(self, kind: str, i: int) -> tuple[dict[str, Any], float | None]:
        """The keyword arguments of ``kind``'s POST /v1/recommend for history ``i``, and its read timeout."""
        body = self.load.bodies[i]
        json_headers = {"content-type": "application/json"}
        if kind == "bad_json":
            return {"content": b'{"history": ["1", ', "headers": json_headers}, None
        if kind == "unknown_items":
            return {"json": {**body, "history": [*body["history"], "no-such-item"]}}, None
        if kind == "huge_body":
            return {"content": self.huge, "headers": json_headers}, None
        if kind == "deadline":
            return {"json": {**body, "timeout_ms": 1}}, None
        return {"json": body}, HANG_UP_S if kind == "disconnect" else None

    async def one(self, client: httpx.AsyncClient, log: Counter) -> None:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        i = self.rng.randrange(len(self.load.bodies))
        arguments, read_timeout = self.request(kind, i)
        timeout = httpx.Timeout(SOAK_TIMEOUT_S * 3, read=read_timeout or SOAK_TIMEOUT_S * 3)
        try:
            response = await client.post("/v1/recommend", timeout=timeout, **arguments)
        except httpx.HTTPError:
            log[kind, "hung_up" if kind == "disconnect" else "lost"] += 1
            return
        status = response.status_code
        if status == 200 and kind in ("good", "disconnect", "deadline"):
            outcome = self.load.check(i, response)
        elif status == 503:
            outcome = "rejected"
        elif status >= 500 and status not in SOAK_EXPECTED[kind]:
            outcome = "server_error"
        else:
            outcome = "ok" if status in SOAK_EXPECTED[kind] else "lost"
        log[kind, outcome] += 1

    async def run(self, rate: float, seconds: float, pid: int) -> dict[str, Any]:
        """Poisson arrivals at ``rate`` for ``seconds`` (at most :data:`SOAK_IN_FLIGHT` in flight),
        sampling the server ``pid``'s memory and files every :data:`SOAK_SAMPLE_S` s."""
        log: Counter = Counter()
        samples: list[tuple[float, int, int]] = []
        slots = asyncio.Semaphore(SOAK_IN_FLIGHT)
        started = time.perf_counter()

        async def sample() -> None:
            while True:
                samples.append((time.perf_counter() - started, *resources(pid)))
                await asyncio.sleep(min(SOAK_SAMPLE_S, seconds / 10))

        async def sent(client: httpx.AsyncClient) -> None:
            try:
                await self.one(client, log)
            finally:
                slots.release()

        sampler = asyncio.ensure_future(sample())
        tasks = []
        async with self.load.client(SOAK_IN_FLIGHT) as client:
            due = 0.0
            while True:
                due += self.rng.expovariate(rate)
                if due > seconds:
                    break
                await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
                await slots.acquire()
                tasks.append(asyncio.ensure_future(sent(client)))
            await asyncio.gather(*tasks)
        sampler.cancel()
        samples.append((time.perf_counter() - started, *resources(pid)))
        return {"seconds": time.perf_counter() - started, "sent": len(tasks), "samples": samples,
                "outcomes": {f"{kind}/{outcome}": n for (kind, outcome), n in sorted(log.items())}}


def run_soak(out: Path, target: Path, draft: Path | None, minutes: float, k: int, users: int, decoder: str,
             decode: str, name: str, device: str = "cpu", seed: int = 0) -> str:
    """``recspec bench serve --soak MINUTES``: one server under mixed good and bad requests for
    ``minutes``, bounded and stopping by itself.

    The sustainable rate is measured first (a closed loop of 16 clients, a tenth of the time, at
    least 2 s and at most 20), then Poisson arrivals at :data:`SOAK_LOAD` of it send good
    requests and bad ones (:data:`SOAK_MIX`: malformed JSON, unknown items, bodies twice the
    limit, clients that hang up after :data:`HANG_UP_S`, deadlines of 1 ms). Reported: answers
    wrong (target 0), accepted requests lost (0), 500s (0, counted by the client and by the
    server's own metrics), the resident memory of the server (and its decode worker) at the end
    over its value after warm-up (the first fifth of the soak; target under 5% growth), and its
    open files before and after the soak with no client connected (target: flat). Linux only
    (/proc)."""
    client_cores, server_cores = _cores()
    os.sched_setaffinity(0, client_cores)
    import torch

    torch.set_num_threads(len(client_cores))
    bodies, expected = expected_answers(target, device, k, users)
    seconds = 60.0 * minutes
    args = [*server_args(target, draft, decoder, 16, server_cores, device, decode), "--max-body-kb",
            str(SOAK_BODY_KB), "--timeout-s", str(SOAK_TIMEOUT_S)]
    with running_server(args, server_cores) as (url, process):
        load = Load(url, bodies, expected)
        measured = asyncio.run(load.closed(16, 10**9, min(20.0, max(2.0, seconds / 10))))
        rate = SOAK_LOAD * measured["rps"]
        time.sleep(0.5)  # the measuring client's connections close
        idle_before = resources(process.pid)
        soak = asyncio.run(Soak(load, SOAK_BODY_KB * 1024, seed).run(rate, seconds, process.pid))
        time.sleep(1.0)
        idle_after = resources(process.pid)
        final = httpx.post(f"{url}/v1/recommend", json=bodies[0], timeout=30)
        alive = load.check(0, final) == "ok"
        metrics = httpx.get(f"{url}/metrics").text
    internal = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith('recspec_errors_total{kind="internal"}'))
    samples = soak["samples"]
    warm = next(sample for sample in samples if sample[0] >= seconds / 5) if samples[-1][0] >= seconds / 5 \
        else samples[0]
    outcomes = soak["outcomes"]

    def count(outcome: str) -> int:
        return sum(n for key, n in outcomes.items() if key.endswith("/" + outcome))

    results = {"target": str(target), "draft": str(draft) if draft else None, "decoder": decoder, "decode": decode,
               "k": k, "users": users, "minutes": minutes, "device": device, "server_cores": sorted(server_cores),
               "client_cores": sorted(client_cores), "sustainable_rps": measured["rps"], "rate": rate,
               "sent": soak["sent"], "seconds": soak["seconds"], "outcomes": outcomes,
               "wrong": count("wrong"), "lost": count("lost"), "server_errors": count("server_error"),
               "server_internal_errors": internal, "rejected": count("rejected"), "alive_after": alive,
               "rss_after_warmup": warm[1], "rss_end": samples[-1][1],
               "rss_growth": samples[-1][1] / warm[1] - 1, "rss_max": max(s[1] for s in samples),
               "fds_idle_before": idle_before[1], "fds_idle_after": idle_after[1],
               "fds_max": max(s[2] for s in samples), "samples": samples}
    results["passed"] = (results["wrong"] == 0 and results["lost"] == 0 and results["server_errors"] == 0
                         and internal == 0 and alive and results["rss_growth"] < 0.05
                         and idle_after[1] <= idle_before[1])
    markdown = _soak_markdown(results)
    json_path, md_path = write_results(out, name, results, markdown)
    return f"{markdown}\nwrote {json_path} and {md_path}"


def _soak_markdown(results: dict[str, Any]) -> str:
    mib = 1 / 2**20
    return "\n".join([
        "# Soak (`recspec bench serve --soak`)\n",
        f"Target `{results['target']}`, decoder {results['decoder']}, decode in a {results['decode']}, K = "
        f"{results['k']}, {results['minutes']:g} minutes at {results['rate']:.1f} requests/s ({SOAK_LOAD:g} of the "
        f"{results['sustainable_rps']:.1f} measured in a closed loop of 16 clients); mix: "
        + ", ".join(f"{kind} {share:.0%}" for kind, share in SOAK_MIX.items()) + ".\n",
        markdown_table(["figure", "value", "target"], [
            ["requests sent", results["sent"], ""],
            ["wrong answers", results["wrong"], "0"],
            ["accepted requests lost", results["lost"], "0"],
            ["500s (client / server metrics)", f"{results['server_errors']} / {results['server_internal_errors']:g}",
             "0 / 0"],
            ["503 (overloaded, with Retry-After)", results["rejected"], ""],
            ["resident memory after warm-up, MiB", results["rss_after_warmup"] * mib, ""],
            ["resident memory at the end, MiB (growth)",
             f"{results['rss_end'] * mib:.1f} ({100 * results['rss_growth']:+.2f}%)", "< 5%"],
            ["open files idle before / after (max during)",
             f"{results['fds_idle_before']} / {results['fds_idle_after']} ({results['fds_max']})", "flat"],
            ["answers right after the soak", results["alive_after"], "True"],
            ["all targets met", results["passed"], "True"]]),
        "\nOutcomes by kind of request:\n",
        markdown_table(["kind / outcome", "requests"], sorted(results["outcomes"].items()))])
