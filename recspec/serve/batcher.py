"""Dynamic batching on the event loop, decoding off it.

Requests wait in one bounded FIFO queue. A batch forms around the oldest request: the requests
queued with the same key (``k``, decoder, exclusions) join it, up to ``max_batch``; others keep
their place for the next batch. It waits for more to come only while it is smaller than the last
batch of its key (the clients just answered are the ones likely to send again; ``max_batch`` for a
key not batched yet), and at most ``max_wait_s`` after the oldest arrived. So a lone client waits
once, for its first request, and never again, while under load batches refill to the size the
load sustains; every batch takes all the queued requests of its key, so the size grows as soon as
the load does. The batch decodes in one dedicated thread (``run`` is synchronous; torch releases
the GIL in its kernels), so the event loop keeps accepting requests and answering ``/health``
and ``/metrics`` meanwhile, and batches never overlap on the cores. The two threads share the
GIL (unless ``run`` only waits on a decode worker process, ``recspec serve --decode-process``:
:mod:`recspec.serve.worker`): a decode bound by Python work (on a GPU, whose kernels run
asynchronously, the decode thread is busy launching them) would keep the event loop waiting up
to the interpreter's switch interval (5 ms by default) each time it wants to run, which on a GPU
cost more per request than the decode itself; :meth:`DynamicBatcher.start` lowers the interval to
:data:`SWITCH_INTERVAL_S`.

Backpressure: :meth:`DynamicBatcher.submit` refuses a request when ``max_queue`` wait already
(:class:`Overloaded`, a 503). A request leaves the queue when its client goes away or its
deadline passes (:meth:`DynamicBatcher.cancel`): it keeps no slot and is never decoded; one
cancelled while its batch decodes has its answer dropped.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

#: The interpreter's thread switch interval while a batcher runs (seconds; the default is 0.005).
SWITCH_INTERVAL_S = 0.0005

Payload = TypeVar("Payload")
Result = TypeVar("Result")


class Overloaded(Exception):
    """The queue is full; ``retry_after`` seconds is a fair wait before trying again."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is at capacity; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass(eq=False)
class Pending(Generic[Payload]):
    """A queued request: its batching ``key``, ``payload``, arrival time and future answer."""

    key: Hashable
    payload: Payload
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when its batch began decoding


class DynamicBatcher(Generic[Payload, Result]):
    """``run(payloads) -> results`` (one result per payload, same order) over batches of one key;
    ``on_queue(depth)`` when the queue changes, ``on_batch(size)`` when a batch starts decoding,
    ``on_done(seconds)`` when it is decoded or failed."""

    def __init__(self, run: Callable[[list[Payload]], Sequence[Result]], max_batch: int = 16,
                 max_wait_s: float = 0.005, max_queue: int = 256,
                 on_queue: Callable[[int], None] = lambda depth: None,
                 on_batch: Callable[[int], None] = lambda size: None,
                 on_done: Callable[[float], None] = lambda seconds: None) -> None:
        if max_batch < 1 or max_queue < 1 or max_wait_s < 0:
            raise ValueError("max_batch and max_queue must be at least 1, max_wait_s at least 0")
        self.run, self.max_batch, self.max_wait_s, self.max_queue = run, max_batch, max_wait_s, max_queue
        self.on_queue, self.on_batch, self.on_done = on_queue, on_batch, on_done
        self.queue: deque[Pending[Payload]] = deque()
        self.seconds_per_batch = 0.1  # running estimate, for Retry-After
        self.last_size: dict[Hashable, int] = {}  # per key, the size of its last batch: how many to wait for
        self._arrival = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recspec-decode")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start batching on the running event loop (and shorten the process's switch interval, module doc)."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="recspec-batcher")

    async def stop(self) -> None:
        """Stop after the batch in flight (queued requests, if any, are failed as cancelled)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for pending in self.queue:
            if not pending.future.done():
                pending.future.cancel()
        self.queue.clear()
        self._executor.shutdown(wait=True)

    def submit(self, key: Hashable, payload: Payload) -> Pending[Payload]:
        """Queue ``payload``; its answer is ``pending.future``. Raises :class:`Overloaded` when full."""
        if len(self.queue) >= self.max_queue:
            batches = len(self.queue) / self.max_batch + 1
            raise Overloaded(max(1, round(batches * self.seconds_per_batch + 0.5)))
        pending = Pending(key, payload, asyncio.get_running_loop().create_future())
        self.queue.append(pending)
        self.on_queue(len(self.queue))
        self._arrival.set()
        return pending

    def cancel(self, pending: Pending[Payload]) -> None:
        """Withdraw ``pending``: out of the queue if it is still there, its answer dropped if not."""
        if pending.started is None:
            try:
                self.queue.remove(pending)
            except ValueError:
                pass
            self.on_queue(len(self.queue))
        if not pending.future.done():
            pending.future.cancel()

    def _remember(self, key: Hashable, size: int) -> None:
        """Keep ``size`` as ``key``'s last batch size; only the ``max_queue`` keys batched last are kept."""
        self.last_size.pop(key, None)
        self.last_size[key] = size
        if len(self.last_size) > self.max_queue:
            del self.last_size[next(iter(self.last_size))]

    def _same_key(self, key: Hashable) -> int:
        return sum(1 for pending in self.queue if pending.key == key)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self._arrival.clear()
                await self._arrival.wait()
            head = self.queue[0]
            fill_by = head.arrived + self.max_wait_s
            expected = self.last_size.get(head.key, self.max_batch)
            while self._same_key(head.key) < expected and head in self.queue:
                left = fill_by - time.perf_counter()
                if left <= 0:
                    break
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), left)
                except TimeoutError:
                    break
            if not self.queue or self.queue[0] is not head:  # the head was withdrawn meanwhile
                continue
            batch = [pending for pending in self.queue if pending.key == head.key][:self.max_batch]
            for pending in batch:
                self.queue.remove(pending)
                pending.started = time.perf_counter()
            self.on_queue(len(self.queue))
            self.on_batch(len(batch))
            self._remember(head.key, len(batch))
            started = time.perf_counter()
            try:
                results: Any = await loop.run_in_executor(self._executor, self.run, [p.payload for p in batch])
            except Exception as err:  # one failed batch fails its requests, not the service
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(err)
                continue
            finally:
                seconds = time.perf_counter() - started
                self.seconds_per_batch = 0.8 * self.seconds_per_batch + 0.2 * seconds
                self.on_done(seconds)
            for pending, result in zip(batch, results):
                if not pending.future.done():
                    pending.future.set_result(result)
