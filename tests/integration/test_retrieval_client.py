"""RetrievalClient against the real server and against loopback servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from aiohttp import web

from sorl_verl.retrieval.build import build_index
from sorl_verl.retrieval.client import SEARCH_FAILED_PREFIX, RetrievalClient, RetrievalError, format_documents
from sorl_verl.retrieval.server import BackgroundServer, serve_in_background

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    d = tmp_path_factory.mktemp("cli")
    with open(d / "c.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"id": str(i), "contents": f'"Item {i}"\nItem {i} is made of marker{i} stone.'}) + "\n")
    with serve_in_background(build_index(d / "c.jsonl", d / "index", show_progress=False), max_topk=10) as s:
        yield s


class FlakyServer:
    """aiohttp server on a loopback port whose /retrieve runs ``handler``; counts calls and concurrency."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.calls, self.in_flight, self.max_in_flight = handler, 0, 0, 0

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.handler(request)
        finally:
            self.in_flight -= 1


@pytest.fixture
async def flaky() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[str, FlakyServer]]]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> tuple[str, FlakyServer]:
        srv = FlakyServer(handler)
        app = web.Application()
        app.router.add_post("/retrieve", srv._retrieve)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}", srv

    yield start
    for r in runners:
        await r.cleanup()


def _ok_body(n: int) -> dict:
    return {"result": [[{"document": {"id": "7", "contents": '"T"\nbody'}, "score": 1.5}] for _ in range(n)]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_against_real_server(real_server: BackgroundServer) -> None:
    async with RetrievalClient(real_server.url, topk=2) as c:
        hits = await c.retrieve(["marker3 stone", "marker9"])
        assert [h["id"] for h in hits[1]][:1] == ["9"] and len(hits[0]) == 2
        assert hits[0][0]["id"] == "3" and hits[0][0]["score"] >= hits[0][1]["score"]
        text = await c.search("marker12 stone")
        assert text.startswith('Doc 1(Title: "Item 12") Item 12 is made of marker12 stone.\nDoc 2(Title: ')
        assert text == format_documents((await c.retrieve(["marker12 stone"]))[0])
        long_query = "marker5 " + "x" * 5000  # over the server's 4096-character limit: cut, not rejected
        assert (await c.retrieve([long_query]))[0][0]["id"] == "5"
    async with RetrievalClient(real_server.url, max_query_chars=None) as c:
        with pytest.raises(RetrievalError) as e:
            await c.retrieve([long_query])
        assert e.value.status == 422
    async with RetrievalClient(real_server.retrieve_url) as c:  # full /retrieve URL accepted
        assert len((await c.retrieve(["marker1 stone"], topk=4))[0]) == 4
        assert c.attempts == 1


async def test_server_down_bounded_retries_then_observation() -> None:
    c = RetrievalClient(f"http://127.0.0.1:{_free_port()}", max_retries=2, backoff=0.1, timeout=2)
    t0 = time.perf_counter()
    with pytest.raises(RetrievalError, match="after 3 attempts"):
        await c.retrieve(["q"])
    assert c.attempts == 3
    assert time.perf_counter() - t0 >= 0.1 + 0.2  # backoff 0.1 then 0.2
    text = await c.search("q")
    assert text.startswith(SEARCH_FAILED_PREFIX) and "unavailable" in text
    assert c.attempts == 6
    # the failure is a value (Observation.failed); the text the model sees is the contract the runs train on
    observed = await c.observe("q")
    assert observed.failed and observed.text == text
    assert text == (
        "Search failed (the search service is unavailable). Try the search again, or answer with what you already know."
    )
    await c.aclose()


async def test_slow_server_times_out(flaky) -> None:
    release = asyncio.Event()

    async def never_answers(request: web.Request) -> web.Response:
        await release.wait()  # answers only after the test is over
        return web.json_response(_ok_body(1))

    url, srv = await flaky(never_answers)
    try:
        async with RetrievalClient(url, timeout=0.3, max_retries=1, backoff=0.05) as c:
            t0 = time.perf_counter()
            text = await c.search("anything")
            elapsed = time.perf_counter() - t0
    finally:
        release.set()
    assert text.startswith(SEARCH_FAILED_PREFIX)
    assert srv.calls == 2 and c.attempts == 2
    assert 0.6 <= elapsed < 5.0  # two 0.3 s timeouts and a backoff; without timeouts it would hang


async def test_5xx_is_retried_until_success(flaky) -> None:
    async def fails_twice(request: web.Request) -> web.Response:
        if srv.calls <= 2:
            return web.Response(status=503, text="warming up")
        body = await request.json()
        return web.json_response(_ok_body(len(body["queries"])))

    url, srv = await flaky(fails_twice)
    async with RetrievalClient(url, max_retries=3, backoff=0.01) as c:
        hits = await c.retrieve(["a", "b"])
    assert srv.calls == 3
    assert hits == [[{"id": "7", "contents": '"T"\nbody', "score": 1.5}]] * 2


async def test_persistent_500_gives_up(flaky) -> None:
    async def always_500(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    url, srv = await flaky(always_500)
    async with RetrievalClient(url, max_retries=2, backoff=0.01) as c:
        with pytest.raises(RetrievalError, match="HTTP 500"):
            await c.retrieve(["a"])
        assert srv.calls == 3
        assert (await c.search("a")).startswith(SEARCH_FAILED_PREFIX)
        assert srv.calls == 6


async def test_4xx_is_not_retried(flaky) -> None:
    async def reject(request: web.Request) -> web.Response:
        return web.json_response({"error": "topk must be between 1 and 5"}, status=422)

    url, srv = await flaky(reject)
    async with RetrievalClient(url, max_retries=3, backoff=0.01) as c:
        with pytest.raises(RetrievalError) as e:
            await c.retrieve(["a"], topk=50)
        assert e.value.status == 422 and srv.calls == 1
        text = await c.search("a")
        assert "rejected" in text and "between 1 and 5" in text and srv.calls == 2


async def test_malformed_response_and_bare_documents(flaky) -> None:
    async def odd(request: web.Request) -> web.Response:
        body = await request.json()
        if body["queries"] == ["bad"]:
            return web.json_response({"unexpected": True})
        return web.json_response({"result": [[{"id": "1", "contents": '"A"\nx'}]]})  # return_scores=false shape

    url, _ = await flaky(odd)
    async with RetrievalClient(url, backoff=0.01) as c:
        with pytest.raises(RetrievalError, match="malformed"):
            await c.retrieve(["bad"])
        assert (await c.search("bad")).startswith(SEARCH_FAILED_PREFIX)
        assert await c.search("good") == 'Doc 1(Title: "A") x'


async def test_concurrency_cap(flaky) -> None:
    async def hold(request: web.Request) -> web.Response:
        await asyncio.sleep(0.1)
        return web.json_response(_ok_body(1))

    url, srv = await flaky(hold)
    async with RetrievalClient(url, max_concurrency=4) as c:
        texts = await asyncio.gather(*(c.search(f"q{i}") for i in range(20)))
    assert all(t.startswith('Doc 1(Title: "T") body') for t in texts)
    assert srv.calls == 20 and srv.max_in_flight == 4


def test_constructor_validates_and_normalizes_url() -> None:
    assert RetrievalClient("http://h:1/").url == "http://h:1/retrieve"
    assert RetrievalClient("http://h:1/retrieve").url == "http://h:1/retrieve"
    with pytest.raises(ValueError):
        RetrievalClient("http://h:1", max_retries=-1)
