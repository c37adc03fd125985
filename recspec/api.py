"""The one-call Python API: ``recspec.load(target, draft=None)`` and ``.recommend(histories)``.

``load`` reads a model folder (written by ``recspec train`` or ``recspec import``) and its draft
(a draft model, a head, or both joined by ``+``) once; :meth:`RecspecModel.recommend` takes raw
item-id histories (oldest first) and returns, per history, the top-``k`` raw item ids and their
log-probabilities, best first, by any decoder (``auto``: the fastest exact one for these models,
from measurements kept beside them). Histories are checked first (unknown or repeated ids, a bad
``k`` or decoder: one :class:`~recspec.errors.RecspecError` naming the history), then decoded in
batches of ``batch_size`` that share ``k``, decoder and exclusions: the same engine as
``recspec serve`` (:class:`~recspec.serve.service.RecommendService`), so the answers equal the
service's and ``recspec recommend``'s for the same history.

>>> import recspec
>>> model = recspec.load("runs/models/ml-target", draft="runs/models/ml-draft")
>>> [answer] = model.recommend([["485", "516", "502"]], k=10)
>>> answer.items, answer.scores  # 10 raw ids and their log-probabilities, best first
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import ValidationError

from recspec.devices import resolve_device
from recspec.errors import RecspecError
from recspec.recommend import DecodeOptions, Recommender, check_decoder
from recspec.serve.schemas import RecommendRequest
from recspec.serve.service import Answer, BadRequest, Query, RecommendService


class RecspecModel:
    """A loaded target (and draft) answering raw histories (module doc)."""

    def __init__(self, service: RecommendService) -> None:
        self.service = service

    @property
    def decoders(self) -> list[str]:
        """The decoders the loaded models can run."""
        return self.service.decoders

    def recommend(self, histories: Sequence[Sequence[str]], k: int = 10, decoder: str | None = None,
                  exclude: Sequence[str] = (), batch_size: int = 16) -> list[Answer]:
        """The top-``k`` items of each history (raw item ids, oldest first; the last
        ``max_history`` of training are used), none of ``exclude``; one
        :class:`~recspec.serve.service.Answer` per history, in order. ``decoder``: default the
        one given to :func:`load`."""
        if isinstance(histories, str) or any(isinstance(history, str) for history in histories):
            raise RecspecError("histories is a list of histories, each a list of raw item ids (oldest first)")
        if batch_size < 1:
            raise RecspecError(f"batch_size must be at least 1, got {batch_size}")
        queries = [self._query(i, history, k, decoder, exclude) for i, history in enumerate(histories)]
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, query in enumerate(queries):
            groups[query.key].append(i)
        answers: list[Answer | None] = [None] * len(queries)
        for rows in groups.values():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                for row, answer in zip(chunk, self.service.decode([queries[row] for row in chunk])):
                    answers[row] = answer
        return answers  # type: ignore[return-value]  (every row is filled)

    def _query(self, i: int, history: Sequence[str], k: int, decoder: str | None, exclude: Sequence[str]) -> Query:
        try:
            request = RecommendRequest(history=list(history), k=k, decoder=decoder, exclude=list(exclude))
            return self.service.parse(request)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise RecspecError(f"history {i}: {where}: {first['msg']}") from None
        except BadRequest as err:
            raise RecspecError(f"history {i}: {err}") from None


def load(target: str | Path, draft: str | Path | None = None, decoder: str = "auto", device: str = "cpu",
         threads: int | None = None, draft_beams: int = 40) -> RecspecModel:
    """Load ``target`` (a model folder of ``recspec train`` or ``recspec import``) and ``draft``
    for :meth:`RecspecModel.recommend`; ``decoder``: its default; ``threads``: torch's CPU
    threads (None: leave torch's default)."""
    check_decoder(decoder, draft is not None)
    if threads is not None:
        if threads < 1:
            raise RecspecError(f"threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    recommender = Recommender.load(target, device=str(resolve_device(device)), draft_dir=draft)
    return RecspecModel(RecommendService(recommender, decoder, DecodeOptions(draft_beams=draft_beams)))
