"""``recspec serve --engine ray``: the app of :func:`~recspec.serve.app.create_app` as a Ray Serve
deployment of N replicas.

Every replica runs the whole FastAPI app, with its own dynamic batcher, queue and metrics; Serve's
HTTP proxy on ``host:port`` spreads the requests over the replicas and passes their answers and
refusals through unchanged, so the API is the one of ``recspec serve``. ``/metrics`` and the
queue of ``/health`` are those of the replica that answered (``/health`` names it). The service
says it runs only once the proxy has routed ``/health`` to every replica
(:func:`~recspec.ready.wait_until_ready`): Serve reports a deployment running before its
proxy routes to all of it.

A replica loads its models while it is built (``State.load`` before the app starts): the proxy
never routes to a replica still loading, Serve's health check (whether the replica's actor
answers) runs only once it has started, so a slow load is never taken for a dead replica, and a
load that fails fails the replica with its own error, which ends the one line printed.
Each replica may queue ``max_queue`` requests and decode ``max_batch`` more, so the service's own
backpressure (503 with ``Retry-After``) answers overload, not Serve's.

On SIGTERM or Ctrl-C the application is deleted first (new requests get 404 while every replica
answers the requests it holds, then shuts its app down), then Serve itself; the exit status is 0.
Models that do not load: exit status 1 after one line. The cluster is the one of
:func:`recspec.cluster.runtime.connect`; a cluster that already runs Serve is refused, since
stopping this service stops Serve there.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from dataclasses import replace

from fastapi import FastAPI

from recspec.ready import wait_until_ready
from recspec.cluster.runtime import Workers, connect
from recspec.errors import RecspecError
from recspec.serve.app import create_app
from recspec.serve.config import ServeConfig

log = logging.getLogger("recspec.serve")

#: The Serve application and deployment names.
APP, DEPLOYMENT = "recspec", "RecspecService"
#: Serve's check that a started replica's actor answers: how often, and how long it may take
#: (generous: a decode running on every core of a busy machine can delay the answer).
HEALTH_CHECK_PERIOD_S, HEALTH_CHECK_TIMEOUT_S = 10.0, 60.0
#: How long the proxy may take to route to the deployment once it runs.
PROXY_READY_S = 60.0


def free_port(host: str) -> int:
    """A port nobody listens on at ``host`` now (Serve's proxy cannot be given port 0)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_on_ray(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
                 address: str | None = None) -> int:
    """Serve ``config`` with ``replicas`` replicas behind Serve's proxy on ``host:port`` (0: a free
    port) on the Ray cluster at ``address`` (None: a local one), until SIGTERM / SIGINT; the exit
    status (module doc)."""
    from ray import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll of /health
    workers = Workers(replicas, config.threads or 1, 0 if config.device == "cpu" else 1)
    connect(address, workers=workers)
    running = serve.status()
    if running.proxies or running.applications:  # this command starts Serve, and stops it
        raise RecspecError(f"Ray Serve already runs on the cluster at {address}; stop it (`serve shutdown`) or "
                           f"use another cluster")
    config = replace(config, device=workers.device, threads=workers.cpus)
    port = port or free_port(host)

    def build() -> FastAPI:
        """The app of one replica, its models loaded (run on the replica)."""
        app = create_app(config)
        app.state.recspec.load()
        return app

    deployment = serve.deployment(serve.ingress(build)(), name=DEPLOYMENT, num_replicas=replicas,
                                  ray_actor_options=workers.remote_args(),
                                  max_ongoing_requests=config.max_queue + config.max_batch,
                                  health_check_period_s=HEALTH_CHECK_PERIOD_S,
                                  health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
                                  graceful_shutdown_timeout_s=max(60.0, 2 * config.timeout_s))
    stop = threading.Event()  # set by SIGTERM / SIGINT, from now on (the proxy may answer before run returns)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
    try:
        try:
            serve.run(deployment.bind(), name=APP, route_prefix="/")
        except RuntimeError as err:  # the deployment failed
            log.error("recspec serve: the replicas did not start: %s", why_not_started(err))
            return 1
        url = f"http://{host}:{port}"
        if not wait_until_ready(url, PROXY_READY_S, replicas=replicas):
            raise RecspecError(f"Ray Serve's proxy at {url} did not route to its {replicas} replica(s) within "
                               f"{PROXY_READY_S:g} s")
        log.info("recspec serve: %d replica(s) on Ray Serve running on %s (SIGTERM or Ctrl-C to stop)",
                 replicas, url)
        while not stop.wait(0.5):
            pass
        log.info("recspec serve: stopping; the replicas answer the requests they hold")
        serve.delete(APP)
        return 0
    finally:
        serve.shutdown()


def why_not_started(err: RuntimeError) -> str:
    """The last line of what the deployment's replicas raised (its exception), else of ``err``."""
    from ray import serve

    app = serve.status().applications.get(APP)
    messages = [deployment.message for deployment in app.deployments.values()] if app else []
    text = "\n".join([str(err), *messages])
    return [line.strip() for line in text.splitlines() if line.strip()][-1]
