"""DynamicBatcher: merges concurrent calls, keeps each caller's rows, bounds the batch, groups by topk."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from sorl_verl.retrieval.batching import DynamicBatcher


class Recorder:
    """A search function that answers ``[(query, topk)]`` per query and records each call's size."""

    def __init__(self, delay: float = 0.0, fail_on: str | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.delay, self.fail_on = delay, fail_on
        self.lock = threading.Lock()

    def __call__(self, queries: list[str], topk: int) -> list[list[tuple[str, int]]]:
        import time

        with self.lock:
            self.calls.append((len(queries), topk))
        if self.fail_on in queries:
            raise OSError("index gone")
        time.sleep(self.delay)
        return [[(q, topk)] for q in queries]


async def test_concurrent_calls_are_merged_and_rows_go_back_to_their_caller() -> None:
    rec = Recorder(delay=0.01)
    with ThreadPoolExecutor(1) as pool:
        b = DynamicBatcher(rec, pool, max_batch=32, max_wait_s=0.05)
        requests = [[f"q{i}-{j}" for j in range(i % 3 + 1)] for i in range(40)]
        got = await asyncio.gather(*(b.search(qs, 3) for qs in requests))
    assert got == [[[(q, 3)] for q in qs] for qs in requests]
    assert sum(n for n, _ in rec.calls) == sum(map(len, requests))
    assert max(n for n, _ in rec.calls) <= 32 and len(rec.calls) <= 6 and b.batches == len(rec.calls)


async def test_distinct_topk_are_separate_calls_and_errors_reach_every_caller() -> None:
    rec = Recorder(fail_on="bad")
    with ThreadPoolExecutor(1) as pool:
        b = DynamicBatcher(rec, pool, max_batch=64, max_wait_s=0.05)
        r1, r5 = await asyncio.gather(b.search(["a"], 1), b.search(["b", "c"], 5))
        assert r1 == [[("a", 1)]] and r5 == [[("b", 5)], [("c", 5)]]
        assert sorted(rec.calls) == [(1, 1), (2, 5)]
        results = await asyncio.gather(b.search(["x"], 2), b.search(["bad"], 2), return_exceptions=True)
        assert all(isinstance(r, OSError) for r in results)
        assert await b.search(["y"], 2) == [[("y", 2)]]  # the consumer survives a failed batch


async def test_lone_request_waits_at_most_max_wait() -> None:
    rec = Recorder()
    with ThreadPoolExecutor(1) as pool:
        b = DynamicBatcher(rec, pool, max_batch=64, max_wait_s=0.02)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await b.search(["only"], 3) == [[("only", 3)]]
        assert loop.time() - t0 < 1.0
        with pytest.raises(ValueError):
            DynamicBatcher(rec, pool, max_batch=0)
