"""The routes of the HTTP service (:mod:`recspec.serve.app`): health, models, metrics, and the
recommend, chat and completions endpoints, each a small handler over the app's
:class:`~recspec.serve.app.State` (``request.app.state.recspec``), which checks, queues and
answers every request. The two OpenAI endpoints answer in one shape, built by one function
(:func:`openai_answer`): a choice per item, the response, and that response as it stands or
streamed as server-sent events.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from recspec.recommend import AUTO
from recspec.serve.schemas import (ChatChoice, ChatChoiceMessage, ChatCompletionRequest, ChatCompletionResponse,
                                   ChatUsage, CompletionChoice, CompletionRequest, CompletionResponse, OpenAIRequest,
                                   RecommendRequest, RecommendResponse, RecommendStats)
from recspec.serve.service import Answer, Query, RecommendService

if TYPE_CHECKING:
    from recspec.serve.app import State

#: The service's routes; :func:`~recspec.serve.app.create_app` includes them in its app.
router = APIRouter()


def state_of(request: Request) -> State:
    """The :class:`~recspec.serve.app.State` of the app answering ``request``."""
    return request.app.state.recspec


@router.get("/health/live")
async def live(request: Request) -> JSONResponse:
    """Liveness: the process answers (a failed load stops it)."""
    return JSONResponse({"status": "live", "replica": state_of(request).replica})


@router.get("/health/ready")
@router.get("/health")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the models are loaded and warm, 503 while loading or once failed."""
    state = state_of(request)
    if state.failure is not None:
        return JSONResponse({"status": "failed", "error": str(state.failure)}, 503)
    if not state.ready or state.batcher is None:
        return JSONResponse({"status": "loading"}, 503)
    return JSONResponse({"status": "ready", "queue": len(state.batcher.queue), "replica": state.replica})


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = state_of(request)
    if not state.ready:
        return state.refuse(None, 503, "loading", "the models are still loading", {"Retry-After": "1"})
    return JSONResponse({"object": "list", "data": [{**state.models, AUTO: await state.auto_choices()}]})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


@router.post("/v1/recommend", response_model=RecommendResponse)
async def recommend(body: RecommendRequest, request: Request) -> Any:
    def respond(query: Query, result: Answer, stats: RecommendStats) -> RecommendResponse:
        return RecommendResponse(items=result.items, scores=result.scores, decoder=result.decoder,
                                 requested_decoder=query.decoder, fewer_reason=result.fewer_reason, stats=stats)

    return await state_of(request).answer(request, "recommend", lambda service: service.parse(body), respond)


@dataclass(frozen=True)
class OpenAIShape:
    """How an OpenAI endpoint answers: its ``response`` class, the ``choice`` of one item (its
    rank, raw id, score and identifier), the prefix of the answer's id, the ``chunk`` object of
    each streamed event, and a choice as a streamed event carries it (``streamed``)."""

    response: type[ChatCompletionResponse] | type[CompletionResponse]
    choice: Callable[[int, str, float, str], ChatChoice | CompletionChoice]
    id_prefix: str
    chunk: str
    streamed: Callable[[Any], dict[str, Any]]


#: /v1/chat/completions: each item an assistant message, streamed as OpenAI's chat deltas.
CHAT = OpenAIShape(
    ChatCompletionResponse,
    lambda i, item, score, identifier: ChatChoice(index=i, message=ChatChoiceMessage(content=identifier), item=item,
                                                  score=score),
    "chatcmpl", "chat.completion.chunk",
    lambda choice: {"index": choice.index, "delta": choice.message.model_dump(), "finish_reason": "stop",
                    "item": choice.item, "score": choice.score})
#: /v1/completions: each item a text, streamed as it stands.
COMPLETION = OpenAIShape(
    CompletionResponse,
    lambda i, item, score, identifier: CompletionChoice(index=i, text=identifier, item=item, score=score),
    "cmpl", "text_completion", lambda choice: choice.model_dump())


def openai_answer(shape: OpenAIShape, model: str, identifier_length: int, stream: bool, query: Query, result: Answer,
                  stats: RecommendStats) -> ChatCompletionResponse | CompletionResponse | StreamingResponse:
    """The answer of an OpenAI endpoint of ``shape`` to ``query`` (its ``result`` and ``stats``),
    naming the served ``model``: a choice per item, best first, and the tokens used (each item's
    identifier ``identifier_length`` tokens); as server-sent events where ``stream``."""
    choices = [shape.choice(i, item, score, identifier) for i, (item, score, identifier) in ranked(result)]
    prompt = int(query.prompt.numel())
    completion = len(choices) * identifier_length
    usage = ChatUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    answer = shape.response(id=f"{shape.id_prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                            choices=choices, usage=usage, decoder=result.decoder, fewer_reason=result.fewer_reason,
                            stats=stats)
    if not stream:
        return answer
    return event_stream(stream_head(answer, shape.chunk), [shape.streamed(choice) for choice in choices])


async def openai_route(request: Request, endpoint: str, shape: OpenAIShape, body: OpenAIRequest,
                       parse: Callable[[RecommendService], Query]) -> Any:
    """What the OpenAI ``endpoint`` of ``shape`` answers to ``body`` (``parse`` makes its query),
    or its refusal."""
    state = state_of(request)

    def respond(query: Query, result: Answer, stats: RecommendStats) -> Any:
        return openai_answer(shape, state.config.model_name, int(state.models["identifier_length"]), body.stream,
                             query, result, stats)

    return await state.answer(request, endpoint, parse, respond)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat(body: ChatCompletionRequest, request: Request) -> Any:
    return await openai_route(request, "chat", CHAT, body, lambda service: service.parse_chat(body))


@router.post("/v1/completions", response_model=CompletionResponse)
async def complete(body: CompletionRequest, request: Request) -> Any:
    return await openai_route(request, "completions", COMPLETION, body, lambda service: service.parse_completion(body))


def ranked(result: Answer) -> Iterator[tuple[int, tuple[str, float, str]]]:
    """An answer's items best first: ``(rank, (item, score, identifier))``."""
    return enumerate(zip(result.items, result.scores, result.identifiers))


def stream_head(answer: ChatCompletionResponse | CompletionResponse, kind: str) -> dict[str, Any]:
    """What every streamed event of ``answer`` repeats (OpenAI's chunk fields of ``kind``)."""
    return {"id": answer.id, "object": kind, "created": answer.created, "model": answer.model,
            "decoder": answer.decoder, "fewer_reason": answer.fewer_reason}


def event_stream(head: dict[str, Any], choices: list[dict[str, Any]]) -> StreamingResponse:
    """An answer as server-sent events, as OpenAI streams one: an event per item (``head`` with that
    item's choice), then ``data: [DONE]``."""
    def events() -> Iterator[str]:
        for choice in choices:
            yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
