"""Waiting for a running service to be ready: ``GET /health`` polled until enough replicas answer.

Used where recspec starts a server and must not send it work before it can take it (Ray Serve's
proxy, the load test of ``recspec bench serve``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def wait_until_ready(url: str, seconds: float, alive: Callable[[], None] = lambda: None, replicas: int = 1) -> bool:
    """Poll ``GET URL/health`` until ``replicas`` distinct replicas (named by ``/health``) have
    answered 200 (True) or ``seconds`` have passed (False); ``alive()`` runs before each try, and
    raises to give up. Ray Serve counts a deployment running before its proxy routes to all its
    replicas, and requests sent in between would all go to the first."""
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    while True:
        alive()
        try:
            answer = httpx.get(f"{url}/health", timeout=2)
            if answer.status_code == 200:
                seen.add(answer.json()["replica"])
        except httpx.TransportError:
            pass
        if len(seen) >= replicas:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
