"""The dynamic batcher's policy (recspec.serve.batcher), on the event loop with a recording
``run`` in place of a model: how long a batch waits for company, and what joins it."""

from __future__ import annotations

import asyncio
import sys

from recspec.serve.batcher import SWITCH_INTERVAL_S, DynamicBatcher

LONG_WAIT_S = 30.0  # far beyond any test's duration: a batch that waited for it would time the test out


def _recording_batcher(max_batch: int = 16, max_wait_s: float = LONG_WAIT_S
                       ) -> tuple[DynamicBatcher, list[list[int]]]:
    batches: list[list[int]] = []

    def run(payloads: list[int]) -> list[int]:
        batches.append(list(payloads))
        return [2 * p for p in payloads]

    return DynamicBatcher(run, max_batch=max_batch, max_wait_s=max_wait_s), batches


def test_a_lone_client_waits_once_then_never() -> None:
    async def main() -> list[list[int]]:
        batcher, batches = _recording_batcher(max_wait_s=0.2)
        batcher.start()
        first = batcher.submit("k", 0)
        await asyncio.sleep(0.05)
        assert batches == []  # a key not batched yet waits for company, up to max_wait_s
        assert await asyncio.wait_for(first.future, 5.0) == 0
        batcher.max_wait_s = LONG_WAIT_S  # from now on, a request that waited would time the test out
        for value in range(1, 4):  # one at a time, each answered before the next is sent
            assert await asyncio.wait_for(batcher.submit("k", value).future, 5.0) == 2 * value
        await batcher.stop()
        return batches

    assert asyncio.run(main()) == [[0], [1], [2], [3]]


def test_under_load_a_batch_waits_to_refill_to_the_last_size() -> None:
    async def main() -> list[list[int]]:
        batcher, batches = _recording_batcher(max_batch=3)
        first = [batcher.submit("k", value) for value in range(3)]  # a full batch: no wait
        batcher.start()
        await asyncio.wait_for(asyncio.gather(*(p.future for p in first)), 5.0)
        late = [batcher.submit("k", 10)]
        await asyncio.sleep(0.05)  # the request waits: the last batch had 3
        assert batches == [[0, 1, 2]]
        late += [batcher.submit("k", 11), batcher.submit("k", 12)]  # the third completes the batch
        assert await asyncio.wait_for(asyncio.gather(*(p.future for p in late)), 5.0) == [20, 22, 24]
        await batcher.stop()
        return batches

    assert asyncio.run(main()) == [[0, 1, 2], [10, 11, 12]]


def test_a_batch_takes_every_queued_request_of_its_key_up_to_max_batch() -> None:
    async def main() -> list[list[int]]:
        batcher, batches = _recording_batcher(max_batch=4, max_wait_s=0.01)
        pending = [batcher.submit("k" if value != 2 else "other", value) for value in range(6)]
        batcher.start()  # the "other" request keeps its place; each batch takes what is queued
        await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 5.0)
        await batcher.stop()
        return batches

    assert asyncio.run(main()) == [[0, 1, 3, 4], [2], [5]]


def test_the_size_to_wait_for_is_kept_per_key() -> None:
    async def main() -> list[list[int]]:
        batcher, batches = _recording_batcher(max_batch=4, max_wait_s=0.01)
        batcher.start()
        assert await asyncio.wait_for(batcher.submit("k", 0).future, 5.0) == 0  # "k": batches of one
        crowd = [batcher.submit("other", value) for value in range(1, 5)]  # "other": a full batch of four
        await asyncio.wait_for(asyncio.gather(*(p.future for p in crowd)), 5.0)
        batcher.max_wait_s = LONG_WAIT_S
        assert await asyncio.wait_for(batcher.submit("k", 5).future, 5.0) == 10  # waits for no one
        await batcher.stop()
        return batches

    assert asyncio.run(main()) == [[0], [1, 2, 3, 4], [5]]


def test_a_running_batcher_shortens_the_switch_interval() -> None:
    async def main() -> float:
        batcher, _ = _recording_batcher()
        batcher.start()
        interval = sys.getswitchinterval()
        await batcher.stop()
        return interval

    default = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert asyncio.run(main()) <= SWITCH_INTERVAL_S < 0.005
    finally:
        sys.setswitchinterval(default)


def test_each_batch_is_reported_when_it_starts_and_when_it_is_done() -> None:
    events: list[tuple[str, float]] = []

    async def main() -> None:
        batcher = DynamicBatcher(lambda payloads: [events.append(("run", len(payloads))) or p for p in payloads],
                                 max_batch=4, max_wait_s=0.01, on_batch=lambda size: events.append(("start", size)),
                                 on_done=lambda seconds: events.append(("done", seconds)))
        pending = [batcher.submit("k", value) for value in range(6)]
        batcher.start()
        await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 5.0)
        await batcher.stop()

    asyncio.run(main())
    assert [(name, value) for name, value in events if name != "done"] == [
        ("start", 4), ("run", 4), ("run", 4), ("run", 4), ("run", 4), ("start", 2), ("run", 2), ("run", 2)]
    assert [name for name, _ in events if name != "run"] == ["start", "done", "start", "done"]
    assert all(seconds >= 0 for name, seconds in events if name == "done")
