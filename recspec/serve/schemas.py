"""Request and response bodies of the service (pydantic), validated before anything reaches a model.

Field types are strict: item ids are strings (a number is refused, not coerced), ``k`` an integer.
What depends on the loaded models (unknown items, ``k`` above the catalogue, a decoder that needs
a draft) is checked by :class:`~recspec.serve.service.RecommendService`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

#: The most items a history or an exclusion list may name (a request larger than this is refused).
MAX_LIST = 10_000

#: Items returned when a request names no ``k``.
DEFAULT_K = 10


class RecommendRequest(BaseModel):
    """``history``: raw item ids, oldest first (the last ``max_history`` of the trained split are
    used, as in training); ``k``: items to return; ``decoder``: default the server's;
    ``exclude``: raw item ids never to return (the search runs over the catalogue without them);
    ``timeout_ms``: this request's deadline, at most the server's."""

    model_config = ConfigDict(extra="forbid")

    history: list[StrictStr] = Field(min_length=1, max_length=MAX_LIST)
    k: StrictInt = DEFAULT_K
    decoder: StrictStr | None = None
    exclude: list[StrictStr] = Field(default_factory=list, max_length=MAX_LIST)
    timeout_ms: StrictInt | None = Field(default=None, ge=1)


class RecommendStats(BaseModel):
    """Per request: drafted steps accepted (AS), target calls, the size of the batch it was
    decoded in, and milliseconds queued, decoding (the whole batch) and in all."""

    accepted_steps: float
    target_calls: float
    batch_size: int
    queue_ms: float
    decode_ms: float
    ms: float


class RecommendResponse(BaseModel):
    items: list[str]
    scores: list[float]
    decoder: str
    requested_decoder: str
    stats: RecommendStats


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: StrictStr


class ChatCompletionRequest(BaseModel):
    """OpenAI-style: ``messages`` rendered by the tokenizer's chat template with the assistant turn
    opened; ``n`` is K, one choice per item. Other OpenAI fields (temperature, max_tokens, ...) are
    accepted and ignored: the answer is always the exact top-``n`` (or the server's decoder)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    n: StrictInt = 10
    decoder: StrictStr | None = None
    timeout_ms: StrictInt | None = Field(default=None, ge=1)


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One item: its identifier as the message, its raw id and score (sum of log-probabilities)."""

    index: int
    message: ChatChoiceMessage
    finish_reason: Literal["stop"] = "stop"
    item: str
    score: float


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    decoder: str
    stats: RecommendStats
