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

Searches run on a pool of ``workers`` threads (default: one per core), so the event loop keeps
serving while a batch is scored and at most ``workers`` searches (and their scratch memory) are
live at a time. With ``batch_wait_ms > 0`` concurrent requests are merged into one search call
(:mod:`.batching`); ``batch_wait_ms=None`` picks 2 ms for dense indexes and off for BM25.

HTTP is parsed by uvicorn's ``httptools`` protocol (C) when installed, else by pure-Python
``h11`` (``--http`` picks one); both carry the same guards (:class:`_ConnectionGuard`).

CLI: ``python -m sorl_verl.retrieval.server --index DIR [--host 127.0.0.1] [--port 8000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is a dependency; h11 remains the fallback
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from .batching import DynamicBatcher
from .index import Searcher, default_workers, load_searcher

logger = logging.getLogger(__name__)

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is optional

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class Limits:
    """Request limits of the server (defaults suit RL rollouts: many small batched queries)."""

    default_topk: int = 3
    max_topk: int = 100
    max_queries: int = 1024
    max_query_chars: int = 4096
    max_body_bytes: int = 4 * 1024 * 1024
    header_timeout: float = 10.0  # seconds for a request's headers to arrive
    body_timeout: float = 30.0  # seconds for a request's body to arrive
    max_connections: int = 1024  # open connections; more are answered 503 and closed

    def __post_init__(self) -> None:
        ints = ("default_topk", "max_topk", "max_queries", "max_query_chars", "max_body_bytes", "max_connections")
        bad = [n for n in ints if int(getattr(self, n)) < 1]
        bad += [n for n in ("header_timeout", "body_timeout") if not float(getattr(self, n)) > 0]
        if bad:
            raise ValueError(f"server limits must be positive: {', '.join(f'{n}={getattr(self, n)}' for n in bad)}")


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _BadRequest(413, f"request body of {declared:.30} bytes exceeds the limit of {limit} bytes")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _BadRequest(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError as e:
        raise _BadRequest(408, f"request body not received within {timeout:g} s") from e


def parse_request(body: bytes, limits: Limits) -> tuple[list[str], int, bool]:
    """``(queries, topk, return_scores)`` from a /retrieve body; raises ``_BadRequest``."""
    try:
        payload = json.loads(body)
    except RecursionError as e:
        raise _BadRequest(400, "body is not valid JSON: nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise _BadRequest(400, f"body is not valid JSON: {str(e):.200}") from e
    if not isinstance(payload, dict):
        raise _BadRequest(400, 'body must be a JSON object like {"queries": [...], "topk": 3}')
    if ("queries" in payload) == ("query" in payload):
        raise _BadRequest(400, 'give exactly one of "queries" (list of strings) or "query" (string)')
    queries = payload["queries"] if "queries" in payload else [payload["query"]]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise _BadRequest(400, '"queries" must be a list of strings and "query" a string')
    if len(queries) > limits.max_queries:
        raise _BadRequest(422, f"{len(queries)} queries in one request; the limit is {limits.max_queries}")
    for i, q in enumerate(queries):
        try:
            q.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _BadRequest(400, f"query {i} is not valid Unicode: lone surrogate at character {e.start}") from e
    too_long = [i for i, q in enumerate(queries) if len(q) > limits.max_query_chars]
    if too_long:
        raise _BadRequest(
            422,
            f"query {too_long[0]} has {len(queries[too_long[0]])} characters; the limit is {limits.max_query_chars}",
        )
    topk = payload.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise _BadRequest(400, f'"topk" must be an integer, got {topk!r:.50}')
    if not 1 <= topk <= limits.max_topk:
        raise _BadRequest(422, f'"topk" must be between 1 and {limits.max_topk}, got {topk}')
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise _BadRequest(400, '"return_scores" must be true or false')
    return queries, topk, return_scores


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
            body = await _read_body(request, limits.max_body_bytes, limits.body_timeout)
            queries, topk, return_scores = parse_request(body, limits)
        except _BadRequest as e:
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


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"connection: close\r\n\r\n" + body


class _ConnectionGuard:
    """A header read timeout, a connection cap and JSON errors for a uvicorn HTTP protocol.

    Mixed in before uvicorn's ``H11Protocol`` or ``HttpToolsProtocol``; ``limits`` is set on a
    subclass by :func:`guarded_protocol`. A connection opened while ``max_connections`` are open
    gets a 503 and is closed; a request whose headers are not complete ``header_timeout``
    seconds after the connection opened (or, on a kept-alive connection, after its first byte)
    gets a 408 and the connection is closed (silently if nothing arrived); malformed HTTP gets a
    JSON 400. uvicorn's own keep-alive timeout still closes idle connections. The subclass arms
    the timer on a request's first byte and calls ``_cancel_header_timer`` once its headers are
    parsed.
    """

    limits: Limits = Limits()
    _header_timer: asyncio.TimerHandle | None = None
    _refused = False
    connections: set[Any]
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            self.transport = transport
            message = f"server has {len(self.connections)} open connections (limit {self.limits.max_connections})"
            transport.write(_raw_json_response(503, "Service Unavailable", message + "; retry later"))
            transport.close()
            return
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._refused:
            return
        super().connection_lost(exc)  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_raw_json_response(400, "Bad Request", f"malformed HTTP request: {msg}"))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._got_bytes = False
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self._got_bytes:
            message = f"request headers not received within {self.limits.header_timeout:g} s"
            self.transport.write(_raw_json_response(408, "Request Timeout", message))
        self.transport.close()


class GuardedH11Protocol(_ConnectionGuard, H11Protocol):
    """uvicorn's pure-Python h11 protocol with the :class:`_ConnectionGuard` limits."""

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # first byte of the next request on a kept-alive connection
        self._got_bytes = True
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers were parsed
            self._cancel_header_timer()


HTTP_PROTOCOLS: dict[str, type[_ConnectionGuard]] = {"h11": GuardedH11Protocol}

if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(_ConnectionGuard, HttpToolsProtocol):
        """uvicorn's ``httptools`` (C llhttp parser) protocol with the :class:`_ConnectionGuard` limits."""

        _between_requests = True  # no bytes of a next request parsed yet

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._header_timer is None and self._between_requests:
                self._arm_header_timer()  # first byte of the next request on a kept-alive connection
            self._got_bytes = True
            super().data_received(data)

        def on_message_begin(self) -> None:
            self._between_requests = False
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._between_requests = True

    HTTP_PROTOCOLS["httptools"] = GuardedHttpToolsProtocol


def resolve_http(http: str = "auto") -> str:
    """The HTTP parser to serve with: ``httptools`` when installed (``auto``), else ``h11``."""
    if http == "auto":
        return "httptools" if "httptools" in HTTP_PROTOCOLS else "h11"
    if http not in ("h11", "httptools"):
        raise ValueError(f"unknown HTTP implementation {http!r}; use auto, httptools or h11")
    if http not in HTTP_PROTOCOLS:
        raise ValueError("http='httptools' needs the httptools package (pip install httptools)")
    return http


def guarded_protocol(limits: Limits, http: str = "auto") -> type[_ConnectionGuard]:
    """The guarded protocol class of ``http`` (see :func:`resolve_http`) enforcing ``limits``."""
    base = HTTP_PROTOCOLS[resolve_http(http)]
    return type(f"{base.__name__}WithLimits", (base,), {"limits": limits})


def uvicorn_config(
    app: FastAPI, host: str, port: int, log_level: str = "warning", http: str = "auto"
) -> uvicorn.Config:
    """uvicorn config for ``app``: the guarded ``http`` protocol with the app's limits."""
    limits: Limits = app.state.limits
    _raise_open_files_limit(limits.max_connections + 64)
    protocol = guarded_protocol(limits, http)
    app.state.serving["http"] = resolve_http(http)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", http=protocol)


def _raise_open_files_limit(wanted: int) -> None:
    """Lift the soft limit on open files towards ``wanted`` (up to the hard limit) so the cap, not EMFILE, applies."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - platform without rlimits
        pass


def _wait_healthy(url: str, timeout: float, alive: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"retrieval server at {url} exited during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"retrieval server at {url} not healthy after {timeout:.0f} s")


class BackgroundServer:
    """A running server: ``.url`` (``http://host:port``), ``.stop()``; also a context manager."""

    def __init__(self, url: str, stop: Any, pid: int | None = None) -> None:
        self.url = url
        self.pid = pid  # server process id in subprocess mode, else None
        self._stop = stop

    @property
    def retrieve_url(self) -> str:
        return f"{self.url}/retrieve"

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_background(
    index: str | Path | Searcher,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    subprocess_mode: bool = False,
    startup_timeout: float = 120.0,
    threads: int = 1,
    workers: int | None = None,
    batch_wait_ms: float | None = None,
    max_batch: int = 256,
    mmap: bool = False,
    dense: dict[str, Any] | None = None,
    http: str = "auto",
    **limit_overrides: Any,
) -> BackgroundServer:
    """Start a server on ``host:port`` (0 = a free port) and return once ``/health`` answers.

    By default uvicorn runs in a daemon thread of this process; ``subprocess_mode=True`` starts
    ``python -m sorl_verl.retrieval.server`` instead (own process and GIL; ``index`` must be a
    directory). ``threads``: BM25 scoring threads per batch; ``workers``, ``batch_wait_ms``,
    ``max_batch``: see :func:`create_app`; ``mmap``: memory-map the BM25 postings; ``dense``:
    serve-time dense options (``device``, ``model``, ``faiss_gpu``, ``nprobe``, ``ef_search``,
    ``intra_op_threads``); ``http``: the HTTP parser (:func:`resolve_http`);
    ``limit_overrides``: fields of :class:`Limits`.
    """
    dense = dict(dense or {})
    resolve_http(http)  # an unknown or missing parser fails here, before anything starts
    if subprocess_mode:
        if not isinstance(index, str | Path):
            raise TypeError("subprocess_mode needs an index directory, not a searcher object")
        port_file = Path(tempfile.mkdtemp(prefix="sorl-retrieval-")) / "port"
        cmd = [sys.executable, "-m", "sorl_verl.retrieval.server", "--index", str(index), "--host", host]
        cmd += ["--port", str(port), "--port-file", str(port_file), "--threads", str(threads), "--log-level", "warning"]
        cmd += ["--max-batch", str(max_batch), "--http", http] + (["--mmap"] if mmap else [])
        cmd += ["--workers", str(workers)] if workers is not None else []
        cmd += ["--batch-wait-ms", str(batch_wait_ms)] if batch_wait_ms is not None else []
        for name, value in {**limit_overrides, **dense}.items():
            if value is True:
                cmd += [f"--{name.replace('_', '-')}"]
            elif value is not None and value is not False:
                cmd += [f"--{name.replace('_', '-')}", str(value)]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + startup_timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"retrieval server subprocess failed to start (exit code {proc.poll()})")
            time.sleep(0.05)
        url = f"http://{host}:{int(port_file.read_text())}"

        def stop_process() -> None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        try:
            _wait_healthy(url, startup_timeout, alive=lambda: proc.poll() is None)
        except Exception:
            stop_process()
            raise
        return BackgroundServer(url, stop_process, pid=proc.pid)

    n_workers = default_workers() if workers is None else workers
    searcher = (
        load_searcher(index, n_threads=threads, mmap=mmap, scratch_buffers=max(n_workers, threads), **dense)
        if isinstance(index, str | Path)
        else index
    )
    app = create_app(searcher, workers=n_workers, batch_wait_ms=batch_wait_ms, max_batch=max_batch, **limit_overrides)
    server = uvicorn.Server(uvicorn_config(app, host, port, http=http))
    thread = threading.Thread(target=server.run, name="sorl-retrieval-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            app.state.pool.shutdown(wait=False)
            raise RuntimeError(f"retrieval server failed to start on {host}:{port}")
        time.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{host}:{bound_port}"

    def stop_thread() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.pool.shutdown(wait=False)

    _wait_healthy(url, startup_timeout)
    return BackgroundServer(url, stop_thread)


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
