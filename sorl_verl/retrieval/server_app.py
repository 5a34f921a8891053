"""The retrieval server's FastAPI app: ``POST /retrieve`` and ``GET /health`` over a loaded index.

Searches run on a pool of ``workers`` threads (default: one per core), so the event loop keeps
serving while a batch is scored and at most ``workers`` searches (and their scratch memory) are
live at a time. With ``batch_wait_ms > 0`` concurrent requests are merged into one search call
(:mod:`.batching`); ``batch_wait_ms=None`` picks 2 ms for dense indexes and off for BM25. The API
is described in :mod:`sorl_verl.retrieval.server`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .batching import DynamicBatcher
from .index import Searcher, default_workers, load_searcher
from .server_requests import BadRequest, Limits, parse_request, read_body

logger = logging.getLogger(__name__)

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is optional

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(
    index: str | Path | Searcher,
    limits: Limits | None = None,
    *,
    workers: int | None = None,
    batch_wait_ms: float | None = None,
    max_batch: int = 256,
    **limit_overrides: Any,
) -> FastAPI:
    """FastAPI app serving ``index`` (an index directory or a loaded searcher).

    ``workers``: threads that run searches (default: one per core). ``batch_wait_ms``: how long
    a request may wait for others to share its search call (``None``: 2 for dense, 0 = off for
    BM25); ``max_batch``: queries per merged call.
    """
    limits = Limits(**{**asdict(limits or Limits()), **limit_overrides})
    workers = default_workers() if workers is None else int(workers)
    if workers < 1 or max_batch < 1:
        raise ValueError(f"need workers >= 1 and max_batch >= 1, got {workers}, {max_batch}")
    searcher: Searcher = load_searcher(index, scratch_buffers=workers) if isinstance(index, str | Path) else index
    method = searcher.manifest.get("method")
    if batch_wait_ms is None:
        batch_wait_ms = 2.0 if method == "dense" else 0.0
    pool = ThreadPoolExecutor(workers, thread_name_prefix="sorl-retrieval-search")
    batcher = DynamicBatcher(searcher.search, pool, max_batch, batch_wait_ms / 1000) if batch_wait_ms > 0 else None
    app = FastAPI(title="sorl-verl retrieval", version="1")
    app.state.searcher = searcher
    app.state.limits = limits
    app.state.pool = pool
    app.state.batcher = batcher
    serving: dict[str, Any] = {"workers": workers, "batch_wait_ms": batch_wait_ms, "max_batch": max_batch}
    app.state.serving = serving

    async def run_search(queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        if batcher is not None:
            return await batcher.search(queries, topk)
        return await asyncio.get_running_loop().run_in_executor(pool, searcher.search, queries, topk)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        stats: dict[str, Any] = batcher.stats() if batcher is not None else {}
        scorer_stats = getattr(getattr(searcher, "scorer", None), "stats", None)
        if scorer_stats is not None:
            stats.update(scorer_stats())
        return {
            "status": "ok", "method": method, "num_docs": searcher.num_docs, "limits": asdict(limits),
            "serving": serving, "stats": stats,
        }  # fmt: skip

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        try:
            body = await read_body(request, limits.max_body_bytes, limits.body_timeout)
            queries, topk, return_scores = parse_request(body, limits)
        except BadRequest as e:
            headers = {"connection": "close"} if e.status in (408, 413) else None  # the body may still be coming
            return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)
        try:
            hits = await run_search(queries, topk) if queries else []
        except Exception as e:  # noqa: BLE001 - answer JSON 500 (clients retry) instead of a bare crash page
            logger.exception("retrieval of %d queries failed", len(queries))
            return _error(500, f"search failed: {type(e).__name__}: {e}")
        if return_scores:
            result = [
                [{"document": {"id": h["id"], "contents": h["contents"]}, "score": h["score"]} for h in row]
                for row in hits
            ]
        else:
            result = [[{"id": h["id"], "contents": h["contents"]} for h in row] for row in hits]
        return Response(_dumps({"result": result}), media_type="application/json")

    return app
