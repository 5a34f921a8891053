"""HTTP hardening of the retrieval server: uvicorn's protocols with a header read timeout, a cap on
open connections and JSON errors (:class:`ConnectionGuard`), and the uvicorn config using them.

HTTP is parsed by uvicorn's ``httptools`` protocol (C) when installed, else by pure-Python
``h11`` (``http`` picks one); both carry the same guards.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is a dependency; h11 remains the fallback
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from .server_requests import Limits


def _raw_json_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"connection: close\r\n\r\n" + body


class ConnectionGuard:
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


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """uvicorn's pure-Python h11 protocol with the :class:`ConnectionGuard` limits."""

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


HTTP_PROTOCOLS: dict[str, type[ConnectionGuard]] = {"h11": GuardedH11Protocol}

if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
        """uvicorn's ``httptools`` (C llhttp parser) protocol with the :class:`ConnectionGuard` limits."""

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


def guarded_protocol(limits: Limits, http: str = "auto") -> type[ConnectionGuard]:
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
