"""Server-side dynamic batching: concurrent requests share one search call.

:class:`DynamicBatcher` queues ``(queries, topk)`` requests from the event loop; one consumer
takes the first waiting request, waits at most ``max_wait_s`` for more (or until
``max_batch`` queries are queued), then runs ``search(all queries, topk)`` once per distinct
``topk`` in a worker thread and hands each request its own rows. While a batch is being
searched new requests queue up, so under load the next batch forms without waiting: the
batch size adapts to the arrival rate. A dense searcher then runs one encoder forward and one
index search per batch instead of one per request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

SearchFn = Callable[[list[str], int], list[Any]]
Request = tuple[list[str], int, "asyncio.Future[list[Any]]"]


class DynamicBatcher:
    """Batches concurrent ``search(queries, topk)`` calls (one consumer, bounded wait)."""

    def __init__(self, search: SearchFn, executor: Executor, max_batch: int = 256, max_wait_s: float = 0.002) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"need max_batch >= 1 and max_wait_s >= 0, got {max_batch}, {max_wait_s}")
        self.search_fn = search
        self.executor = executor
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._pending: deque[Request] = deque()
        self._queued = 0  # queries waiting in _pending
        self._wakeup: asyncio.Event | None = None
        self._consumer: asyncio.Task[None] | None = None
        self.batches = 0  # search calls made (for tests and metrics)
        self.batched_queries = 0  # queries in those calls
        self.largest_batch = 0

    def stats(self) -> dict[str, int]:
        """Search calls made, queries in them and the largest one (mean batch = queries / batches)."""
        return {"batches": self.batches, "batched_queries": self.batched_queries, "largest_batch": self.largest_batch}

    async def search(self, queries: list[str], topk: int) -> list[Any]:
        """Rows for ``queries`` exactly as ``search(queries, topk)`` would return them."""
        loop = asyncio.get_running_loop()
        if self._consumer is None or self._consumer.done() or self._consumer.get_loop() is not loop:
            self._pending.clear()
            self._wakeup = asyncio.Event()
            self._consumer = loop.create_task(self._consume())
        fut: asyncio.Future[list[Any]] = loop.create_future()
        self._pending.append((queries, topk, fut))
        self._queued += len(queries)
        assert self._wakeup is not None
        self._wakeup.set()
        return await fut

    async def _collect(self) -> list[Request]:
        """The next batch: the first waiting request plus those that arrive within ``max_wait_s``."""
        assert self._wakeup is not None
        while not self._pending:
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while self._queued < self.max_batch:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except asyncio.TimeoutError:
                break
        batch = [self._pending.popleft()]
        size = len(batch[0][0])
        while self._pending and size + len(self._pending[0][0]) <= self.max_batch:
            batch.append(self._pending.popleft())
            size += len(batch[-1][0])
        self._queued -= size
        return batch

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            for topk in sorted({k for _, k, _ in batch}):
                group = [(q, f) for q, k, f in batch if k == topk and not f.done()]
                flat = [q for qs, _ in group for q in qs]
                if not flat:
                    for _, f in group:
                        f.set_result([])
                    continue
                self.batches += 1
                self.batched_queries += len(flat)
                self.largest_batch = max(self.largest_batch, len(flat))
                try:
                    rows = await loop.run_in_executor(self.executor, self.search_fn, flat, topk)
                except Exception as e:  # noqa: BLE001 - every waiting request gets the error
                    for _, f in group:
                        if not f.done():
                            f.set_exception(e)
                    continue
                start = 0
                for qs, f in group:
                    if not f.done():  # a request whose client went away is simply skipped
                        f.set_result(rows[start : start + len(qs)])
                    start += len(qs)
