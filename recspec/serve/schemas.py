"""Request and response bodies of the service (pydantic), validated before anything reaches a model.

Field types are strict: item ids are strings (a number is refused, not coerced), ``k`` an integer.
Every string must be Unicode text that UTF-8 can carry (:data:`Text`: JSON's ``"\\ud800"`` escape
decodes to a lone surrogate, which no answer or log line could hold), and every size is bounded
here (lists, deadlines), so an absurd request is a 422 before anything is allocated for it.
What depends on the loaded models (unknown items, ``k`` above the catalogue, a decoder that needs
a draft) is checked by :class:`~recspec.serve.service.RecommendService`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

#: The most items a history or an exclusion list may name (a request larger than this is refused).
MAX_LIST = 10_000

#: Items returned when a request names no ``k``.
DEFAULT_K = 10

#: The largest ``k`` (in magnitude) a request may name; the service checks the others against the catalogue.
MAX_K = 2**31 - 1

#: The longest raw prompt /v1/completions takes, in characters (the model's positions bound it further).
MAX_PROMPT_CHARS = 1_000_000

#: The longest deadline a request may ask for (a day, in milliseconds); the server's ``--timeout-s``
#: bounds it further.
MAX_TIMEOUT_MS = 86_400_000


def encodable(text: str) -> str:
    """``text`` when UTF-8 can encode it; a lone surrogate is refused (pydantic makes it a 422)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode "
                         "text") from None
    return text


#: A string field of a request: strict, and valid Unicode (:func:`encodable`).
Text = Annotated[StrictStr, AfterValidator(encodable)]
#: How many items a request asks for.
Count = Annotated[StrictInt, Field(ge=-MAX_K, le=MAX_K)]
#: A request's own deadline in milliseconds.
TimeoutMs = Annotated[StrictInt, Field(ge=1, le=MAX_TIMEOUT_MS)]


class RecommendRequest(BaseModel):
    """``history``: raw item ids, oldest first (the last ``max_history`` of the trained split are
    used, as in training); ``k``: items to return; ``decoder``: default the server's;
    ``exclude``: raw item ids never to return (the search runs over the catalogue without them);
    ``timeout_ms``: this request's deadline, at most the server's."""

    model_config = ConfigDict(extra="forbid")

    history: list[Text] = Field(min_length=1, max_length=MAX_LIST)
    k: Count = DEFAULT_K
    decoder: Text | None = None
    exclude: list[Text] = Field(default_factory=list, max_length=MAX_LIST)
    timeout_ms: TimeoutMs | None = None


class RecommendStats(BaseModel):
    """Per request: drafted steps accepted (AS), target calls, the size of the batch it was
    decoded in, and milliseconds queued, decoding (the whole batch) and in all."""

    accepted_steps: float
    target_calls: float
    batch_size: int
    queue_ms: float
    decode_ms: float
    ms: float


#: What ``fewer_reason`` of an answer means.
FEWER_REASON = ("why the answer holds fewer than the k items asked for (null when it holds k): dsbd draws its k "
                "beams independently, with replacement, so an item drawn twice comes out once")


class RecommendResponse(BaseModel):
    """The items best first, their scores, the decoder that ran (``auto``'s choice) and the one asked
    for, ``fewer_reason`` (:data:`FEWER_REASON`) and the request's statistics."""

    items: list[str]
    scores: list[float]
    decoder: str
    requested_decoder: str
    fewer_reason: str | None = Field(default=None, description=FEWER_REASON)
    stats: RecommendStats


class TextPart(BaseModel):
    """One part of an OpenAI content-part array; only text parts carry what this service reads."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


#: Roles of a chat message. OpenAI's ``developer`` is its newer name for ``system`` (the
#: instructions of whoever deploys the model): the chat template is given it as ``system``.
Role = Literal["system", "developer", "user", "assistant"]


class ChatMessage(BaseModel):
    """A message as OpenAI defines it: ``content`` a string or an array of text parts (joined with
    newlines, as vLLM does); ``name`` and other fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    role: Role
    content: Text | list[TextPart] = Field(union_mode="left_to_right")

    def text(self) -> str:
        """The message's text: its content, or its text parts joined with newlines."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as a chat template takes it (``developer`` as ``system``)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class OpenAIRequest(BaseModel):
    """What /v1/chat/completions and /v1/completions share: ``model`` (any name; the answer names
    the served one), ``n`` is K (one choice per item), ``stream`` answers as server-sent events (one
    event per item, then ``[DONE]``). Other OpenAI fields (temperature, max_tokens, ...) are
    accepted and ignored: the answer is always the exact top-``n`` (or the server's decoder)."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    n: Count = DEFAULT_K
    stream: StrictBool = False
    decoder: Text | None = None
    timeout_ms: TimeoutMs | None = None


class ChatCompletionRequest(OpenAIRequest):
    """``messages`` rendered by the tokenizer's chat template with the assistant turn opened."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=256)


class CompletionRequest(OpenAIRequest):
    """``prompt``: raw text, tokenized as it stands (no chat template, no special tokens added)."""

    prompt: Text = Field(min_length=1, max_length=MAX_PROMPT_CHARS)


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
    fewer_reason: str | None = Field(default=None, description=FEWER_REASON)
    stats: RecommendStats


class CompletionChoice(BaseModel):
    """One item of /v1/completions: its identifier as the text, its raw id and score."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop"] = "stop"
    item: str
    score: float


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: ChatUsage
    decoder: str
    fewer_reason: str | None = Field(default=None, description=FEWER_REASON)
    stats: RecommendStats
