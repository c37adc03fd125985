"""What ``recspec serve`` serves and how (:class:`ServeConfig`), and the service it loads.

Kept apart from the HTTP app so that the decode worker process (:mod:`recspec.serve.worker`)
loads the same service from the same settings without importing the web framework; the settings
cross into that process as JSON (:meth:`ServeConfig.settings`), never as a pickle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recspec.recommend import AUTO, DecodeOptions
from recspec.serve.schemas import DEFAULT_K

if TYPE_CHECKING:
    from recspec.serve.service import RecommendService

#: The fields of :class:`ServeConfig` the decode worker needs, as JSON.
WORKER_FIELDS = ("target", "draft", "decoder", "device", "dtype", "draft_dtype", "max_batch", "threads", "auto_k")


@dataclass(frozen=True)
class ServeConfig:
    """What ``recspec serve`` takes: the model folders, the default decoder and its options, the
    batching limits (``max_batch`` 1 serves one request at a time), the request deadline and body
    limit, torch threads of the decode (None: leave torch's default), and the values of ``k`` an
    ``auto`` server makes its choices for before it is ready (``auto_k``; others are measured in
    the background). ``api_key``: the bearer key every request but the health checks and metrics
    must carry (None: none asked; never shown in a repr or a log); ``served_model_name``: the
    model's name in /v1/models and in answers (None: the target folder's name);
    ``decode_process``: decode in a worker process (:mod:`recspec.serve.worker`) rather than a
    thread of the server's."""

    target: Path
    draft: str | None = None
    decoder: str = AUTO
    options: DecodeOptions = DecodeOptions()
    device: str = "cpu"
    dtype: str = "auto"  # the models' dtypes (recspec.precision; draft None: the target's)
    draft_dtype: str | None = None
    max_batch: int = 16
    max_wait_ms: float = 5.0
    max_queue: int = 256
    timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    threads: int | None = None
    auto_k: tuple[int, ...] = (DEFAULT_K,)
    api_key: str | None = field(default=None, repr=False)
    served_model_name: str | None = None
    decode_process: bool = False
    on_failure: Callable[[BaseException], None] = field(default=lambda err: None, compare=False, repr=False)

    @property
    def model_name(self) -> str:
        """The name the model is served under."""
        return self.served_model_name or Path(self.target).resolve().name

    def settings(self) -> str:
        """What the decode worker needs to load the service, as JSON (the key and callbacks stay here)."""
        if self.options.planner is not None:
            raise ValueError("the decode worker takes decode options without a cost planner")
        options = {f.name: getattr(self.options, f.name) for f in fields(DecodeOptions) if f.name != "planner"}
        chosen = {name: getattr(self, name) for name in WORKER_FIELDS}
        draft = None if self.draft is None else str(self.draft)
        return json.dumps({**chosen, "target": str(self.target), "draft": draft, "auto_k": list(self.auto_k),
                           "options": options})

    @classmethod
    def from_settings(cls, text: str) -> ServeConfig:
        """The config :meth:`settings` describes (or any JSON object of its fields, ``target`` at
        least: the others keep their defaults)."""
        settings: dict[str, Any] = json.loads(text)
        converted: dict[str, Callable[[Any], Any]] = {"target": Path, "auto_k": tuple,
                                                      "options": lambda options: DecodeOptions(**options)}
        return cls(**{name: converted.get(name, lambda value: value)(value) for name, value in settings.items()})


def load_service(config: ServeConfig, decoding: bool = True) -> RecommendService:
    """Load the models of ``config`` as a serving :class:`~recspec.serve.service.RecommendService`.
    ``decoding``: it decodes (on ``config.device``, with ``config.threads`` torch threads; an
    ``auto`` service makes its choices for ``config.auto_k`` now, before any request); otherwise it
    only checks and parses requests for a decode worker (on the CPU, one thread, nothing measured,
    no model weights loaded: ``Recommender.load``'s ``weights``)."""
    import torch

    from recspec.recommend import Recommender
    from recspec.serve.service import RecommendService

    threads, device = (config.threads, config.device) if decoding else (1, "cpu")
    if threads is not None:
        torch.set_num_threads(threads)
    recommender = Recommender.load(config.target, device=device, draft_dir=config.draft, folder_only=True,
                                   dtype=config.dtype, draft_dtype=config.draft_dtype, weights=decoding)
    service = RecommendService(recommender, config.decoder, config.options, config.max_batch, serving=True)
    if decoding and service.decoder == AUTO:
        for k in config.auto_k:
            service.check_k(k)
            service.prepare(k)
    return service

