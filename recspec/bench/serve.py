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
def running_server(args: Sequence[str], cores: set[int] | None = None,
                   setup: Callable[[], None] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``recspec serve ARGS`` on a free loopback port (pinned to ``cores``; ``setup`` run in the
    server's process before it starts, e.g. to set its limits), ready (GET /health is 200, from
    each of its ``--replicas``); yields its URL and process; stopped with SIGTERM on exit. Its
    output goes to a temporary file, quoted when it fails to start."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    output = tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-m", "recspec.cli", "serve", "--port", str(port), *args],
                               stdout=output, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
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
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
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


def run_serve(out: Path, target: Path, draft: Path | None, decoders: Sequence[str], concurrency: Sequence[int], k: int,
              users: int, requests: int, repeats: int, max_batch: int, max_seconds: float, name: str,
              device: str = "cpu") -> str:
    """Measure every decoder x batching x concurrency (module doc) with the server's models on
    ``device``; write ``name``.json/.md/.png."""
    client_cores, server_cores = _cores()
    os.sched_setaffinity(0, client_cores)
    import torch

    torch.set_num_threads(len(client_cores))
    recommender = Recommender.load(target, device=device)  # the expected answers, on the server's device
    examples = recommender.examples("test", users)
    decoded = recommender.recommend(examples, k, TREE_BEAM, 16)
    keys = recommender.index.item_keys
    item_ids = recommender.dataset.item_ids
    bodies = [{"history": [item_ids[i] for i in examples.history_of(row)], "k": k} for row in range(len(examples))]
    expected = [{"items": [keys[i] for i in items], "scores": scores}
                for items, scores in zip(decoded.topk.items.tolist(), decoded.topk.scores.tolist())]
    del recommender
    cells: list[dict[str, Any]] = []
    for decoder in decoders:
        for batching, size in (("on", max_batch), ("off", 1)):
            args = ["--target", str(target), "--decoder", decoder, "--max-batch", str(size), "--threads",
                    str(len(server_cores)), "--device", device]
            if draft is not None and decoder != TREE_BEAM:
                args += ["--draft", str(draft)]
            with running_server(args, server_cores) as (url, _):
                load = Load(url, bodies, expected)
                for c in sorted(set(concurrency)):  # warm-up: auto's choices, caches, allocator
                    asyncio.run(load.closed(c, max(8, 2 * c), max_seconds))
                runs: dict[int, list] = {c: [] for c in concurrency}
                for r in range(repeats):
                    order = list(concurrency)[r % len(concurrency):] + list(concurrency)[:r % len(concurrency)]
                    for c in order:
                        runs[c].append(asyncio.run(load.closed(c, max(requests, 4 * c), max_seconds)))
                for c in concurrency:
                    cells.append({"decoder": decoder, "batching": batching, "mode": "closed", "concurrency": c,
                                  **_median_run(runs[c])})
                if batching == "on":
                    best = max(cell["rps"] for cell in cells if cell["decoder"] == decoder
                               and cell["batching"] == "on")
                    overload = asyncio.run(load.open(2 * best, 4 * requests, max_seconds))
                    cells.append({"decoder": decoder, "batching": batching, "mode": "open", **overload})
    summary = _summary(cells, decoders)
    results = {"target": str(target), "draft": str(draft) if draft else None, "k": k, "users": users,
               "requests_per_run": requests, "repeats": repeats, "max_batch": max_batch,
               "client_cores": sorted(client_cores), "server_cores": sorted(server_cores), "summary": summary,
               "cells": cells}
    markdown = _markdown(results)
    json_path, md_path = write_results(out, name, results, markdown)
    _plot(out / f"{name}.png", cells)
    return f"{markdown}\nwrote {json_path}, {md_path} and {out / f'{name}.png'}"


def _cell(cells: list[dict], decoder: str, batching: str, concurrency: int) -> dict | None:
    return next((c for c in cells if c["decoder"] == decoder and c["batching"] == batching and c["mode"] == "closed"
                 and c["concurrency"] == concurrency), None)


def _summary(cells: list[dict], decoders: Sequence[str]) -> list[dict[str, Any]]:
    """Per decoder: requests/s of batching on over off at concurrency 16 (target >= 3x), p99 at 16
    over the unloaded p50 (concurrency 1; target < 4x), and the overload run's outcome."""
    rows = []
    for decoder in decoders:
        on, off, idle = _cell(cells, decoder, "on", 16), _cell(cells, decoder, "off", 16), _cell(cells, decoder, "on", 1)
        overload = next((c for c in cells if c["decoder"] == decoder and c["mode"] == "open"), None)
        rows.append({"decoder": decoder,
                     "speedup_c16": on["rps"] / off["rps"] if on and off else None,
                     "p99_c16_over_unloaded_p50": on["p99_ms"] / idle["p50_ms"] if on and idle else None,
                     "overload": None if overload is None else {key: overload[key] for key in
                                                                ("rate", "sent", "ok", "wrong", "rejected", "lost")}})
    return rows


def _markdown(results: dict[str, Any]) -> str:
    cells = results["cells"]
    closed = [c for c in cells if c["mode"] == "closed"]
    lines = ["# Serving under load (`recspec bench serve`)\n",
             f"Target `{results['target']}`, draft `{results['draft']}`, K = {results['k']}, histories of "
             f"{results['users']} test users; closed loop: at least {results['requests_per_run']} requests per run, "
             f"median of {results['repeats']} runs; server on cores {results['server_cores']}, load generator on "
             f"{results['client_cores']}; batching on = `--max-batch {results['max_batch']}`, off = `--max-batch 1`.\n",
             markdown_table(["decoder", "batching", "clients", "req/s", "p50 ms", "p95 ms", "p99 ms", "answered",
                             "wrong", "503", "lost", "batch sizes (requests)"],
                            [[c["decoder"], c["batching"], c["concurrency"], c["rps"], c["p50_ms"], c["p95_ms"],
                              c["p99_ms"], c["ok"] + c["wrong"], c["wrong"], c["rejected"], c["lost"],
                              " ".join(f"{s}:{n}" for s, n in c["batch_sizes"].items())] for c in closed]),
             "\nOverload: open loop, Poisson arrivals at twice the best closed-loop rate of batching on.\n",
             markdown_table(["decoder", "rate req/s", "sent", "answered right", "wrong", "503", "lost", "p50 ms",
                             "p99 ms"],
                            [[c["decoder"], c["rate"], c["sent"], c["ok"], c["wrong"], c["rejected"], c["lost"],
                              c["p50_ms"], c["p99_ms"]] for c in cells if c["mode"] == "open"]),
             "\nTargets: batching >= 3x the requests/s of one-at-a-time at 16 clients, p99 there < 4x the "
             "unloaded p50.\n",
             markdown_table(["decoder", "req/s on / off at 16 clients", "p99 at 16 / unloaded p50"],
                            [[row["decoder"], row["speedup_c16"], row["p99_c16_over_unloaded_p50"]]
                             for row in results["summary"]])]
    return "\n".join(lines)


def _plot(path: Path, cells: list[dict]) -> None:
    figure, axis = new_figure(figsize=(7, 4.5))
    for decoder in sorted({c["decoder"] for c in cells}):
        for batching, style in (("on", "-o"), ("off", "--s")):
            points = sorted((c["concurrency"], c["rps"], c["p50_ms"]) for c in cells if c["mode"] == "closed"
                            and c["decoder"] == decoder and c["batching"] == batching)
            if points:
                axis.plot([p[1] for p in points], [p[2] for p in points], style, label=f"{decoder}, batching {batching}")
                for concurrency, rps, p50 in points:
                    axis.annotate(str(concurrency), (rps, p50), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axis.set_xlabel("requests / s")
    axis.set_ylabel("p50 latency (ms)")
    axis.set_yscale("log")
    axis.set_title("recspec serve: latency vs throughput (labels: concurrent clients)")
    axis.legend(fontsize=8)
    save_figure(figure, path)
