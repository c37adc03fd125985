"""The Python API: ``recspec.load(target, draft=None).recommend(histories)`` for raw histories,
``recspec.recommend_users(...)`` and ``recspec.generate_knowledge(...)`` for the batch
jobs (``recspec.knowledge`` is the package of the knowledge modules); the ``recspec``
command is a thin layer over these (it parses options, builds the configs and calls them).

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

:func:`recommend_users` decodes every test (or validation) user of a data set and writes their
top-K as JSON lines, in this process or on Ray (:class:`Engine`), exactly as ``recspec
recommend``; :func:`generate_knowledge` generates user or item knowledge into a resumable store, exactly as
``recspec knowledge generate``. Both return a report whose :meth:`lines` the command prints.

>>> report = recspec.recommend_users("runs/models/ml-target", "recs.jsonl", decoder="tree-beam", users=100)
>>> run = recspec.generate_knowledge("users-old.sqlite", KnowledgeConfig(part="old", method="hf"), limit=8)
>>> run.texts()  # {"<user id>": "<profile text>", ...}
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from recspec.cluster.knowledge import check_shared_pools, ray_runner
from recspec.cluster.recommend import RayReport, recommend_on_ray
from recspec.cluster.runtime import Engine
from recspec.devices import resolve_device
from recspec.errors import RecspecError
from recspec.fileio import check_output_file, check_writable_dir
from recspec.importer import PeerSpec, load_peer
from recspec.knowledge.job import (JobSummary, KnowledgeConfig, KnowledgeTask, local_runner, run_job,
                                   set_threads)
from recspec.knowledge.store import read_rows
from recspec.hub import resolve_model_dir
from recspec.precision import dtype_name, text_precisions
from recspec.recommend import AUTO, TREE_BEAM, DecodeOptions, RecommendJob, Recommender, check_decoder, write_recs
from recspec.serve.schemas import RecommendRequest
from recspec.serve.service import Answer, BadRequest, Query, RecommendService


class RecspecModel:
    """A loaded target (and draft) answering raw histories (module doc)."""

    def __init__(self, service: RecommendService) -> None:
        self.service = service

    @property
    def device(self) -> str:
        """Where the models run (``auto`` resolved at :func:`load`: CUDA where present)."""
        return str(next(self.service.recommender.model.parameters()).device)

    @property
    def dtype(self) -> str:
        """The target's dtype (``float32``, ``bfloat16``, ``float16``; ``auto`` resolved at :func:`load`)."""
        return dtype_name(self.service.recommender.model.dtype)

    @property
    def notes(self) -> list[str]:
        """What :func:`load` chose and why (the dtypes), one line each."""
        return list(self.service.recommender.notes)

    @property
    def decoders(self) -> list[str]:
        """The decoders the loaded models can run."""
        return self.service.decoders

    def recommend(self, histories: Iterable[Iterable[str]], k: int = 10, decoder: str | None = None,
                  exclude: Iterable[str] = (), batch_size: int = 16) -> list[Answer]:
        """The top-``k`` items of each history (raw item ids, oldest first; the last
        ``max_history`` of training are used), none of ``exclude``; one
        :class:`~recspec.serve.service.Answer` per history, in order (``fewer_reason`` says why one
        holds fewer than ``k`` items). ``decoder``: default the one given to :func:`load`. Any
        iterable serves as a list (a generator, a tuple: read once); None, a string or a number
        where a list belongs is a :class:`~recspec.errors.RecspecError`."""
        rows = [listed(history, f"{HISTORIES}; history {i}")
                for i, history in enumerate(listed(histories, HISTORIES))]
        excluded = listed(exclude, "exclude is a list of raw item ids never to return")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RecspecError(f"batch_size must be an integer of at least 1, got {batch_size!r}")
        queries = [self._query(i, history, k, decoder, excluded) for i, history in enumerate(rows)]
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

    def _query(self, i: int, history: list[str], k: int, decoder: str | None, exclude: list[str]) -> Query:
        try:
            request = RecommendRequest(history=history, k=k, decoder=decoder, exclude=exclude)
            return self.service.parse(request)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise RecspecError(f"history {i}: {where}: {first['msg']}") from None
        except BadRequest as err:
            raise RecspecError(f"history {i}: {err}") from None


#: What :meth:`RecspecModel.recommend` takes as ``histories``.
HISTORIES = "histories is a list of histories, each a list of raw item ids (oldest first)"


def listed(values: Iterable[Any], what: str) -> list[Any]:
    """``values`` (any iterable but a string: a list, a tuple, a generator) as a list; anything else
    is a :class:`~recspec.errors.RecspecError` saying ``what`` belongs there."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise RecspecError(f"{what}, got {_shown(values)}")
    return list(values)


def _shown(value: Any) -> str:
    """``value`` for an error line: its type and repr, cut short."""
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return text if value is None else f"{type(value).__name__} {text}"


def load(target: str | Path, draft: str | Path | None = None, decoder: str = AUTO, device: str = "auto",
         threads: int | None = None, draft_beams: int = 40, dtype: str = "auto",
         draft_dtype: str | None = None) -> RecspecModel:
    """Load ``target`` (a model folder of ``recspec train`` or ``recspec import``) and ``draft``
    for :meth:`RecspecModel.recommend`, from the folders alone (no data set is read, so a folder
    serves where its data set is not; ``--draft items`` excepted, which is fitted on the data set);
    ``decoder``: its default; ``device``: cpu, cuda, cuda:N
    or auto (CUDA where present; :attr:`RecspecModel.device` says which); ``threads``: torch's
    CPU threads (None: leave torch's default); ``dtype``: auto, float32, bfloat16 or float16
    (:mod:`recspec.precision`: auto is the saved dtype on CUDA, float32 on a CPU;
    :attr:`RecspecModel.notes` says which and why); ``draft_dtype``: a draft model's (None: the
    target's)."""
    check_decoder(decoder, draft is not None)
    if threads is not None:
        if threads < 1:
            raise RecspecError(f"threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    recommender = Recommender.load(target, device=str(resolve_device(device)), draft_dir=draft, folder_only=True,
                                   dtype=dtype, draft_dtype=draft_dtype)
    return RecspecModel(RecommendService(recommender, decoder, DecodeOptions(draft_beams=draft_beams)))


@dataclass
class RecommendReport:
    """What :func:`recommend_users` did: ``users`` decoded in ``seconds`` with ``decoder``
    (``choice``: what ``auto`` ran and why), the speculative decoders' per-user statistics,
    ``notes`` on a model trained elsewhere, and on Ray the cluster's report."""

    out: Path
    decoder: str
    users: int = 0
    seconds: float = 0.0
    choice: str = ""
    stats: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)
    ray: RayReport | None = None

    def lines(self) -> list[str]:
        """What ``recspec recommend`` prints."""
        if self.ray is not None:
            return [self.ray.line(self.out, self.decoder)]
        lines = [f"note: {note}" for note in self.notes] + ([self.choice] if self.choice else [])
        lines.append(f"{self.users} users in {self.seconds:.1f} s ({self.users / self.seconds:.1f} users/s) with "
                     f"{self.decoder}; wrote {self.out}")
        if self.stats is not None:
            lines.append(f"accepted steps {self.stats['accepted_steps']:.2f}/user, target calls "
                         f"{self.stats['target_calls']:.2f}/user, draft calls {self.stats['draft_calls']:.2f}/user, "
                         f"tree nodes {self.stats['tree_nodes']:.1f}/user")
        return lines


def recommend_users(target: str | Path, out: str | Path, k: int = 10, decoder: str = TREE_BEAM,
                    draft: str | None = None, options: DecodeOptions = DecodeOptions(), dataset: str | None = None,
                    format: str | None = None, part: str = "test", users: int | None = None, batch_size: int = 16,
                    device: str = "auto", overwrite: bool = False, peer: PeerSpec | None = None,
                    engine: Engine = Engine(), progress: bool = True, dtype: str = "auto",
                    draft_dtype: str | None = None) -> RecommendReport:
    """The top-``k`` items of every ``part`` user (the first ``users``) of ``target``'s data set
    (``dataset``: another one), written to ``out`` as JSON lines (user, items, scores) once every
    user is decoded; ``peer``: a checkpoint trained elsewhere, used as ``recspec import`` would
    (``target`` is then its model folder); on Ray the users are decoded in resumable shards
    (``OUT.parts/``) and ``out`` is the same file. ``dtype`` / ``draft_dtype``: as :func:`load`
    (on Ray, resolved on the workers' device); the report's notes say what was chosen."""
    out = Path(out)
    check_output_file(out, overwrite)
    for name, value in (("k", k), ("users", users), ("batch_size", batch_size),
                        ("draft_beams", options.draft_beams)):
        if value is not None and value < 1:
            raise RecspecError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    device = str(resolve_device(device))
    check_decoder(decoder, draft is not None)
    job = RecommendJob(Path(target), decoder, k, draft, options, dataset, format, part, users, batch_size, dtype,
                       draft_dtype)
    if engine.name == "ray":
        if peer is not None:
            raise RecspecError("--engine ray loads a model folder on every worker: run `recspec import` first")
        return RecommendReport(out, decoder, ray=recommend_on_ray(job, out, engine.workers, engine.address,
                                                                  overwrite, progress))
    notes: list[str] = []
    if peer is None:
        recommender = job.load(device)
    else:
        recommender, notes = load_peer(peer, device, job.draft_dir, k, dtype, draft_dtype)
    notes += recommender.notes
    started = time.perf_counter()
    examples, decoded = job.decode(recommender, progress=progress)
    seconds = time.perf_counter() - started
    write_recs(out, recommender, examples, decoded.topk)
    stats = decoded.stats.summary() if decoded.stats is not None else None
    return RecommendReport(out, decoder, len(examples), seconds, decoded.choice, stats, notes)


@dataclass
class KnowledgeRun:
    """What :func:`generate_knowledge` did (``summary``) and where the texts are (``store``);
    ``notes``: what was chosen for the user (the dtype ``auto`` chose on CUDA)."""

    store: Path
    summary: JobSummary
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What ``recspec knowledge generate`` prints."""
        return [f"note: {note}" for note in self.notes] + [self.summary.line()]

    def texts(self) -> dict[str, str]:
        """Every text of the store (this run's and earlier ones), by user or item id."""
        return {row.entity: row.text for row in read_rows(self.store)}


def generate_knowledge(out: str | Path, config: KnowledgeConfig = KnowledgeConfig(), pool: str | Path | None = None,
              limit: int | None = None, model: str = "smollm2", dataset: str = "ml-100k", seed: int = 0,
              device: str = "auto", threads: int | None = None, engine: Engine = Engine(),
              progress: bool = True, dtype: str = "auto") -> KnowledgeRun:
    """Generate ``config``'s knowledge (side, part, method, verification, ...) with the LLM
    ``model`` for every user or item of ``dataset`` (the first ``limit``) missing from the store
    ``out`` (SQLite; an existing one is resumed), each text persisted as it completes; ``pool``:
    the old-part store LASER and ReSD draft from. On Ray, Ray workers decode and this process stores.
    ``dtype``: the model's (:func:`~recspec.precision.text_precisions`, for the device that
    decodes: the workers' on Ray); a 16-bit store is its own (its texts differ from float32's)."""
    out = Path(out)
    if out.is_dir():
        raise RecspecError(f"{out}: is a folder; --out takes the file name of a knowledge store")
    check_writable_dir(out.parent)
    if limit is not None and limit < 1:
        raise RecspecError(f"--limit must be at least 1, got {limit}")
    set_threads(threads)
    device = str(resolve_device(device))
    decodes_on = engine.workers.device if engine.name == "ray" else device
    precisions = text_precisions(dtype, None, decodes_on, resolve_model_dir(model), config.draft,
                                 config.draft is not None)
    task = KnowledgeTask(model, dataset, seed=seed, device=device, dtype=precisions.target.name)
    runner = local_runner
    if engine.name == "ray":
        check_shared_pools(config, pool)
        runner = ray_runner({"model": model, "dataset": dataset, "seed": seed, "dtype": precisions.target.name},
                            engine.workers, engine.address)
    return KnowledgeRun(out, run_job(task, config, out, Path(pool) if pool is not None else None, limit,
                                     progress=progress, runner=runner), precisions.notes())
