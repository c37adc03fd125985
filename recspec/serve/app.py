"""The HTTP service: a FastAPI app over one :class:`~recspec.serve.service.RecommendService`.

``create_app(config)`` builds the ASGI app (``recspec serve`` runs it under uvicorn; its routes are
:mod:`recspec.serve.routes`); ``from_environment()`` builds it from the environment, for ``uvicorn
--factory``. The models load in a thread after start-up, so the health checks answer at once:
``GET /health/live`` is 200 while the process answers; ``GET /health/ready`` (and ``GET /health``,
its older name) is 503 ``loading`` until the models are in memory and warm (one decode done), then
200 ``ready`` (a load that fails is logged and the server asked to stop, ``on_failure``); a host
that loads them before start-up (``app.state.recspec.load()``, as a Ray Serve replica does) starts
batching at once. Endpoints: ``POST /v1/recommend``, the OpenAI-style ``POST /v1/completions``
(a raw prompt) and ``POST /v1/chat/completions`` (for models whose prompts are chat messages),
both with ``stream: true`` as server-sent events, ``GET /v1/models`` (the served name, never a
server path), ``GET /metrics``. With ``config.api_key`` every route but the health checks and
``/metrics`` needs ``Authorization: Bearer KEY`` (:mod:`recspec.serve.access`). The batches
decode in a thread of this process, or in a worker process (``config.decode_process``:
:mod:`recspec.serve.worker`).

Every refusal is OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` (type and
code: the kind of refusal, the metrics' label; param: the body field at fault, or null), made by
one function, :func:`error_response`, and decided before any model work: a missing or wrong key
(401), a body that is not JSON (malformed, invalid UTF-8, nested deeper than the parser goes:
400), a body over ``max_body_bytes`` (413), a body of the wrong shape or types, a string that is
not valid Unicode (a lone surrogate) or an absurd size (422), unknown or repeated items, a bad
``k`` or decoder (422), a full queue (503 with ``Retry-After``), a passed deadline (504); an
unknown path (404) or method (405) and a failure of the server itself (500) have the same shape.
An answer with fewer than ``k`` items says why (``fewer_reason``: :mod:`recspec.serve.service`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from recspec.errors import RecspecError
from recspec.models.checkpoint import weights_fingerprint
from recspec.models.tokenizer import index_fingerprint
from recspec.serve.access import KEY_VARIABLE, RequireKey
from recspec.serve.batcher import DynamicBatcher, Overloaded, Pending
from recspec.serve.config import ServeConfig, load_service
from recspec.serve.metrics import ServiceMetrics
from recspec.serve.routes import router
from recspec.serve.schemas import RecommendStats
from recspec.serve.service import Answer, BadRequest, Query, RecommendService
from recspec.serve.worker import DecodeWorker, WorkerGone

log = logging.getLogger("recspec.serve")

#: The environment variable :func:`from_environment` reads the config from, as JSON (the API key:
#: :data:`~recspec.serve.access.KEY_VARIABLE`).
SETTINGS_VARIABLE = "RECSPEC_SERVE_SETTINGS"

#: The message of a body that is not JSON the service can read.
MALFORMED = "the body is not valid JSON; send one JSON object as UTF-8 text"
#: The kind and message of the refusals the framework makes (FastAPI's HTTPException), by status.
FRAMEWORK_REFUSALS = {
    400: ("malformed_json", MALFORMED),
    404: ("not_found", "no such endpoint; the service answers POST /v1/recommend, POST /v1/completions, "
                       "POST /v1/chat/completions, GET /v1/models, GET /health/live, GET /health/ready and "
                       "GET /metrics"),
    405: ("method_not_allowed", "this endpoint does not take that method; see GET /docs"),
}


def error_response(status: int, kind: str, message: str, headers: dict[str, str] | None = None,
                   param: str | None = None, **extra: Any) -> JSONResponse:
    """The service's one error body, OpenAI's ``{"error": {"message", "type", "param", "code",
    ...extra}}`` (``kind`` as both type and code), with ``status``: every refusal and failure is
    made here, so its shape is decided in one place."""
    body = {"message": message, "type": kind, "param": param, "code": kind, **extra}
    return JSONResponse({"error": body}, status, headers=headers)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 before the app reads
    it (by its Content-Length, or while it streams in)."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_large = error_response(413, "too_large", f"the request body exceeds {self.limit} bytes")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_large(scope, receive, send)
        seen, exceeded, answered = 0, False, False

        async def limited() -> dict:
            nonlocal seen, exceeded
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # the app sees an empty end of body; its answer is replaced below
                exceeded = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded(message: dict) -> None:
            nonlocal answered
            if not exceeded:
                return await send(message)
            if not answered:
                answered = True
                await too_large(scope, receive, send)

        await self.app(scope, limited, guarded)


class State:
    """What the endpoints share: the config, the metrics, and, once loaded, the service (which
    checks and parses requests), the decode (its own, or a worker process's) and the batcher; the
    request path from body to answer or refusal."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.service: RecommendService | None = None
        self.worker: DecodeWorker | None = None
        self.batcher: DynamicBatcher[Query, Answer] | None = None
        self.failure: BaseException | None = None
        self.models: dict[str, Any] = {}
        self.replica = uuid.uuid4().hex[:12]  # which app answered /health (one per replica on Ray Serve)
        self.metrics = ServiceMetrics(self.replica)

    def load(self) -> None:
        """Load the models (off the event loop) and warm them up, here or in a decode worker
        process, and describe them for /v1/models (names, never paths)."""
        config = self.config
        worker = DecodeWorker(config) if config.decode_process else None
        try:
            if worker is not None:
                worker.start()  # it loads the models while this process loads what parsing needs
            service = load_service(config, decoding=worker is None)
            if worker is not None:
                worker.wait_ready()
            else:
                service.warm_up(config.auto_k[0])
        except BaseException:
            if worker is not None:
                worker.close()
            raise
        recommender = service.recommender
        self.models = {
            "id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "recspec",
            "target_sha256": weights_fingerprint(recommender.folder),
            "draft": [Path(name).name for name in recommender.draft_names],
            "index_fingerprint": index_fingerprint(recommender.index),
            "items": service.num_items, "identifier_length": recommender.trie.depth,
            "decoders": service.decoders, "default_decoder": service.decoder, "chat": service.chat,
            "max_history": service.max_history, "device": config.device,
            "threads": worker.threads if worker is not None else torch.get_num_threads(),
            "decode_process": worker is not None}
        self.service, self.worker = service, worker

    def decode(self, queries: list[Query]) -> list[Answer]:
        """Decode one batch (the batcher's thread): in the worker process, or here. A worker that
        has exited fails the service, which is then stopped (``on_failure``)."""
        assert self.service is not None
        if self.worker is None:
            return self.service.decode(queries)
        try:
            return self.worker.decode(queries)
        except WorkerGone as err:
            self.failure = err
            log.error("recspec serve: %s; stopping", err)
            self.config.on_failure(err)
            raise

    async def auto_choices(self) -> list[dict[str, Any]]:
        """``auto``'s choices made so far, where the decoding runs."""
        assert self.service is not None
        if self.worker is None:
            return self.service.auto_choices()
        return await asyncio.to_thread(self.worker.auto_choices)

    @property
    def ready(self) -> bool:
        """Whether requests are taken: the models loaded and warm, batching, nothing failed."""
        return self.batcher is not None and self.failure is None

    async def start(self) -> None:
        """Load the models off the event loop (unless :meth:`load` ran before), then start
        batching; a failed load is reported (``config.on_failure``) and /health/ready says so."""
        config, metrics = self.config, self.metrics
        try:
            if self.service is None:
                await asyncio.to_thread(self.load)
        except BaseException as err:  # noqa: BLE001 - reported, then the server is stopped
            self.failure = err
            log.error("recspec serve: could not load the models: %s", err)
            config.on_failure(err)
            return
        self.batcher = DynamicBatcher(self.decode, config.max_batch, config.max_wait_ms / 1e3, config.max_queue,
                                      on_queue=metrics.queue_depth.set, on_batch=metrics.batch_started,
                                      on_done=metrics.batch_done)
        self.batcher.start()
        log.info("recspec serve: ready (%s)", self.models)

    async def stop(self) -> None:
        """Stop batching (after the batch in flight) and the decode worker, if any."""
        if self.batcher is not None:
            await self.batcher.stop()
        if self.worker is not None:
            await asyncio.to_thread(self.worker.close)

    def refuse(self, endpoint: str | None, status: int, kind: str, message: str,
               headers: dict[str, str] | None = None, param: str | None = None, **extra: Any) -> JSONResponse:
        """The refusal of a request, counted by kind and, for an ``endpoint`` of the service, by status."""
        self.metrics.errors.labels(kind).inc()
        if endpoint is not None:
            self.metrics.requests.labels(endpoint, str(status)).inc()
        return error_response(status, kind, message, headers, param, **extra)

    def unauthorized(self, presented: bool) -> JSONResponse:
        """The 401 of a request without the API key (``presented``: it sent a wrong one)."""
        message = ("the API key is wrong" if presented else
                   "this server needs an API key: send the header Authorization: Bearer <key>")
        return self.refuse(None, 401, "invalid_api_key", message, {"WWW-Authenticate": "Bearer"})

    async def answer(self, request: Request, endpoint: str, parse: Callable[[RecommendService], Query],
                     respond: Callable[[Query, Answer, RecommendStats], Any]) -> Any:
        """Parse, queue, await the answer (or the deadline, or the client's going away); the
        response ``respond`` makes of the query, its answer and its statistics, or the refusal."""
        arrived = time.perf_counter()
        if not self.ready or self.batcher is None or self.service is None:
            return self.refuse(endpoint, 503, "loading" if self.failure is None else "failed",
                               "the models are still loading" if self.failure is None else
                               "the service failed and is stopping", {"Retry-After": "1"})
        try:
            query = parse(self.service)
        except BadRequest as err:
            extra = {} if err.items is None else {"items": err.items}
            return self.refuse(endpoint, err.status, err.kind, str(err), param=err.param, **extra)
        try:
            pending = self.batcher.submit(query.key, query)
        except Overloaded as err:
            return self.refuse(endpoint, 503, "overloaded", str(err), {"Retry-After": str(err.retry_after)})
        timeout = min(self.config.timeout_s, query.timeout_s or self.config.timeout_s)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({pending.future, gone}, timeout=timeout - (time.perf_counter() - arrived),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if pending.future in done and not pending.future.cancelled():
            failure = pending.future.exception()
            if failure is not None:
                log.error("recspec serve: a batch failed", exc_info=failure)
                return self.refuse(endpoint, 500, "internal", f"decoding failed: {failure}")
            result = pending.future.result()
            return respond(query, result, self.answered(result, endpoint, arrived, _queued_s(pending)))
        self.batcher.cancel(pending)
        if gone in done:
            return self.refuse(endpoint, 499, "disconnected", "the client went away")
        return self.refuse(endpoint, 504, "deadline", f"no answer within {timeout:.3f} s; the request was dropped")

    def answered(self, result: Answer, endpoint: str, arrived: float, queued: float) -> RecommendStats:
        """Count an answered request in the metrics; its statistics."""
        metrics = self.metrics
        total = time.perf_counter() - arrived
        metrics.latency.labels(endpoint).observe(total)
        metrics.requests.labels(endpoint, "200").inc()
        metrics.batches.labels(result.decoder).inc(1.0 / result.batch_size)
        metrics.drafted.inc(result.drafted_steps)
        metrics.accepted.inc(result.accepted_steps)
        metrics.target_calls.inc(result.target_calls)
        return RecommendStats(accepted_steps=result.accepted_steps, target_calls=result.target_calls,
                              batch_size=result.batch_size, queue_ms=1e3 * queued, decode_ms=1e3 * result.decode_s,
                              ms=1e3 * total)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The app's life: its models load in the background (:meth:`State.start`) while it answers,
    and batching and any decode worker stop when it shuts down."""
    state: State = app.state.recspec
    loader = asyncio.get_running_loop().create_task(state.start())
    yield
    loader.cancel()
    await state.stop()


def add_refusals(app: FastAPI, state: State) -> None:
    """Answer what the framework refuses or fails on (a body of the wrong shape, an unknown path or
    method, a failure of the server itself) with the service's error body, counted in the metrics."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        if "json" not in request.headers.get("content-type", ""):
            return state.refuse(None, 415, "not_json", "send the body as JSON, with Content-Type: application/json")
        if any(e.get("type") == "json_invalid" for e in errors):
            return state.refuse(None, 400, "malformed_json", MALFORMED)
        first = errors[0] if errors else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return state.refuse(None, 422, "invalid", f"{where or 'body'}: {first.get('msg', 'invalid')}",
                            param=where or None,
                            details=[{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg")} for e in errors])

    @app.exception_handler(HTTPException)
    async def refused(request: Request, err: HTTPException) -> JSONResponse:
        """What the framework refuses itself (a body it cannot parse, an unknown path or method)."""
        kind, message = FRAMEWORK_REFUSALS.get(err.status_code, ("http", str(err.detail)))
        return state.refuse(None, err.status_code, kind, message, err.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        """A failure of the server itself (uvicorn logs the traceback)."""
        return state.refuse(None, 500, "internal", "the server failed on this request; its log says why")


def create_app(config: ServeConfig) -> FastAPI:
    """The ASGI app serving ``config`` (module doc): its routes (:mod:`recspec.serve.routes`), the
    service's refusals, the body limit and, with ``config.api_key``, the key check (outermost:
    checked first)."""
    state = State(config)
    app = FastAPI(title="recspec", summary="Exact top-K recommendation with speculative decoding",
                  lifespan=lifespan)
    app.state.recspec = state
    add_refusals(app, state)
    app.include_router(router)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(RequireKey, key=config.api_key, refuse=state.unauthorized)
    return app


def from_environment() -> FastAPI:
    """The app of the config in the environment, for ``uvicorn --factory
    recspec.serve.app:from_environment``: :data:`SETTINGS_VARIABLE` holds the config as JSON, as
    :meth:`ServeConfig.settings` writes it for the decode worker (any other field of
    :class:`ServeConfig` may be added, ``served_model_name`` or ``max_queue`` say), and
    :data:`KEY_VARIABLE` the key, as ``recspec serve`` reads it (unset: none asked; empty: refused,
    as there). Under a bare uvicorn a failed load is not asked to stop the server: /health/ready
    then says ``failed``."""
    settings, key = os.environ.get(SETTINGS_VARIABLE), os.environ.get(KEY_VARIABLE)
    if not settings:
        raise RecspecError(f"{SETTINGS_VARIABLE} is not set: give it the config as JSON (ServeConfig.settings()), "
                           f"or serve with `recspec serve`")
    if key is not None and not key.strip():
        raise RecspecError(f"{KEY_VARIABLE} is empty; give a key, or unset it to serve without one")
    return create_app(replace(ServeConfig.from_settings(settings), api_key=key))


def _queued_s(pending: Pending) -> float:
    return (pending.started or pending.arrived) - pending.arrived


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read, so the next ASGI message is
    the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
