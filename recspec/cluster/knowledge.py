"""``recspec knowledge generate --engine ray``: a job's requests decoded by Ray workers.

The job is the one of :func:`~recspec.knowledge.job.run_job` (same store, same batches, same
resume rule); only its runner differs. This process plans the work: the entities still missing
from the store, their prompts, and the pools they draft from, whose routing (an MF-BPR model for
the collaborative pools) and tries are built here once and shipped to the workers through Ray's
object store. Each worker process builds a :class:`KnowledgeWorker` once per job, which loads the
target model, and decodes batches as Ray tasks (:func:`~recspec.cluster.runtime.map_on_workers`);
every result flows back to this process, the store's one writer,
which commits it as today, so a crash loses at most the requests in flight and a re-run resumes
without duplicates. Greedy texts do not depend on which worker decoded them or when, so they equal
the single-process ones. A job whose own output is its pool (an old part drafted with ``resd`` or
``laser`` and no ``--pool``) needs each text before the next request and stays in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from recspec.cluster.runtime import Workers, check_address, connect, map_on_workers, ray_errors
from recspec.decoding.text_rounds import Generation
from recspec.errors import RecspecError
from recspec.knowledge.job import DRAFTING, Batches, KnowledgeConfig, KnowledgeTask, Runner, make_generator
from recspec.knowledge.pools import PoolSet


class KnowledgeWorker:
    """What a Ray worker process builds once per job: the target model loaded; each call decodes
    one batch ``(entities, prompts)`` and returns its generations."""

    def __init__(self, task_args: dict[str, Any], config: KnowledgeConfig, pools: Any) -> None:
        """``pools``: the Ray object reference of the job's :class:`PoolSet` (or of None)."""
        import ray

        task = KnowledgeTask(**task_args)
        self.generate = make_generator(task, config, ray.get(pools))

    def __call__(self, batch: tuple[list[int], list[list[int]]]) -> tuple[list[int], list[Generation]]:
        entities, prompts = batch
        return entities, list(self.generate(entities, prompts))


def ray_runner(task_args: dict[str, Any], workers: Workers, address: str | None = None) -> Runner:
    """A :data:`~recspec.knowledge.job.Runner` that decodes a job's batches on ``workers`` Ray
    workers (each building a :class:`KnowledgeWorker` over ``KnowledgeTask(**task_args)``)."""
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
        with ray_errors():
            for (entities, generations), _, _ in map_on_workers(
                    list(batches), KnowledgeWorker, workers, task_args={**task_args, "device": workers.device},
                    config=config, pools=ray.put(pools)):
                yield entities, generations

    return run


def check_shared_pools(config: KnowledgeConfig, pool: object) -> None:
    """Refuse a Ray job whose pools would be its own output (module doc)."""
    if pool is None and config.method in DRAFTING:
        raise RecspecError(f"method {config.method} without --pool drafts from the job's own texts as they come, "
                           f"one request after another: run it with --engine local, or pass --pool")
