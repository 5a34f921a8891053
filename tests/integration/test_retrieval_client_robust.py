"""RetrievalClient against broken answers, its preflight ``check()``, and several servers (failover).

Servers are real: the project's retrieval server on loopback ports, and aiohttp servers on
loopback that answer wrongly on purpose (a proxy's HTML page, ``{"result": [null]}``, ...).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_verl.retrieval.build import build_index
from sorl_verl.retrieval.client import SEARCH_FAILED_PREFIX, RetrievalClient, RetrievalError, parse_result, split_urls
from sorl_verl.retrieval.server import BackgroundServer, serve_in_background

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("robust")
    with open(d / "c.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": str(i), "contents": f'"Item {i}"\nitem {i} made of marker{i} clay'}) + "\n")
    return build_index(d / "c.jsonl", d / "index", show_progress=False)


@pytest.fixture(scope="module")
def two_servers(index_dir: Path) -> Iterator[tuple[BackgroundServer, BackgroundServer]]:
    with serve_in_background(index_dir) as a, serve_in_background(index_dir) as b:
        yield a, b


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/retrieve", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["result", "document", "contents", "id", "score", "x"]), inner, max_size=4)
    ),
    max_leaves=15,
)


@settings(max_examples=400, deadline=None)
@given(body=json_values | st.fixed_dictionaries({"result": st.lists(json_values, min_size=1, max_size=2)}))
def test_parse_result_accepts_or_raises_retrieval_error(body: Any) -> None:
    try:
        rows = parse_result(body, 1, "http://x/retrieve")
    except RetrievalError as e:
        assert e.retryable and "http://x/retrieve" in str(e)
    else:
        assert len(rows) == 1
        for hit in rows[0]:
            assert isinstance(hit["contents"], str) and set(hit) == {"id", "contents", "score"}


@st.composite
def well_formed_hit(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """A hit as a Search-R1 server writes it (``{"document": {...}, "score": s}``) or bare (``{"id",
    "contents", "score"}``), extra keys included; with the ``{"id", "contents", "score"}`` it must parse to
    (``contents`` "" and ``score`` None where absent)."""
    fields = {"id": st.text(max_size=5) | st.integers(), "contents": st.text(max_size=20), "title": st.text(max_size=5)}
    doc = draw(st.fixed_dictionaries({}, optional=fields))
    score = draw(st.none() | st.integers() | st.floats(allow_nan=False))
    item = {"document": doc} if draw(st.booleans()) else dict(doc)
    if score is not None or draw(st.booleans()):
        item["score"] = score
    return item, {"id": doc.get("id"), "contents": doc.get("contents", ""), "score": score}


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(well_formed_hit(), max_size=3), min_size=1, max_size=3))
def test_parse_result_accepts_every_well_formed_answer(rows: list[list[tuple[dict, dict]]]) -> None:
    """Both dialects parse, hit for hit: a parser that rejects (or retries) a good answer fails here."""
    body = {"result": [[item for item, _ in row] for row in rows]}
    assert parse_result(body, len(rows), "http://x/retrieve") == [[hit for _, hit in row] for row in rows]


@pytest.mark.parametrize(
    ("status", "content_type", "payload"),
    [
        (200, "text/html", b"<html><body>502 Bad Gateway</body></html>"),
        (200, "application/json", b'{"result": [null]}'),
        (200, "application/json", b'{"result": [[{"document": {"contents": 7}}]]}'),
        (200, "application/json", b'{"result": [["x"]]}'),
        (200, "application/json", b"[" * 5000),
        (200, "application/json", b"\xff\xfe"),
        (502, "text/html", b"<html>\xff bad gateway</html>"),
    ],
)
async def test_broken_answers_raise_retrieval_error(fake, status: int, content_type: str, payload: bytes) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, body=payload, content_type=content_type)

    url = await fake(answer)
    async with RetrievalClient(url, max_retries=1, backoff=0.01) as c:
        with pytest.raises(RetrievalError, match="after 2 attempts") as e:
            await c.retrieve(["q"])
        assert url in str(e.value) and c.attempts == 2
        assert (await c.search("q")).startswith(SEARCH_FAILED_PREFIX)
        with pytest.raises(RetrievalError, match=url):
            await c.check()


async def test_lone_surrogate_query_is_repaired_not_rejected(two_servers: tuple[BackgroundServer, ...]) -> None:
    async with RetrievalClient(two_servers[0].url, topk=1) as c:
        hits = await c.retrieve(["marker7 \ud800 clay"])
    assert hits[0][0]["id"] == "7"


async def test_check_passes_on_live_servers_and_names_dead_ones(two_servers: tuple[BackgroundServer, ...]) -> None:
    a, b = two_servers
    async with RetrievalClient([a.url, b.retrieve_url]) as c:
        assert await c.check() is None
    dead = _dead_url()
    async with RetrievalClient(f"{a.url},{dead}", max_retries=1, backoff=0.01, timeout=2) as c:
        with pytest.raises(RetrievalError) as e:
            await c.check()
        message = str(e.value)
        assert f"{dead}/retrieve" in message and "1 of 2" in message and a.url not in message.split(":", 1)[1]


async def test_check_rejects_a_server_that_is_not_the_retrieval_api(fake) -> None:
    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text="Not Found")

    url = await fake(not_found)
    async with RetrievalClient(url, max_retries=3, backoff=0.01) as c:
        with pytest.raises(RetrievalError, match="HTTP 404") as e:
            await c.check()
        assert url in str(e.value) and c.attempts == 1  # a 4xx is not retried


async def test_round_robin_over_two_real_servers(two_servers: tuple[BackgroundServer, ...], index_dir: Path) -> None:
    a, b = two_servers
    async with RetrievalClient([a.url, b.url], topk=1) as c:
        for i in range(6):
            assert (await c.retrieve([f"marker{i}"]))[0][0]["id"] == str(i)
        assert c.attempts == 6
        assert c._next == 0  # six requests alternated over the two servers


async def test_failover_and_health(index_dir: Path) -> None:
    a = serve_in_background(index_dir)
    b = serve_in_background(index_dir)
    try:
        async with RetrievalClient([a.url, b.url], topk=1, max_retries=0, cooldown=30, timeout=3) as c:
            a.stop()  # first server gone: every request still answered, by the second
            for i in range(8):
                assert (await c.retrieve([f"marker{i}"]))[0][0]["id"] == str(i)
            assert c.attempts == 9  # one failed attempt at the dead server, then it is skipped while down
            assert c.health[a.retrieve_url].failures == 1 and c.health[b.retrieve_url].failures == 0
            b.stop()
            with pytest.raises(RetrievalError, match="2 servers"):
                await c.retrieve(["marker1"])
    finally:
        a.stop()
        b.stop()


async def test_server_that_comes_back_is_used_again(fake) -> None:
    state = {"up": False, "calls": 0}

    async def flaky(request: web.Request) -> web.Response:
        state["calls"] += 1
        if not state["up"]:
            return web.Response(status=503, text="starting")
        return web.json_response({"result": [[{"document": {"id": "f", "contents": '"F"\nx'}, "score": 1.0}]]})

    async def steady(request: web.Request) -> web.Response:
        return web.json_response({"result": [[{"document": {"id": "s", "contents": '"S"\ny'}, "score": 1.0}]]})

    flaky_url, steady_url = await fake(flaky), await fake(steady)
    async with RetrievalClient([flaky_url, steady_url], max_retries=0, cooldown=0.2) as c:
        ids = [(await c.retrieve(["q"]))[0][0]["id"] for _ in range(4)]
        assert ids == ["s"] * 4 and state["calls"] == 1  # down after one 503: skipped during the cooldown
        state["up"] = True
        await asyncio.sleep(0.25)
        ids = [(await c.retrieve(["q"]))[0][0]["id"] for _ in range(4)]
        assert sorted(ids) == ["f", "f", "s", "s"]  # back in the rotation


def test_split_urls() -> None:
    assert split_urls("http://a:1, http://b:2/retrieve/") == ["http://a:1/retrieve", "http://b:2/retrieve"]
    assert RetrievalClient(["http://a:1"]).urls == ["http://a:1/retrieve"]
    for bad, words in (("", "no retrieval URL"), ("a:1", "http://"), ("http://a:1,http://a:1/retrieve", "repeat")):
        with pytest.raises(ValueError, match=words):
            split_urls(bad)
