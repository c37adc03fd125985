"""``recspec recommend --engine ray``: the users of a job decoded by Ray workers.

The users are cut into the chunks :meth:`~recspec.recommend.Recommender.recommend` decodes one
after another (:func:`~recspec.recommend.user_chunks`: whole batches, chunk ``i`` of a sampling
decoder seeded ``seed + i``); each chunk is one shard. The shards still to do run as Ray tasks
(:func:`~recspec.cluster.runtime.map_on_workers`) through :class:`ShardWorker`, which each worker
process builds once per job: it loads the target, draft and trie once (``auto`` is resolved once
per worker, from the measurements kept beside the models). Results stream back to this process,
which commits each shard atomically with its checksum (:class:`~recspec.cluster.shards.ShardFolder`,
beside the output as ``OUT.parts/``) and, once all are there, writes ``OUT``: byte for byte the
file the single-process path writes, for every decoder (same batches, same seeds).

Ray runs the shard of a worker that dies again on another, and a re-run skips the shards already
committed, so a job killed at any point loses at most the shards in flight and never writes one
twice. The model folders must be readable at the same paths on every node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from recspec.calibration import draft_identity
from recspec.cluster.runtime import Workers, check_address, connect, map_on_workers, ray_errors
from recspec.cluster.shards import ShardFolder
from recspec.data import load_dataset
from recspec.itemids.index import ItemIndex
from recspec.models.checkpoint import INDEX_FILE, trained_model_dir, weights_fingerprint
from recspec.recommend import (AUTO, RecommendJob, check_folders, folder_precisions, named_draft, recs_text,
                               trained_examples, user_chunks, users_dataset)


def parts_folder(out: Path) -> Path:
    """Where the shards of the job writing ``out`` live: ``OUT.parts/`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".parts")


def job_settings(job: RecommendJob, folder: Path, info: dict[str, Any], drafts: list[Path]) -> dict[str, Any]:
    """What determines a job's output, recorded in its shard folder: the weights of the target
    (its training ``folder`` and run ``info``) and ``drafts``, the decoder and its options, K, data
    set, part, users and batch size, and the dtypes where one is 16-bit (a float32 job's folder
    records none, as before recspec took ``--dtype``)."""
    options = {f.name: getattr(job.options, f.name) for f in fields(job.options) if f.name != "planner"}
    dtypes = {} if job.dtype == job.draft_dtype == "float32" else {"dtype": job.dtype, "draft_dtype": job.draft_dtype}
    return {"target_sha256": weights_fingerprint(trained_model_dir(folder)),
            **draft_identity(drafts, named_draft(job.draft)),
            "decoder": job.decoder, "k": job.k, "options": options, "dataset": job.dataset or info["dataset"],
            "format": job.format, "part": job.part, "users": job.users, "batch_size": job.batch_size, **dtypes}


class ShardWorker:
    """What a Ray worker process builds once per job: the job's models loaded; each call decodes
    one shard and returns its lines, users, decode seconds and speculative statistics."""

    def __init__(self, job: RecommendJob, device: str) -> None:
        self.job = job
        self.recommender = job.load(device)
        self.examples = self.recommender.examples(job.part, job.users)
        self.chunks = user_chunks(len(self.examples), job.batch_size)
        self.decoder, self.options = job.decoder, job.options
        if job.decoder == AUTO:  # once per worker, as the single-process path does once per job
            from recspec.auto import choose

            choice = choose(self.recommender, job.k, job.batch_size)
            self.decoder, self.options = choice.decoder, choice.options

    def __call__(self, shard: int) -> dict[str, Any]:
        rows = self.chunks[shard]
        examples = self.examples.subset(np.arange(rows.start, rows.stop))
        started = time.perf_counter()
        decoded = self.recommender.recommend(examples, self.job.k, self.decoder, self.job.batch_size,
                                             replace(self.options, seed=self.options.seed + shard))
        return {"shard": shard, "text": recs_text(self.recommender, examples, decoded.topk), "users": len(rows),
                "seconds": time.perf_counter() - started,
                "stats": None if decoded.stats is None else decoded.stats.summary()}


@dataclass
class RayReport:
    """What a Ray job did: users decoded now and before (committed shards skipped), decode
    seconds summed over shards, wall seconds of the whole job (Ray start-up and model loading
    included), per-user means of the speculative statistics (None for plain decoders), and per
    worker process the seconds it took to load the models (``auto``'s choice included)."""

    users: int = 0
    skipped: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    stats: dict[str, float] | None = None
    workers: int = 0
    load_s: dict[int, float] = field(default_factory=dict)

    def line(self, out: Path, decoder: str) -> str:
        if not self.users:
            return f"nothing to decode ({self.skipped} users already in {parts_folder(out)}); wrote {out}"
        return (f"{self.users} users in {self.wall_s:.1f} s ({self.users / self.wall_s:.1f} users/s end to end, "
                f"{self.users / self.decode_s * self.workers:.1f} users/s decoding) with {decoder} on "
                f"{self.workers} Ray worker(s); {self.skipped} users were already done; wrote {out}")


def recommend_on_ray(job: RecommendJob, out: Path, workers: Workers, address: str | None = None,
                     overwrite: bool = False, progress: bool = True) -> RayReport:
    """Run ``job`` on Ray workers (module doc) and write ``out``; the report. The job's dtypes are
    resolved here for the workers' device, before Ray starts, and the workers load those."""
    started = time.perf_counter()
    check_address(address)
    folder, info, models, heads = check_folders(job.target, job.draft_dir)
    precisions = folder_precisions(job.dtype, job.draft_dtype, workers.device, folder, models, heads, job.draft_dir)
    job = replace(job, dtype=precisions.target.name, draft_dtype=precisions.draft.name)
    given = load_dataset(job.dataset, job.format) if job.dataset else None
    dataset = users_dataset(info, ItemIndex.load(folder / INDEX_FILE), given)
    chunks = user_chunks(len(trained_examples(dataset, info, job.part, job.users)), job.batch_size)
    shards = ShardFolder(parts_folder(out), job_settings(job, folder, info, [*models, *heads]), len(chunks),
                         overwrite)
    todo = shards.todo()
    report = RayReport(skipped=sum(len(chunks[s]) for s in set(range(len(chunks))) - set(todo)),
                       workers=workers.count)
    if todo:
        from tqdm.auto import tqdm

        connect(address, workers=workers)
        summaries = []
        with ray_errors(), tqdm(total=sum(len(chunks[s]) for s in todo), unit="user", desc=f"{job.decoder} (ray)",
                                disable=not progress, dynamic_ncols=True) as bar:
            for done, pid, load_s in map_on_workers(todo, ShardWorker, workers, job=job, device=workers.device):
                shards.commit(done["shard"], done["text"])
                report.users += done["users"]
                report.decode_s += done["seconds"]
                report.load_s[pid] = load_s
                if done["stats"] is not None:
                    summaries.append((done["users"], done["stats"]))
                bar.update(done["users"])
        if summaries:
            total = sum(users for users, _ in summaries)
            report.stats = {name: sum(users * s[name] for users, s in summaries) / total for name in summaries[0][1]}
    shards.merge(out)
    report.wall_s = time.perf_counter() - started
    return report
