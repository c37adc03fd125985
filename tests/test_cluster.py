"""Batch recommendation and knowledge generation on a real local Ray cluster (``num_cpus=2``, started
by the code under test): outputs equal the single-process paths byte for byte (a recommend
decoder of each kind; LASER knowledge generation), worker processes killed mid-job, resumed jobs, bad input."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from recspec.cluster.knowledge import check_shared_pools, ray_runner
from recspec.cluster.recommend import parts_folder, recommend_on_ray
from recspec.cluster.runtime import Workers, check_fits, connect
from recspec.errors import RecspecError
from recspec.knowledge.job import KnowledgeConfig, run_job
from recspec.knowledge.store import read_rows
from recspec.recommend import DecodeOptions, RecommendJob, write_recs
from recspec.serve.on_ray import free_port
from tests.test_cli import recspec_process as recspec
from tests.test_knowledge_job import GREEDY, old_store, task  # noqa: F401  (fixtures)
from tests.test_serve import models  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
USERS = 300  # two shards of the single-process chunks (256 + 44 users)
TWO = Workers(2, 1)


@pytest.fixture(scope="module")
def cluster():
    import ray

    connect(None, num_cpus=2)
    yield
    ray.shutdown()


def local_recs(job: RecommendJob, out: Path) -> bytes:
    """What `recspec recommend` (one process) writes for ``job``."""
    recommender = job.load()
    examples, decoded = job.decode(recommender, progress=True)
    write_recs(out, recommender, examples, decoded.topk)
    return out.read_bytes()


def test_every_kind_of_decoder_writes_the_single_process_file(cluster, models, tmp_path: Path) -> None:
    """One decoder of each kind the shards treat differently: exact without statistics (tree-beam;
    beam and hf are exact the same way, tests/test_exactness_*), sampled (seeded per chunk) and
    drafted with statistics (dsbd is both; beam-sample and spec-relaxed are one of them each), and
    auto; the other four cover no other path."""
    target, draft = models
    options = DecodeOptions(draft_beams=20, temperature=0.8, seed=3)
    for decoder in ("tree-beam", "dsbd", "auto"):
        job = RecommendJob(target, decoder, 10, str(draft), options, users=USERS)
        expected = local_recs(job, tmp_path / f"{decoder}-local.jsonl")
        out = tmp_path / f"{decoder}-ray.jsonl"
        report = recommend_on_ray(job, out, TWO, progress=False)
        assert out.read_bytes() == expected, decoder
        assert (report.users, report.skipped) == (USERS, 0)
        if decoder != "auto":  # auto: whichever it chose
            assert (report.stats is None) == (decoder == "tree-beam"), decoder
        assert sorted(p.name for p in parts_folder(out).iterdir()) == [
            "manifest.json", "shard-00000.json", "shard-00000.jsonl", "shard-00001.json", "shard-00001.jsonl"]


def _decoding_worker() -> int | None:
    """PID of a Ray worker process decoding a shard: Ray titles it ``ray::<task function>`` while
    it runs a task (``ray::IDLE`` while idle)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"ray::run_part" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


def test_a_worker_killed_mid_shard_is_replaced_and_nothing_is_lost(cluster, models, tmp_path: Path) -> None:
    target, _ = models
    job = RecommendJob(target, "beam", 10, users=600, batch_size=1)  # three shards of a few seconds each
    expected = local_recs(job, tmp_path / "local.jsonl")
    out = tmp_path / "ray.jsonl"
    failure: list[BaseException] = []

    def run() -> None:
        try:
            recommend_on_ray(job, out, TWO, progress=False)
        except BaseException as err:  # noqa: BLE001  (reported by the test)
            failure.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 300
    while (victim := _decoding_worker()) is None:
        assert time.monotonic() < deadline and thread.is_alive(), failure or "no worker ever decoded"
        time.sleep(0.02)
    done_before = len(list(parts_folder(out).glob("shard-*.json")))
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=600)
    assert not failure, failure
    assert done_before < 3  # the killed worker was decoding a shard that was not committed
    assert out.read_bytes() == expected
    assert len(list(parts_folder(out).glob("shard-*.json"))) == 3


def test_a_resumed_job_redoes_only_missing_or_damaged_shards(cluster, models, tmp_path: Path) -> None:
    target, _ = models
    job = RecommendJob(target, "tree-beam", 10, users=600)
    out = tmp_path / "recs.jsonl"
    recommend_on_ray(job, out, TWO, progress=False)
    expected = out.read_bytes()
    out.unlink()
    folder = parts_folder(out)
    (folder / "shard-00001.json").unlink()  # killed between writing the shard and its record
    with open(folder / "shard-00002.jsonl", "a", encoding="utf-8") as handle:
        handle.write("{}\n")  # damaged since
    report = recommend_on_ray(job, out, TWO, progress=False)
    assert (report.skipped, report.users) == (256, 600 - 256)
    assert out.read_bytes() == expected
    again = recommend_on_ray(job, out, TWO, progress=False)
    assert (again.users, again.skipped) == (0, 600) and "nothing to decode" in again.line(out, "tree-beam")
    with pytest.raises(RecspecError, match="other settings"):
        recommend_on_ray(replace(job, k=5), out, TWO, progress=False)
    recommend_on_ray(replace(job, k=5, users=40), out, TWO, overwrite=True, progress=False)
    assert len(out.read_text().splitlines()) == 40


def test_bad_input_is_one_line(cluster, models, tmp_path: Path) -> None:
    target, _ = models
    with pytest.raises(RecspecError, match="need 3 CPUs"):
        check_fits(Workers(3, 1))
    with pytest.raises(RecspecError, match="--workers must be at least 1"):
        Workers(0, 1)
    closed = free_port("127.0.0.1")
    run = recspec("recommend", "--target", str(target), "--out", str(tmp_path / "r.jsonl"), "--engine", "ray",
                  "--address", f"127.0.0.1:{closed}")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: no Ray cluster answers at 127.0.0.1:{closed} (Connection refused); start one with `ray start "
        f"--head` there, or leave out --address to start a local one"]
    assert not parts_folder(tmp_path / "r.jsonl").exists()
    for args, message in ((("--workers", "0"), "--workers must be at least 1"),
                          (("--engine", "spark"), "unknown engine 'spark'")):
        run = recspec("recommend", "--target", str(target), "--out", str(tmp_path / "r.jsonl"), "--engine", "ray",
                      *args)
        assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_knowledge_on_ray_equals_one_process_and_resumes(cluster, task, old_store, smollm2_dir,  # noqa: F811
                                                          tmp_path: Path) -> None:
    """LASER, whose workers also read the retrieval pool (plain greedy generation is the same job
    without it: each Ray job starts workers that load SmolLM2, about 40 s of a 2-core machine), on
    a store that one process began: the Ray job does only what is missing, and the whole equals
    the one-process store."""
    runner = ray_runner({"model": str(smollm2_dir), "dataset": "ml-100k"}, TWO)
    config = KnowledgeConfig(side="item", method="laser", verification=GREEDY, max_new_tokens=8)
    local, ray_store = tmp_path / "laser-local.db", tmp_path / "laser-ray.db"
    run_job(task, config, local, old_store, limit=4, progress=False)
    first = run_job(task, config, ray_store, old_store, limit=2, progress=False)
    rest = run_job(task, config, ray_store, old_store, limit=4, progress=False, runner=runner)
    assert (first.requests, rest.skipped, rest.requests) == (2, 2, 2)
    rows = {row.entity: (row.text, row.tokens) for row in read_rows(ray_store)}
    assert len(rows) == len(list(read_rows(ray_store))) == 4
    assert rows == {row.entity: (row.text, row.tokens) for row in read_rows(local)}
    with pytest.raises(RecspecError, match="drafts from the job's own texts"):
        check_shared_pools(KnowledgeConfig(side="item", part="old", method="resd", verification=GREEDY), None)
