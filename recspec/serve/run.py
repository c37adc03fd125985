"""``recspec serve``: the app of :func:`~recspec.serve.app.create_app` under uvicorn.

uvicorn owns the signals while it runs: on SIGTERM or Ctrl-C it stops accepting connections,
waits for the requests in flight (the batcher keeps decoding what they wait for), shuts the app
down, and the process exits 0. Models that fail to load stop the server with exit status 1.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import replace

import uvicorn

from recspec.serve.app import ServeConfig, create_app


def serve(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Serve ``config`` on ``host:port`` until SIGTERM / SIGINT; the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def stop(err: BaseException) -> None:
        failed.append(err)
        if server is not None:
            server.should_exit = True

    app = create_app(replace(config, on_failure=stop))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                                           timeout_graceful_shutdown=max(60.0, 2 * config.timeout_s)))
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it shut down on, after
        signal.signal(sig, lambda signum, frame: None)  # restoring these: a graceful stop exits 0
    server.run()
    return 1 if failed else 0
