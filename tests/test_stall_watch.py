"""aio.StallWatch: the one watcher that ends writes a client's flow control has blocked too long
(the gRPC servicer's, StreamSynthesize's and the HTTP API's writes)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tts_server.aio import StallWatch


async def _idle(watch: StallWatch, within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while watch._watcher is not None:
        assert time.monotonic() < deadline, "the watcher outlived the writes"
        await asyncio.sleep(0.01)


async def test_a_write_that_finishes_returns_its_result_and_the_watcher_ends():
    watch = StallWatch(0.2)

    async def write():
        await asyncio.sleep(0.01)
        return "sent"

    assert await watch.run(write()) == "sent"
    assert watch.in_flight == 0
    await _idle(watch)


async def test_a_blocked_write_times_out_after_the_limit_and_its_task_goes_on():
    watch = StallWatch(0.2)  # checked every 0.05 s
    never = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await watch.run(never)
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 1.0  # the limit, plus at most a period (0.05 s) and a slow CI's delay
    assert never.cancelled()  # the write itself was abandoned
    assert asyncio.current_task().cancelling() == 0  # not left half-cancelled
    await asyncio.sleep(0.01)  # ... so it awaits on as usual
    assert watch.in_flight == 0
    await _idle(watch)


async def test_only_the_stalled_write_among_many_times_out():
    watch = StallWatch(0.2)
    loop = asyncio.get_running_loop()
    blocked = loop.create_future()

    async def quick(i):
        for _ in range(10):
            await watch.run(asyncio.sleep(0.03))
        return i

    async def stuck():
        with pytest.raises(TimeoutError):
            await watch.run(blocked)
        return "timed out"

    results = await asyncio.gather(stuck(), *(quick(i) for i in range(8)))
    assert results == ["timed out", *range(8)]
    await _idle(watch)


async def test_a_cancel_from_elsewhere_stays_a_cancel():
    watch = StallWatch(30.0)
    never = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(watch.run(never))
    await asyncio.sleep(0.01)
    task.cancel()  # the client hung up, the server stops, ...
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watch.in_flight == 0


async def test_a_cancel_that_meets_the_expiry_stays_a_cancel():
    class CancelledTwice(set):  # someone else cancels the write in the watcher's own loop turn
        def add(self, task):
            super().add(task)
            task.cancel()

    watch = StallWatch(0.2)
    watch._expired = CancelledTwice()
    never = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(watch.run(never))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not watch._expired and watch.in_flight == 0
