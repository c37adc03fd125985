"""The HTTP service: a FastAPI app over one :class:`~recspec.serve.service.RecommendService`.

``create_app(config)`` is the ASGI app factory (``uvicorn --factory`` or ``recspec serve``). The
models load in a thread after start-up, so ``GET /health`` answers at once: 503 ``loading``
until they are in memory, then 200 ``ready`` (a load that fails is logged and the server asked
to stop, ``on_failure``); a host that loads them before start-up (``app.state.recspec.load()``,
as a Ray Serve replica does) starts batching at once. Endpoints: ``POST /v1/recommend``,
``POST /v1/chat/completions`` (OpenAI-style, for models whose prompts are chat messages),
``GET /v1/models``, ``GET /metrics``.

Every refusal is JSON ``{"error": {"kind": ..., "message": ...}}`` (made by one function,
:func:`error_response`), decided before any model work: a body that is not JSON (malformed,
invalid UTF-8, nested deeper than the parser goes: 400), a body over ``max_body_bytes`` (413), a
body of the wrong shape or types, a string that is not valid Unicode (a lone surrogate) or an
absurd size (422), unknown or repeated items, a bad ``k`` or decoder (422), a full queue (503 with
``Retry-After``), a passed deadline (504); an unknown path (404) or method (405) and a failure of
the server itself (500) have the same shape. An answer with fewer than ``k`` items says why
(``fewer_reason``: :mod:`recspec.serve.service`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from recspec.models.checkpoint import weights_fingerprint
from recspec.models.tokenizer import index_fingerprint
from recspec.recommend import AUTO, DecodeOptions, Recommender
from recspec.serve.batcher import DynamicBatcher, Overloaded, Pending
from recspec.serve.metrics import ServiceMetrics
from recspec.serve.schemas import (DEFAULT_K, ChatChoice, ChatChoiceMessage, ChatCompletionRequest,
                                   ChatCompletionResponse, ChatUsage, RecommendRequest, RecommendResponse,
                                   RecommendStats)
from recspec.serve.service import Answer, BadRequest, Query, RecommendService

log = logging.getLogger("recspec.serve")


#: The message of a body that is not JSON the service can read.
MALFORMED = "the body is not valid JSON; send one JSON object as UTF-8 text"
#: The kind and message of the refusals the framework makes (FastAPI's HTTPException), by status.
FRAMEWORK_REFUSALS = {
    400: ("malformed_json", MALFORMED),
    404: ("not_found", "no such endpoint; the service answers POST /v1/recommend, POST /v1/chat/completions, "
                       "GET /health, GET /v1/models and GET /metrics"),
    405: ("method_not_allowed", "this endpoint does not take that method; see GET /docs"),
}


@dataclass(frozen=True)
class ServeConfig:
    """What ``recspec serve`` takes: the model folders, the default decoder and its options, the
    batching limits (``max_batch`` 1 serves one request at a time), the request deadline and body
    limit, torch threads (None: leave torch's default), and the values of ``k`` an ``auto`` server
    makes its choices for before it is ready (``auto_k``; others are measured in the background)."""

    target: Path
    draft: str | None = None
    decoder: str = AUTO
    options: DecodeOptions = DecodeOptions()
    device: str = "cpu"
    max_batch: int = 16
    max_wait_ms: float = 5.0
    max_queue: int = 256
    timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    threads: int | None = None
    auto_k: tuple[int, ...] = (DEFAULT_K,)
    on_failure: Callable[[BaseException], None] = field(default=lambda err: None, compare=False)


def error_response(status: int, kind: str, message: str, headers: dict[str, str] | None = None,
                   **extra: Any) -> JSONResponse:
    """The service's one error body, ``{"error": {"kind", "message", ...extra}}``, with ``status``:
    every refusal and failure is made here, so its shape is decided in one place."""
    return JSONResponse({"error": {"kind": kind, "message": message, **extra}}, status, headers=headers)


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
    """What the endpoints share: the config, the metrics, and, once loaded, the service and its
    batcher; the request path from body to answer or refusal."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.service: RecommendService | None = None
        self.batcher: DynamicBatcher[Query, Answer] | None = None
        self.failure: BaseException | None = None
        self.models: dict[str, Any] = {}
        self.replica = uuid.uuid4().hex[:12]  # which app answered /health (one per replica on Ray Serve)
        self.metrics = ServiceMetrics(self.replica)

    def load(self) -> None:
        """Load the models (in a worker thread) and describe them for /v1/models."""
        config = self.config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        recommender = Recommender.load(config.target, device=config.device, draft_dir=config.draft, folder_only=True)
        service = RecommendService(recommender, config.decoder, config.options, config.max_batch, serving=True)
        self.models = {
            "target": str(recommender.folder), "target_sha256": weights_fingerprint(recommender.folder),
            "draft": recommender.draft_names,
            "index_fingerprint": index_fingerprint(recommender.index),
            "items": service.num_items, "identifier_length": recommender.trie.depth,
            "decoders": service.decoders, "default_decoder": service.decoder, "chat": service.chat,
            "max_history": service.max_history, "device": config.device, "threads": torch.get_num_threads()}
        if service.decoder == AUTO:  # measured before /health says ready, not in the requests
            for k in config.auto_k:
                service.check_k(k)
                service.prepare(k)
        self.service = service

    async def start(self) -> None:
        """Load the models off the event loop (unless :meth:`load` ran before), then start
        batching; a failed load is reported (``config.on_failure``) and /health says so."""
        config, metrics = self.config, self.metrics
        try:
            if self.service is None:
                await asyncio.to_thread(self.load)
        except BaseException as err:  # noqa: BLE001 - reported, then the server is stopped
            self.failure = err
            log.error("recspec serve: could not load the models: %s", err)
            config.on_failure(err)
            return
        assert self.service is not None
        self.batcher = DynamicBatcher(self.service.decode, config.max_batch, config.max_wait_ms / 1e3,
                                      config.max_queue, on_queue=metrics.queue_depth.set,
                                      on_batch=metrics.batch_size.observe)
        self.batcher.start()
        log.info("recspec serve: ready (%s)", self.models)

    def refuse(self, endpoint: str | None, status: int, kind: str, message: str,
               headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
        """The refusal of a request, counted by kind and, for an ``endpoint`` of the service, by status."""
        self.metrics.errors.labels(kind).inc()
        if endpoint is not None:
            self.metrics.requests.labels(endpoint, str(status)).inc()
        return error_response(status, kind, message, headers, **extra)

    async def answer(self, request: Request, endpoint: str, parse: Callable[[RecommendService], Query],
                     respond: Callable[[Query, Answer, RecommendStats], Any]) -> Any:
        """Parse, queue, await the answer (or the deadline, or the client's going away); the
        response ``respond`` makes of the query, its answer and its statistics, or the refusal."""
        arrived = time.perf_counter()
        if self.batcher is None or self.service is None:
            return self.refuse(endpoint, 503, "loading", "the models are still loading", {"Retry-After": "1"})
        try:
            query = parse(self.service)
        except BadRequest as err:
            extra = {} if err.items is None else {"items": err.items}
            return self.refuse(endpoint, err.status, err.kind, str(err), **extra)
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


def create_app(config: ServeConfig) -> FastAPI:
    """The ASGI app serving ``config`` (module doc)."""
    state = State(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.get_running_loop().create_task(state.start())
        yield
        loader.cancel()
        if state.batcher is not None:
            await state.batcher.stop()

    app = FastAPI(title="recspec", summary="Exact top-K recommendation with speculative decoding",
                  lifespan=lifespan)
    app.state.recspec = state

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

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.failure is not None:
            return JSONResponse({"status": "failed", "error": str(state.failure)}, 503)
        if state.batcher is None:
            return JSONResponse({"status": "loading"}, 503)
        return JSONResponse({"status": "ready", "queue": len(state.batcher.queue), "replica": state.replica})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        if state.batcher is None or state.service is None:
            return error_response(503, "loading", "the models are still loading")
        described = {**state.models, AUTO: state.service.auto_choices()}  # auto's choices made so far
        return JSONResponse({"object": "list", "data": [{"id": state.models["target"], "object": "model",
                                                         **described}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.post("/v1/recommend", response_model=RecommendResponse)
    async def recommend(body: RecommendRequest, request: Request) -> Any:
        def respond(query: Query, result: Answer, stats: RecommendStats) -> RecommendResponse:
            return RecommendResponse(items=result.items, scores=result.scores, decoder=result.decoder,
                                     requested_decoder=query.decoder, fewer_reason=result.fewer_reason, stats=stats)

        return await state.answer(request, "recommend", lambda service: service.parse(body), respond)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        def respond(query: Query, result: Answer, stats: RecommendStats) -> ChatCompletionResponse:
            choices = [ChatChoice(index=i, message=ChatChoiceMessage(content=identifier), item=item, score=score)
                       for i, (item, score, identifier) in enumerate(zip(result.items, result.scores,
                                                                         result.identifiers))]
            length = int(query.prompt.numel())
            completion = len(choices) * int(state.models["identifier_length"])
            return ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                          model=body.model or state.models["target"], choices=choices,
                                          usage=ChatUsage(prompt_tokens=length, completion_tokens=completion,
                                                          total_tokens=length + completion),
                                          decoder=result.decoder, fewer_reason=result.fewer_reason, stats=stats)

        return await state.answer(request, "chat", lambda service: service.parse_chat(body), respond)

    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    return app


def _queued_s(pending: Pending) -> float:
    return (pending.started or pending.arrived) - pending.arrived


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read, so the next ASGI message is
    the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
