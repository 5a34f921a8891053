"""Search-R1 compatible retrieval server (FastAPI + uvicorn).

API
- ``POST /retrieve`` with ``{"queries": [...], "topk": 3, "return_scores": true}`` or a single
  ``{"query": "..."}``. Response ``{"result": [[hit, ...], ...]}`` with one list per query, best
  first; a hit is ``{"document": {"id", "contents"}, "score": s}`` when ``return_scores`` is true
  and the bare ``{"id", "contents"}`` document when it is false (Search-R1's default).
- ``GET /health`` -> ``{"status": "ok", "method", "num_docs", "limits", "serving", "stats"}``; ``stats``:
  merged search calls (with batching) and, for dense, encoder and index CPU seconds.

Every bad request gets a JSON ``{"error": message}`` with a 4xx status (limits configurable):
body over ``max_body_bytes`` -> 413; anything that is not a JSON object of the right types
(malformed, nested too deep, an integer too long to convert, a lone surrogate in a query) ->
400; more than ``max_queries`` queries, ``topk`` outside 1..``max_topk``, a query longer than
``max_query_chars`` -> 422; request headers not complete ``header_timeout`` seconds after the
connection opened (or its first byte, on a kept-alive connection) or a body not received
within ``body_timeout`` -> 408 and the connection is closed; more than ``max_connections``
open connections -> 503 at once; malformed HTTP -> 400.

The parts: :mod:`.server_requests` (limits and request validation), :mod:`.server_app` (the
FastAPI app, search pool and batching), :mod:`.server_http` (uvicorn protocols with the
connection guards), :mod:`.server_launch` (:func:`serve_in_background`); this module is the CLI.

CLI: ``python -m sorl_verl.retrieval.server --index DIR [--host 127.0.0.1] [--port 8000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import uvicorn

from .index import default_workers, load_searcher
from .server_app import create_app
from .server_http import guarded_protocol, resolve_http, uvicorn_config
from .server_launch import BackgroundServer, serve_in_background
from .server_requests import Limits, parse_request

__all__ = [
    "BackgroundServer",
    "Limits",
    "create_app",
    "guarded_protocol",
    "main",
    "parse_request",
    "resolve_http",
    "serve_in_background",
    "uvicorn_config",
]


def main(argv: list[str] | None = None) -> None:
    d = Limits()
    p = argparse.ArgumentParser(prog="python -m sorl_verl.retrieval.server", description=__doc__.split("\n")[0])
    p.add_argument("--index", required=True, help="index directory made by sorl_verl.retrieval.build")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--port-file", help="write the bound port to this file once listening")
    p.add_argument("--workers", type=int, help="threads running searches at a time (default: one per core)")
    p.add_argument("--threads", type=int, default=1, help="BM25 scoring threads per batch")
    p.add_argument("--batch-wait-ms", type=float, help="merge concurrent requests for up to this long (default: "
                   "2 for dense, 0 = off for BM25)")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=256, help="queries per merged search call")
    p.add_argument("--mmap", action="store_true", help="memory-map BM25 postings instead of loading them")
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                   help="HTTP parser: httptools (C, the default when installed) or h11 (pure Python)")  # fmt: skip
    g = p.add_argument_group("dense")
    g.add_argument("--device", help="query encoder device (cpu, cuda, ...)")
    g.add_argument("--model", help="encoder directory, if it moved since the build")
    g.add_argument("--faiss-gpu", action="store_true", help="search the faiss index on the GPU(s) (needs GPU faiss)")
    g.add_argument("--nprobe", type=int, help="ivfpq index: inverted lists scanned per query")
    g.add_argument("--ef-search", type=int, help="hnsw index: search breadth")
    g.add_argument("--dense-threads", "--intra-op-threads", dest="intra_op_threads", type=int,
                   help="torch and faiss threads per search (default: theirs; 1 on a shared or busy CPU)")  # fmt: skip
    g = p.add_argument_group("limits")
    g.add_argument("--topk", dest="default_topk", type=int, default=d.default_topk, help="topk when a request has none")
    g.add_argument("--max-topk", type=int, default=d.max_topk)
    g.add_argument("--max-queries", type=int, default=d.max_queries)
    g.add_argument("--max-query-chars", type=int, default=d.max_query_chars)
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--header-timeout", type=float, default=d.header_timeout, help="seconds for request headers")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout, help="seconds for a request body")
    g.add_argument("--max-connections", type=int, default=d.max_connections, help="open connections; more get 503")
    g.add_argument("--default-topk", dest="default_topk", type=int, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper())
    try:
        limits = Limits(
            a.default_topk, a.max_topk, a.max_queries, a.max_query_chars, a.max_body_bytes,
            a.header_timeout, a.body_timeout, a.max_connections,
        )  # fmt: skip
        workers = default_workers() if a.workers is None else a.workers
        if workers < 1 or a.threads < 1:
            raise ValueError(f"--workers and --threads must be >= 1, got {workers} and {a.threads}")
    except ValueError as e:
        p.error(str(e))
    names = ("device", "model", "nprobe", "ef_search", "intra_op_threads")
    dense = {k: getattr(a, k) for k in names if getattr(a, k) is not None}
    if a.faiss_gpu:
        dense["faiss_gpu"] = True
    searcher = load_searcher(
        a.index, n_threads=a.threads, mmap=a.mmap, scratch_buffers=max(workers, a.threads), **dense
    )
    app = create_app(searcher, limits, workers=workers, batch_wait_ms=a.batch_wait_ms, max_batch=a.max_batch)
    try:
        config = uvicorn_config(app, a.host, a.port, a.log_level, http=a.http)
    except ValueError as e:
        p.error(str(e))
    server = uvicorn.Server(config)
    if a.port_file:
        port_file = Path(a.port_file)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.01)
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(str(server.servers[0].sockets[0].getsockname()[1]))
            tmp.replace(port_file)

        async def run() -> None:
            task = asyncio.create_task(announce())
            await server.serve()
            task.cancel()

        asyncio.run(run())
    else:
        server.run()


if __name__ == "__main__":
    main()
