"""Joining or starting a Ray cluster, and the worker pool a job asks of it.

``connect(address)`` joins the cluster at ``address`` (``auto``: the one running on this machine,
``HOST:PORT``: a head node's GCS) or, with no address, starts a local cluster of its own with
this machine's cores (no dashboard; it stops when the process exits). Every failure is one line:
an address that does not answer is refused after a short TCP probe instead of Ray's minute-long
retry loop, and a pool that cannot fit in the cluster (``Workers``) is refused before a job
would wait for it forever.

Ray moves task arguments and results between its own processes with its own serialization; what
recspec reads from disk stays safetensors and JSON.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from recspec.errors import RecspecError

#: How long the TCP probe of a HOST:PORT address waits.
PROBE_S = 5.0


@dataclass(frozen=True)
class Workers:
    """The actors a job runs on: ``count`` of them, each with ``cpus`` CPU cores (its torch
    threads) and ``gpus`` GPUs (a fraction shares one)."""

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
        """The resources of one actor, as Ray's ``num_cpus`` / ``num_gpus``."""
        return {"num_cpus": self.cpus, "num_gpus": self.gpus}


def probe(address: str) -> None:
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
        probe(address)


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
    logging.getLogger("ray.data").setLevel(logging.WARNING)
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
    """Re-raise a :class:`RecspecError` that a worker raised (which Ray wraps in its own task and
    data errors) as itself, so the command line prints its one line."""
    try:
        yield
    except RecspecError:
        raise
    except Exception as err:
        cause: BaseException | None = err
        for _ in range(8):  # Ray nests a few layers: data error, task error, the worker's own
            if cause is None or isinstance(cause, RecspecError):
                break
            cause = getattr(cause, "cause", None) or cause.__cause__
        if isinstance(cause, RecspecError):
            raise RecspecError(str(cause)) from None
        raise


def map_on_actors(rows: list[dict[str, Any]], worker: type, workers: Workers, **constructor_kwargs: Any):
    """``rows`` as a Ray Dataset of one-row blocks mapped through ``worker`` (a Ray Data callable
    class, built once per actor with ``constructor_kwargs``), one row per call, on a pool of
    ``workers`` actors (no more than there are rows); Ray Data's progress bars off, as the caller
    shows its own. The lazy result Dataset; needs a connection (:func:`connect`)."""
    import ray

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        worker, batch_size=1, compute=ray.data.ActorPoolStrategy(size=min(workers.count, len(rows))),
        fn_constructor_kwargs=constructor_kwargs, **workers.remote_args())

