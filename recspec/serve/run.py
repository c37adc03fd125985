"""``recspec serve``: the app of :func:`~recspec.serve.app.create_app` under uvicorn.

It serves on a socket bound before anything was loaded (:func:`~recspec.serve.listen.listen`:
a port in use is refused at once).

Connections are bounded, so that clients that connect and send nothing (or send slowly) cannot
starve the others, ``/health`` included: the process may open as many files as its hard limit
allows (the soft limit is raised to it), and :func:`bounded` keeps at most
:func:`connection_limit` connections open, below that limit (a new connection beyond it closes
the connection that has waited longest for its client, or itself when every one has a request
in progress), and closes a connection that has not delivered a complete request within the
request deadline (``--timeout-s``) of connecting or of its last answer: such a request could not
be answered in time anyway. uvicorn closes a connection idle after an answer sooner (its
keep-alive timeout).

uvicorn owns the signals while it runs: on SIGTERM or Ctrl-C it stops accepting connections,
waits for the requests in flight (the batcher keeps decoding what they wait for), shuts the app
down, and the process exits 0. Models that fail to load stop the server with exit status 1.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
from dataclasses import replace

import uvicorn

from recspec.serve.app import create_app
from recspec.serve.config import ServeConfig
from recspec.serve.listen import address

#: Connections kept open at most, where the file limit allows as many.
MAX_CONNECTIONS = 1000
#: File descriptors left to everything but connections (model files, measurement records, pipes,
#: the listening socket), below the process's limit.
FD_RESERVE = 128

log = logging.getLogger("recspec.serve")


def serve(config: ServeConfig, listener: socket.socket) -> int:
    """Serve ``config`` on the bound ``listener`` until SIGTERM / SIGINT; the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def stop(err: BaseException) -> None:
        failed.append(err)
        if server is not None:
            server.should_exit = True

    app = create_app(replace(config, on_failure=stop))
    settings = uvicorn.Config(app, log_level="info", access_log=False,
                              timeout_graceful_shutdown=max(60.0, 2 * config.timeout_s))
    settings.load()  # resolves the HTTP protocol class, which is then bounded
    settings.http_protocol_class = bounded(settings.http_protocol_class, config.timeout_s, connection_limit())
    server = uvicorn.Server(settings)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it shut down on, after
        signal.signal(sig, lambda signum, frame: None)  # restoring these: a graceful stop exits 0
    log.info("recspec serve: listening on %s (SIGTERM or Ctrl-C to stop)", address(listener))
    server.run(sockets=[listener])
    return 1 if failed else 0


def connection_limit() -> int:
    """How many connections :func:`bounded` keeps open: :data:`MAX_CONNECTIONS`, or fewer where the
    process's file limit (its soft limit raised to the hard one, where allowed) leaves less beside
    :data:`FD_RESERVE`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a limit the system refuses: keep the soft one
            pass
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft - FD_RESERVE))


def bounded(protocol: type[asyncio.Protocol], read_timeout_s: float, limit: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP ``protocol`` (h11 or httptools: both keep the connections of the server in
    ``connections`` and the request in flight in ``cycle``) with the bounds of the module doc: at
    most ``limit`` connections, each given ``read_timeout_s`` to deliver a complete request after
    connecting and after each answer."""

    class Bounded(protocol):  # type: ignore[valid-type, misc]  (a class chosen at run time)
        waited_since = 0.0  # when the client's current wait began (connecting, or its last answer)
        read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self.await_request()
            if len(self.connections) > limit:
                waiting = [other for other in self.connections
                           if other is not self and other.awaiting_client() and not other.transport.is_closing()]
                min(waiting, key=lambda other: other.waited_since, default=self).transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
            super().connection_lost(exc)

        def awaiting_client(self) -> bool:
            """Whether the connection waits for its client: for a request, or for the rest of its body."""
            cycle = self.cycle
            return cycle is None or cycle.response_complete or cycle.more_body

        def await_request(self) -> None:
            """(Re)start the time the client has to deliver its next request."""
            if self.read_timer is not None:
                self.read_timer.cancel()
            self.waited_since = self.loop.time()
            self.read_timer = self.loop.call_later(read_timeout_s, self.read_expired)

        def read_expired(self) -> None:
            """Close the connection if its client has not delivered a complete request in time."""
            if self.awaiting_client() and not self.transport.is_closing():
                self.transport.close()

    return Bounded
