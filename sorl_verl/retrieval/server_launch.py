"""Starting the retrieval server from Python: in a daemon thread of this process or as a
``python -m sorl_verl.retrieval.server`` subprocess, returning once ``/health`` answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import uvicorn

from .index import Searcher, default_workers, load_searcher
from .server_app import create_app
from .server_http import resolve_http, uvicorn_config


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
