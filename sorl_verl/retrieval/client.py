"""Async client of the retrieval server, as the search agent uses it.

``RetrievalClient.retrieve`` returns raw hits and raises :class:`RetrievalError` after bounded
retries; ``RetrievalClient.observe`` never raises: it returns an :class:`Observation`, the text
the agent shows the model (the formatted documents or a short failure notice) and whether the
search failed; ``RetrievalClient.search`` returns only that text.
``RetrievalClient.check`` is a preflight: one real search per server, raising
:class:`RetrievalError` naming every URL that failed.

Several servers (a list of URLs, or one string with comma-separated URLs): requests go
round-robin over the servers that are up. A server that fails (connection error, timeout,
HTTP 5xx, 408 or 429, or a response that is not the expected JSON) is marked down for
``cooldown * 2**(consecutive failures - 1)`` seconds (at most 60) and the request moves on to
the next server at once; servers marked down are tried only after every server that is up.

Retry policy: one round tries each server once; after a failed round the client sleeps
``backoff * 2**round`` seconds (capped at 8 s) and starts another, at most ``max_retries + 1``
rounds (with one server: ``max_retries`` retries). Any other 4xx is the caller's fault and
fails at once. At most ``max_concurrency`` requests are in flight per client and event loop.
Queries are cut to ``max_query_chars`` characters (a model can write a runaway query; the
server would reject it with a 4xx) and lone surrogates are replaced, so they encode as UTF-8.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 8.0
MAX_COOLDOWN_S = 60.0
SEARCH_FAILED_PREFIX = "Search failed"
NO_RESULTS_TEXT = "No documents matched the query. Try different search terms."
RETRYABLE_STATUS = frozenset({408, 429})


class RetrievalError(RuntimeError):
    """The retrieval server could not answer (after retries where retrying makes sense).

    ``status``: the HTTP status when the server answered with an error; ``retryable``: whether
    another attempt (or another server) could succeed.
    """

    def __init__(self, message: str, status: int | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = (
            (status is None or status >= 500 or status in RETRYABLE_STATUS) if retryable is None else retryable
        )


def format_documents(docs: Sequence[dict[str, Any]]) -> str:
    """Search-R1's observation text: ``Doc 1(Title: <first line>) <rest>`` lines joined by newlines.

    ``docs`` are dicts with ``contents`` (wiki-18 ``"Title"\\ntext``; the first line is the
    title), either bare or wrapped as ``{"document": {...}, "score": s}``.
    """
    if not docs:
        return NO_RESULTS_TEXT
    lines = []
    for i, doc in enumerate(docs, start=1):
        contents = str((doc.get("document") or doc).get("contents", ""))
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines)


def failure_text(reason: str) -> str:
    """Observation shown to the model when a search could not be answered."""
    return f"{SEARCH_FAILED_PREFIX} ({reason}). Try the search again, or answer with what you already know."


@dataclass(frozen=True)
class Observation:
    """The outcome of one search as the agent sees it: ``text`` for the model (documents or a
    failure notice) and ``failed``, whether the search could not be answered."""

    text: str
    failed: bool = False

    @classmethod
    def failure(cls, reason: str) -> Observation:
        return cls(failure_text(reason), failed=True)


def _hit(item: Any, url: str) -> dict[str, Any]:
    """``{"id", "contents", "score"}`` from a hit in either dialect; malformed -> :class:`RetrievalError`."""
    doc = item.get("document") if isinstance(item, dict) and isinstance(item.get("document"), dict) else item
    if not isinstance(doc, dict):
        raise RetrievalError(f"malformed hit in the response from {url}: {item!r:.200}", retryable=True)
    contents, score = doc.get("contents", ""), item.get("score")
    if not isinstance(contents, str) or not (
        score is None or (isinstance(score, int | float) and not isinstance(score, bool))
    ):
        raise RetrievalError(f"malformed hit in the response from {url}: {item!r:.200}", retryable=True)
    return {"id": doc.get("id"), "contents": contents, "score": score}


def parse_result(body: Any, num_queries: int, url: str) -> list[list[dict[str, Any]]]:
    """Hits per query from a decoded ``/retrieve`` response; anything else -> :class:`RetrievalError`."""
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != num_queries or not all(isinstance(r, list) for r in result):
        raise RetrievalError(
            f"malformed response from {url} (expected {num_queries} result lists): {str(body)[:200]}", retryable=True
        )
    return [[_hit(item, url) for item in row] for row in result]


def split_urls(url: str | Sequence[str]) -> list[str]:
    """Full ``/retrieve`` URLs from one URL, a comma-separated string or a sequence of URLs."""
    parts = url.split(",") if isinstance(url, str) else [str(u) for u in url]
    urls = []
    for part in (p.strip().rstrip("/") for p in parts):
        if not part:
            continue
        if not part.startswith(("http://", "https://")):
            raise ValueError(f"retrieval URL must start with http:// or https://, got {part!r}")
        urls.append(part if part.endswith("/retrieve") else f"{part}/retrieve")
    if not urls:
        raise ValueError(f"no retrieval URL in {url!r}")
    if len(set(urls)) != len(urls):
        raise ValueError(f"retrieval URLs repeat: {urls}")
    return urls


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) if isinstance(e, RetrievalError) else f"{type(e).__name__}: {e}"


@dataclass
class ServerHealth:
    """Passive health of one server: consecutive failures and when it may be tried first again."""

    failures: int = 0
    down_until: float = 0.0


class RetrievalClient:
    """Client of ``POST /retrieve`` on one or more servers (base URLs or full ``/retrieve`` URLs)."""

    def __init__(
        self,
        url: str | Sequence[str],
        topk: int = 3,
        timeout: float = 10.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_concurrency: int = 64,
        max_query_chars: int | None = 1024,
        cooldown: float = 2.0,
    ) -> None:
        if max_retries < 0 or timeout <= 0 or backoff < 0 or max_concurrency < 1 or topk < 1 or cooldown < 0:
            raise ValueError(
                "need topk >= 1, timeout > 0, max_retries >= 0, backoff >= 0, max_concurrency >= 1, cooldown >= 0"
            )
        self.urls = split_urls(url)
        self.url = self.urls[0]
        self.topk = topk
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_concurrency = max_concurrency
        self.max_query_chars = max_query_chars
        self.cooldown = cooldown
        self.health = {u: ServerHealth() for u in self.urls}
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self.attempts = 0  # HTTP attempts made, retries included (for metrics and tests)

    def _bind(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
        assert self._sem is not None
        return self._session, self._sem

    def _order(self) -> list[str]:
        """This request's server order: those up, round-robin from the next; then those down, soonest back first."""
        n, now = len(self.urls), time.monotonic()
        start, self._next = self._next, (self._next + 1) % n
        rotated = self.urls[start:] + self.urls[:start]
        up = [u for u in rotated if self.health[u].down_until <= now]
        down = sorted((u for u in rotated if self.health[u].down_until > now), key=lambda u: self.health[u].down_until)
        return up + down

    def _mark(self, url: str, ok: bool) -> None:
        h = self.health[url]
        if ok:
            h.failures, h.down_until = 0, 0.0
            return
        h.failures += 1
        h.down_until = time.monotonic() + min(self.cooldown * 2 ** (h.failures - 1), MAX_COOLDOWN_S)

    async def _post_once(self, url: str, payload: dict[str, Any]) -> list[list[dict[str, Any]]]:
        session, sem = self._bind()
        async with sem:
            self.attempts += 1
            async with session.post(url, json=payload) as resp:
                raw = await resp.read()
                status, ctype = resp.status, resp.headers.get("content-type", "?")
        if status >= 400:
            text = raw[:300].decode("utf-8", "replace")
            raise RetrievalError(f"HTTP {status} from {url}: {text}", status=status)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # also an HTML error page from a proxy
            snippet = raw[:120].decode("utf-8", "replace")
            raise RetrievalError(
                f"response from {url} is not JSON (HTTP {status}, {ctype}): {snippet!r}", retryable=True
            ) from e
        return parse_result(body, len(payload["queries"]), url)

    def _clean(self, queries: Sequence[str]) -> list[str]:
        cut = [str(q)[: self.max_query_chars] if self.max_query_chars else str(q) for q in queries]
        return [q.encode("utf-8", "replace").decode("utf-8") for q in cut]  # lone surrogates -> "?"

    async def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict[str, Any]]]:
        """Per query, hits ``{"id", "contents", "score"}`` best first; raises :class:`RetrievalError`."""
        queries = self._clean(queries)
        if not queries:
            return []
        payload = {"queries": queries, "topk": int(topk or self.topk), "return_scores": True}
        last: BaseException | None = None
        for round_ in range(self.max_retries + 1):
            if round_:
                await asyncio.sleep(min(self.backoff * 2 ** (round_ - 1), MAX_BACKOFF_S))
            for url in self._order():
                try:
                    hits = await self._post_once(url, payload)
                except RetrievalError as e:
                    if not e.retryable:
                        raise
                    last = e
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    last = e
                else:
                    self._mark(url, ok=True)
                    return hits
                self._mark(url, ok=False)
                logger.debug("retrieval attempt at %s failed (round %d): %r", url, round_ + 1, last)
        assert last is not None
        where = self.url if len(self.urls) == 1 else f"{len(self.urls)} servers"
        raise RetrievalError(
            f"retrieval failed after {self.attempts_per_request} attempts ({where}): {_describe(last)}",
            status=getattr(last, "status", None),
        )

    @property
    def attempts_per_request(self) -> int:
        """Most HTTP attempts one ``retrieve`` makes: every server, ``max_retries + 1`` rounds."""
        return len(self.urls) * (self.max_retries + 1)

    async def check(self) -> None:
        """Preflight: every server answers one real search (with this client's retries).

        Returns ``None`` when all do; raises :class:`RetrievalError` naming each URL that failed
        and why (connection refused, timeout, HTTP status, not the retrieval API).
        """
        payload = {"queries": ["retrieval preflight check"], "topk": 1, "return_scores": True}
        failures = []
        for url in self.urls:
            for round_ in range(self.max_retries + 1):
                if round_:
                    await asyncio.sleep(min(self.backoff * 2 ** (round_ - 1), MAX_BACKOFF_S))
                try:
                    await self._post_once(url, payload)
                except RetrievalError as e:
                    err: BaseException | None = e
                    if not e.retryable:
                        break
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    err = e
                else:
                    err = None
                    break
            self._mark(url, ok=err is None)
            if err is not None:
                failures.append(f"{url}: {_describe(err)}")
        if failures:
            raise RetrievalError(
                f"retrieval preflight failed for {len(failures)} of {len(self.urls)} server(s): " + "; ".join(failures)
            )

    async def observe(self, query: str, topk: int | None = None) -> Observation:
        """The :class:`Observation` of one query; never raises (a failure is a notice for the model)."""
        try:
            (hits,) = await self.retrieve([query], topk)
        except asyncio.CancelledError:
            raise
        except RetrievalError as e:
            logger.warning("search %r failed: %s", query[:80], e)
            if not e.retryable and e.status is not None and 400 <= e.status < 500:
                return Observation.failure(f"the search service rejected the query: {str(e)[:160]}")
            return Observation.failure("the search service is unavailable")
        except Exception as e:  # noqa: BLE001 - the episode must go on whatever happens
            logger.warning("search %r failed unexpectedly: %r", query[:80], e)
            return Observation.failure("unexpected error")
        return Observation(format_documents(hits))

    async def search(self, query: str, topk: int | None = None) -> str:
        """Observation text for one query (:meth:`observe`'s ``text``); never raises."""
        return (await self.observe(query, topk)).text

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> RetrievalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
