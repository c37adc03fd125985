"""Who may use the service: a bearer key on every route but the health checks and metrics, and a
warning for a server exposed beyond this machine without one.

The key is compared in constant time (:func:`hmac.compare_digest`), so the time a refusal takes
says nothing about how much of a guess was right, and it is never written to a log or a repr.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any

#: The environment variable that holds the service's API key (``recspec serve --api-key``'s, and
#: :func:`~recspec.serve.app.from_environment`'s).
KEY_VARIABLE = "RECSPEC_API_KEY"

#: Paths answered without a key: what probes and scrapers call, which carry no user data.
OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})
#: The header value a request must carry is ``Bearer KEY``; this scheme, in any case.
SCHEME = b"bearer"


class RequireKey:
    """ASGI middleware: an HTTP request to a path outside :data:`OPEN_PATHS` without
    ``Authorization: Bearer <key>`` is answered by ``refuse(has_header)`` (a 401), unread."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str,
                 refuse: Callable[[bool], Callable[..., Awaitable[None]]]) -> None:
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization")
        if header is None or not self.accepts(header):
            return await self.refuse(header is not None)(scope, receive, send)
        return await self.app(scope, receive, send)

    def accepts(self, header: bytes) -> bool:
        """Whether an ``Authorization`` header value carries the key (constant time in the key)."""
        scheme, _, presented = header.strip().partition(b" ")
        return scheme.lower() == SCHEME and hmac.compare_digest(presented.strip(), self.key)


def loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable only from this machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The one-line warning for serving on ``host`` without a key beyond this machine (None if not)."""
    if api_key or loopback(host):
        return None
    return (f"warning: --host {host} serves beyond this machine and no --api-key (or {KEY_VARIABLE}) is set: "
            f"anyone who can reach it may use it")
