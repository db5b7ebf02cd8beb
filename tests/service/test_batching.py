"""The micro-batcher on its own: batches fill, wait at most max_delay, refuse when full."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from padim.service.batching import MicroBatcher
from padim.service.errors import ApiError


def make(max_batch=4, max_delay=0.05, max_queue=100, score=None, seen=None):
    seen = seen if seen is not None else []

    def score_batch(batch):
        seen.append(batch.shape[0])
        time.sleep(0.01)
        return [float(x.sum()) for x in batch]

    executor = ThreadPoolExecutor(1)
    return MicroBatcher(score or score_batch, executor, max_batch, max_delay, max_queue), seen


@pytest.mark.load_sensitive
def test_concurrent_items_share_batches_and_keep_their_results():
    async def main():
        batcher, seen = make(max_batch=4)
        batcher.start()
        tensors = [torch.full((3, 2, 2), float(i)) for i in range(10)]
        results = await asyncio.gather(*[batcher.submit(t) for t in tensors])
        await batcher.stop()
        return results, seen

    results, seen = asyncio.run(main())
    assert results == [12.0 * i for i in range(10)]
    assert max(seen) == 4 and sum(seen) == 10 and len(seen) <= 4


@pytest.mark.load_sensitive
def test_a_lone_item_waits_at_most_about_max_delay():
    async def main():
        batcher, _ = make(max_batch=32, max_delay=0.05)
        batcher.start()
        start = time.perf_counter()
        await batcher.submit(torch.zeros(3, 2, 2))
        elapsed = time.perf_counter() - start
        await batcher.stop()
        return elapsed

    assert asyncio.run(main()) < 0.5


def test_full_queue_is_refused_with_retry_after():
    async def main():
        batcher, _ = make(max_queue=2)  # not started: nothing drains the queue
        batcher.submit(torch.zeros(3, 1, 1))
        batcher.submit(torch.zeros(3, 1, 1))
        with pytest.raises(ApiError) as info:
            batcher.submit(torch.zeros(3, 1, 1))
        await batcher.stop()
        return info.value

    error = asyncio.run(main())
    assert error.status == 503 and error.headers == {"Retry-After": "1"}


def test_admission_reserves_places_before_decoding_and_gives_back_the_unused():
    async def main():
        batcher, _ = make(max_queue=4)  # not started
        with batcher.admit(3) as admission:
            with pytest.raises(ApiError):
                batcher.admit(2)  # 3 reserved + 2 > 4, though nothing is queued yet
            batcher.submit(torch.zeros(3, 1, 1), admission)
        # the request failed after one image: its two unused places come back, the queued one stays
        assert batcher.admitted == 1
        batcher.admit(3).release()
        batcher.start()
        result = await batcher.submit(torch.ones(3, 1, 1))
        await batcher.stop()
        return result, batcher.admitted

    result, left = asyncio.run(main())
    assert result == 3.0 and left == 0


def test_cancelled_items_are_skipped_and_failures_do_not_stop_the_batcher():
    calls = []

    def flaky(batch):
        calls.append(batch.shape[0])
        if len(calls) == 1:
            raise RuntimeError("device fell over")
        return [0.0] * batch.shape[0]

    async def main():
        batcher, _ = make(score=flaky, max_delay=0.02)
        gone = batcher.submit(torch.zeros(3, 1, 1))
        gone.cancel()
        failing = batcher.submit(torch.zeros(3, 1, 1))
        batcher.start()
        with pytest.raises(ApiError, match="scoring failed"):
            await failing
        assert await batcher.submit(torch.zeros(3, 1, 1)) == 0.0
        await batcher.stop()

    asyncio.run(main())
    assert calls == [1, 1]
