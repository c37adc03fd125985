"""``recspec knowledge generate --engine ray``: a job's requests decoded by a pool of Ray actors.

The job is the one of :func:`~recspec.knowledge.job.run_job` (same store, same batches, same
resume rule); only its runner differs. This process plans the work: the entities still missing
from the store, their prompts, and the pools they draft from, whose routing (an MF-BPR model for
the collaborative pools) and tries are built here once and shipped to the actors through Ray's
object store. Each actor (:class:`KnowledgeWorker`, a Ray Data callable class) loads the target
model once and decodes batches; every result flows back to this process, the store's one writer,
which commits it as today, so a crash loses at most the requests in flight and a re-run resumes
without duplicates. Greedy texts do not depend on which actor decoded them or when, so they equal
the single-process ones. A job whose own output is its pool (an old part drafted with ``resd`` or
``laser`` and no ``--pool``) needs each text before the next request and stays in one process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, fields
from typing import Any

import numpy as np
import torch

from recspec.cluster.runtime import Workers, check_address, connect, map_on_actors, ray_errors
from recspec.errors import RecspecError
from recspec.knowledge.decode import Generation
from recspec.knowledge.job import DRAFTING, Batches, KnowledgeConfig, KnowledgeTask, Runner, make_generator
from recspec.knowledge.pools import PoolSet


class KnowledgeWorker:
    """A Ray Data callable class: the target model loaded once per actor; each call decodes one
    batch (column ``batch``: JSON ``[entities, prompts]``) and returns one row per request."""

    def __init__(self, task_args: dict[str, Any], config: KnowledgeConfig, pools: Any, threads: int) -> None:
        import ray

        torch.set_num_threads(threads)
        task = KnowledgeTask(**task_args)
        self.generate = make_generator(task, config, ray.get(pools) if isinstance(pools, ray.ObjectRef) else pools)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows: dict[str, list] = {"entity": [], **{f.name: [] for f in fields(Generation)}}
        for payload in batch["batch"].tolist():  # one job batch per call (batch_size=1)
            entities, prompts = json.loads(payload)
            for entity, generation in zip(entities, self.generate(entities, prompts)):
                rows["entity"].append(entity)
                for name, value in asdict(generation).items():
                    rows[name].append(json.dumps(value) if name == "tokens" else value)
        return {name: np.asarray(values) for name, values in rows.items()}


def ray_runner(task_args: dict[str, Any], workers: Workers, address: str | None = None) -> Runner:
    """A :data:`~recspec.knowledge.job.Runner` that decodes a job's batches on ``workers``
    Ray actors (each a :class:`KnowledgeWorker` over ``KnowledgeTask(**task_args)``)."""
    check_address(address)

    def run(task: KnowledgeTask, config: KnowledgeConfig, pools: PoolSet | None,
            batches: Batches) -> Iterator[tuple[list[int], list[Generation]]]:
        if not batches:
            return
        import ray

        connect(address, workers=workers)
        if pools is not None:  # build every pool the batches draft from here, once
            for entities, _ in batches:
                for entity in entities:
                    pools.trie_for(entity)
        results = map_on_actors([{"batch": json.dumps([entities, prompts])} for entities, prompts in batches],
                                KnowledgeWorker, workers, task_args={**task_args, "device": workers.device},
                                config=config, pools=ray.put(pools), threads=workers.cpus)
        with ray_errors():
            for block in results.iter_batches(batch_size=None, batch_format="numpy"):
                entities = [int(e) for e in block["entity"].tolist()]
                yield entities, [Generation(**{f.name: json.loads(block[f.name][i]) if f.name == "tokens"
                                               else block[f.name][i].item() for f in fields(Generation)})
                                 for i in range(len(entities))]

    return run


def check_shared_pools(config: KnowledgeConfig, pool: object) -> None:
    """Refuse a Ray job whose pools would be its own output (module doc)."""
    if pool is None and config.method in DRAFTING:
        raise RecspecError(f"method {config.method} without --pool drafts from the job's own texts as they come, "
                           f"one request after another: run it with --engine local, or pass --pool")
