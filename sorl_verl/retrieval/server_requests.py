"""Validation of ``POST /retrieve`` requests: the server's :class:`Limits`, the body read under a
size and time limit, and the JSON checked field by field; each failure is a :class:`BadRequest`
with the HTTP status to answer (400 malformed, 408 too slow, 413 too large, 422 over a limit).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request


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


class BadRequest(Exception):
    """A request the server refuses; ``status`` is the HTTP status of the answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, at most ``limit`` bytes, received within ``timeout`` seconds; else 413 / 408."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise BadRequest(413, f"request body of {declared:.30} bytes exceeds the limit of {limit} bytes")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError as e:
        raise BadRequest(408, f"request body not received within {timeout:g} s") from e


def parse_request(body: bytes, limits: Limits) -> tuple[list[str], int, bool]:
    """``(queries, topk, return_scores)`` from a /retrieve body; raises ``BadRequest``."""
    try:
        payload = json.loads(body)
    except RecursionError as e:
        raise BadRequest(400, "body is not valid JSON: nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise BadRequest(400, f"body is not valid JSON: {str(e):.200}") from e
    if not isinstance(payload, dict):
        raise BadRequest(400, 'body must be a JSON object like {"queries": [...], "topk": 3}')
    if ("queries" in payload) == ("query" in payload):
        raise BadRequest(400, 'give exactly one of "queries" (list of strings) or "query" (string)')
    queries = payload["queries"] if "queries" in payload else [payload["query"]]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest(400, '"queries" must be a list of strings and "query" a string')
    if len(queries) > limits.max_queries:
        raise BadRequest(422, f"{len(queries)} queries in one request; the limit is {limits.max_queries}")
    for i, q in enumerate(queries):
        try:
            q.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(400, f"query {i} is not valid Unicode: lone surrogate at character {e.start}") from e
    too_long = [i for i, q in enumerate(queries) if len(q) > limits.max_query_chars]
    if too_long:
        raise BadRequest(
            422,
            f"query {too_long[0]} has {len(queries[too_long[0]])} characters; the limit is {limits.max_query_chars}",
        )
    topk = payload.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise BadRequest(400, f'"topk" must be an integer, got {topk!r:.50}')
    if not 1 <= topk <= limits.max_topk:
        raise BadRequest(422, f'"topk" must be between 1 and {limits.max_topk}, got {topk}')
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(400, '"return_scores" must be true or false')
    return queries, topk, return_scores
