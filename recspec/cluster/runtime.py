"""Joining or starting a Ray cluster, and the worker pool a job asks of it.

``connect(address)`` joins the cluster at ``address`` (``auto``: the one running on this machine,
``HOST:PORT``: a head node's GCS) or, with no address, starts a local cluster of its own with
this machine's cores (no dashboard; it stops when the process exits). Every failure is one line:
an address that does not answer is refused after a short TCP probe instead of Ray's minute-long
retry loop, and a pool that cannot fit in the cluster (``Workers``) is refused before a job
would wait for it forever.

A job's parts run as Ray tasks (:func:`map_on_workers`) on Ray's pool of worker processes, which
Ray keeps warm between the jobs of one driver process: only the first job of a process pays for
its workers importing torch and transformers (several times what loading a small target
costs). Ray moves task arguments and results between its own processes with its own
serialization; what recspec reads from disk stays safetensors and JSON.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from recspec.errors import RecspecError
from recspec.extras import require_extra

#: How long the TCP probe of a HOST:PORT address waits.
PROBE_S = 5.0
#: How often a part whose worker process died is run again on another before the job fails.
RETRIES = 3


@dataclass(frozen=True)
class Workers:
    """The workers a job runs on: ``count`` of them at a time, each with ``cpus`` CPU cores (its
    torch threads) and ``gpus`` GPUs (a fraction shares one)."""

    count: int = 1
    cpus: int = 1
    gpus: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise RecspecError(f"--workers must be at least 1, got {self.count!r}")
        if isinstance(self.cpus, bool) or not isinstance(self.cpus, int) or self.cpus < 1:
            raise RecspecError(f"--cpus-per-worker must be at least 1, got {self.cpus!r}")
        if not 0 <= self.gpus:
            raise RecspecError(f"--gpus-per-worker must be at least 0, got {self.gpus!r}")

    @property
    def device(self) -> str:
        """The torch device of a worker: CUDA when it holds a GPU (Ray sets which one it sees)."""
        return "cuda" if self.gpus > 0 else "cpu"

    def remote_args(self) -> dict[str, float]:
        """The resources of one worker (a task, or a Serve replica's actor), as Ray's ``num_cpus`` /
        ``num_gpus``."""
        return {"num_cpus": self.cpus, "num_gpus": self.gpus}


@dataclass(frozen=True)
class Engine:
    """Where a batch job runs: ``local`` (this process) or ``ray`` (workers of the Ray cluster at
    ``address``, or of a local one started for the job when None; ``workers`` how many)."""

    name: str = "local"
    address: str | None = None
    workers: Workers = Workers(count=2)

    def __post_init__(self) -> None:
        if self.name not in ("local", "ray"):
            raise RecspecError(f"unknown engine {self.name!r}; choose local or ray")
        if self.address is not None and self.name != "ray":
            raise RecspecError("--address names a Ray cluster: use it with --engine ray")
        if self.name == "ray":
            require_extra("ray", "--engine ray")


def probe_address(address: str) -> None:
    """Refuse a ``HOST:PORT`` that does not accept a TCP connection within :data:`PROBE_S`."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RecspecError(f"--address {address!r}: expected auto or HOST:PORT of a Ray head node")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_S):
            pass
    except OSError as err:
        raise RecspecError(f"no Ray cluster answers at {address} ({err.strerror or err}); start one with "
                           f"`ray start --head` there, or leave out --address to start a local one") from None


def check_address(address: str | None) -> None:
    """Refuse at once an ``address`` that is neither ``auto`` nor a ``HOST:PORT`` that answers."""
    if address not in (None, "auto"):
        probe_address(address)


def connect(address: str | None = None, num_cpus: int | None = None, workers: Workers | None = None) -> None:
    """Join the Ray cluster at ``address`` (None: the one ``RAY_ADDRESS`` names, if set) or start
    a local one (``num_cpus``: its cores, default all of this machine's); a second call in the
    same process keeps the first connection. Workers' logs stay in Ray's session folder. With
    ``workers``, refuse a pool the cluster cannot hold (:func:`check_fits`), and one that a local
    cluster could not hold before starting it."""
    import ray

    if workers is not None and not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS")):
        _refuse_unfit(workers, float(num_cpus or os.cpu_count() or 1), float(_local_gpus()))
    _join(address, num_cpus)
    if workers is not None:
        check_fits(workers)


def _local_gpus() -> int:
    """The GPUs a local Ray cluster would have: those CUDA sees here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _join(address: str | None, num_cpus: int | None) -> None:
    import ray

    if ray.is_initialized():
        return
    options = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        ray.init(num_cpus=num_cpus or os.cpu_count(), **options)
        return
    check_address(address)
    try:
        ray.init(address=address, **options)
    except ConnectionError as err:
        raise RecspecError(f"could not join the Ray cluster at {address}: {str(err).splitlines()[0]}") from None


def check_fits(workers: Workers) -> None:
    """Refuse a pool that the cluster's resources cannot hold all at once (Ray would wait for it)."""
    import ray

    resources = ray.cluster_resources()
    _refuse_unfit(workers, resources.get("CPU", 0.0), resources.get("GPU", 0.0))


def _refuse_unfit(workers: Workers, cpus: float, gpus: float) -> None:
    if workers.count * workers.cpus > cpus or workers.count * workers.gpus > gpus:
        raise RecspecError(f"{workers.count} workers of {workers.cpus} CPU(s) and {workers.gpus} GPU(s) need "
                           f"{workers.count * workers.cpus} CPUs and {workers.count * workers.gpus:g} GPUs; the "
                           f"cluster has {cpus:g} CPUs and {gpus:g} GPUs")


@contextlib.contextmanager
def ray_errors() -> Iterator[None]:
    """Re-raise a :class:`RecspecError` that a worker raised (which Ray wraps in its task errors,
    themselves subclasses of the error they wrap) as a plain one, so the command line prints its
    one line."""
    import ray.exceptions

    try:
        yield
    except Exception as err:
        cause: BaseException | None = err
        for _ in range(8):  # Ray may nest a few layers: task error, the worker's own
            if cause is None or (isinstance(cause, RecspecError) and not isinstance(cause, ray.exceptions.RayError)):
                break
            cause = getattr(cause, "cause", None) or cause.__cause__
        if cause is err or not isinstance(cause, RecspecError):
            raise
        raise RecspecError(str(cause)) from None


#: In a Ray worker process: the job it last set up (its key), the callable ``setup`` built for it
#: and the seconds that took. One job at a time, so a warm worker holds one job's models.
_SET_UP: dict[str, tuple[Callable[[Any], Any], float]] = {}


def run_part(key: str, setup: Callable[..., Callable[[Any], Any]], kwargs: dict[str, Any], threads: int,
             part: Any) -> tuple[Any, int, float]:
    """The Ray task of :func:`map_on_workers`, in a worker process: build ``setup(**kwargs)`` once
    per job ``key`` (dropping the previous job's), with ``threads`` torch threads, and call it on
    ``part``. Its result, this process's id and the seconds the set-up took."""
    import torch

    torch.set_num_threads(threads)
    if key not in _SET_UP:
        _SET_UP.clear()
        started = time.perf_counter()
        worker = setup(**kwargs)
        _SET_UP[key] = (worker, time.perf_counter() - started)
    worker, setup_s = _SET_UP[key]
    return worker(part), os.getpid(), setup_s


@functools.cache
def _remote_run_part() -> Any:
    """:func:`run_part` as a Ray remote function (made once per process: it needs Ray imported).
    ``max_calls=0`` keeps worker processes for more calls (Ray's default for GPU tasks is one)."""
    import ray

    return ray.remote(max_calls=0, max_retries=RETRIES)(run_part)


def map_on_workers(parts: list[Any], setup: Callable[..., Callable[[Any], Any]], workers: Workers,
                   **kwargs: Any) -> Iterator[tuple[Any, int, float]]:
    """Every one of ``parts`` through the callable that ``setup(**kwargs)`` returns (built once per
    worker process and job, e.g. the models loaded), as Ray tasks, at most ``workers.count`` at a
    time, each with ``workers``' cores and GPUs. Yields ``(result, worker pid, set-up seconds)`` as
    the parts finish, in no fixed order. A part whose worker process dies runs again on another (up
    to :data:`RETRIES` times); when the caller stops early or a part fails, the parts still running
    are cancelled. Needs a connection (:func:`connect`)."""
    import ray

    remote = _remote_run_part().options(**workers.remote_args())
    key, todo, running = uuid.uuid4().hex, list(reversed(parts)), []
    try:
        while todo or running:
            while todo and len(running) < workers.count:
                running.append(remote.remote(key, setup, kwargs, workers.cpus, todo.pop()))
            done, running = ray.wait(running, num_returns=1)
            yield ray.get(done[0])
    finally:
        for ref in running:
            ray.cancel(ref)
