"""Fail fast on retrieval: a preflight search per worker process and a failure-rate guard.

verl builds one agent-loop object per trajectory and offers no hook at agent-loop worker start,
so the state lives here, one :class:`RetrievalGuard` per (event loop, retrieval URL), shared by
every trajectory of a worker process:

- ``preflight``: before the first episode generates anything, one real search; concurrent
  episodes wait on the same request. A failure raises :class:`RetrievalUnavailableError` naming
  the URL and the error (and every later episode of that process raises it at once), so the
  rollout, and with it the verl run, stops instead of training on "Search failed" observations.
- ``record``: after each search, whether it failed (the client's ``Observation.failed``). When
  the last ``window`` searches hold more than ``max_failure_rate`` failures, it raises the same
  error with the counts and the last failure.

verl 0.9.1's v1 trainer runs each prompt's agent loops as background tasks and only logs their
exceptions (the prompt's group is marked failed), so an error raised in a worker reaches the log,
not the driver. :func:`preflight_from_config` is the same preflight for trainer start: called in
the driver with the trainer config, before any worker starts, it raises with the URL at once.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Any

from sorl_verl.agent.settings import search_agent_settings

__all__ = ["RetrievalGuard", "RetrievalUnavailableError", "preflight_from_config", "search_agent_settings"]

PREFLIGHT_QUERY = "retrieval preflight check"


class RetrievalUnavailableError(RuntimeError):
    """The retrieval server cannot serve the agent; the message names the URL and the fix."""


async def probe(searcher: Any) -> None:
    """One real search through ``searcher``; raises with the reason when it fails.

    Uses the client's own preflight (``check``) when it has one, else ``retrieve`` (raises on
    failure), else ``observe`` (an ``Observation`` with ``failed``), else ``search`` (raises only).
    """
    if callable(getattr(searcher, "check", None)):
        await searcher.check()
    elif callable(getattr(searcher, "retrieve", None)):
        await searcher.retrieve([PREFLIGHT_QUERY], 1)
    elif callable(getattr(searcher, "observe", None)):
        result = await searcher.observe(PREFLIGHT_QUERY, 1)
        if result.failed:
            raise RuntimeError(result.text)
    else:
        await searcher.search(PREFLIGHT_QUERY, 1)


class RetrievalGuard:
    """Preflight and failure-rate guard of one retrieval URL in one worker process."""

    def __init__(self, url: str, window: int, max_failure_rate: float) -> None:
        self.url, self.window, self.max_failure_rate = url, window, max_failure_rate
        self.outcomes: deque[bool] = deque(maxlen=window)
        self._preflight: asyncio.Task[None] | None = None

    async def preflight(self, searcher: Any) -> None:
        """Run the preflight once (module docstring); raises :class:`RetrievalUnavailableError`."""
        if self._preflight is None:
            self._preflight = asyncio.ensure_future(self._run_preflight(searcher))
        await asyncio.shield(self._preflight)

    async def _run_preflight(self, searcher: Any) -> None:
        try:
            await probe(searcher)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means the agent cannot search
            raise RetrievalUnavailableError(
                f"retrieval preflight failed: the search_r1 agent loop cannot search at {self.url}: "
                f"{type(e).__name__}: {e}. Start the retrieval server (sorl-verl serve --index DIR --port PORT) "
                "or point sorl.agent.retrieval_url (or $SORL_RETRIEVAL_URL) at it; "
                "sorl.agent.retrieval_preflight=false skips this check."
            ) from None

    def record(self, failed: bool, observation: str = "") -> None:
        """Count one search; raises :class:`RetrievalUnavailableError` when the window's failure
        rate exceeds ``max_failure_rate``."""
        self.outcomes.append(failed)
        failures = sum(self.outcomes)
        if len(self.outcomes) == self.window and failures > self.max_failure_rate * self.window:
            raise RetrievalUnavailableError(
                f"retrieval failing: {failures} of the last {self.window} searches to {self.url} failed "
                f"(more than sorl.agent.max_search_failure_rate={self.max_failure_rate} of "
                f"sorl.agent.search_failure_window={self.window}); last failure: {observation[:200]!r}. "
                "Stopping the run rather than training on failed searches; check the retrieval server."
            )


_GUARDS: weakref.WeakKeyDictionary[Any, dict[tuple, RetrievalGuard]] = weakref.WeakKeyDictionary()


def shared_guard(url: str, window: int, max_failure_rate: float, loop: Any) -> RetrievalGuard:
    """The process's guard for ``url`` on event loop ``loop`` (created on first use)."""
    per_loop = _GUARDS.setdefault(loop, {})
    key = (url, window, max_failure_rate)
    if key not in per_loop:
        per_loop[key] = RetrievalGuard(url, window, max_failure_rate)
    return per_loop[key]


def preflight_from_config(config: Any) -> None:
    """Trainer-start preflight: one real search with the run's settings; raises
    :class:`RetrievalUnavailableError` naming the URL. A no-op when the run does not use the
    ``search_r1`` loop by default or ``retrieval_preflight`` is off."""
    settings = search_agent_settings(config)
    if settings is None or not settings.retrieval_preflight:
        return

    async def check() -> None:
        client = settings.retrieval_client(topk=1)
        try:
            await RetrievalGuard(settings.retrieval_url, 1, 1.0).preflight(client)
        finally:
            await client.aclose()

    asyncio.run(check())
