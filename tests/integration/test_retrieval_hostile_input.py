"""Hostile input against the real retrieval server on 127.0.0.1: every bad request gets a JSON 4xx.

Request bodies (hypothesis: arbitrary JSON, near-valid requests, raw bytes), stalled uploads
(header and body read timeouts), a connection flood (cap), malformed HTTP, and the bounded
search worker pool.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sorl_verl.retrieval.build import build_index
from sorl_verl.retrieval.index import IndexSearcher, load_searcher
from sorl_verl.retrieval.server import BackgroundServer, serve_in_background

LIMITS = {"max_queries": 8, "max_topk": 5, "max_query_chars": 64, "max_body_bytes": 20_000}
OK_STATUSES = {200, 400, 408, 413, 422}
HTTP = ["httptools", "h11"]  # both HTTP parsers the server can run on carry the same guards


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    with open(d / "c.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"id": str(i), "contents": f'"T{i}"\nstone river token{i} {"x" * (i % 7)}'}) + "\n")
    return build_index(d / "c.jsonl", d / "index", show_progress=False)


@pytest.fixture(scope="module", params=HTTP)
def server(index_dir: Path, request: pytest.FixtureRequest) -> Iterator[BackgroundServer]:
    with serve_in_background(index_dir, http=request.param, **LIMITS) as s:
        yield s


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def post_raw(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", _port(url), timeout=30)
    try:
        conn.request("POST", "/retrieve", body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read()
    finally:
        conn.close()


def assert_well_formed(status: int, ctype: str, raw: bytes, n_queries: int | None = None) -> Any:
    assert status in OK_STATUSES, (status, raw[:300])
    assert ctype.startswith("application/json"), (status, ctype, raw[:300])
    body = json.loads(raw)
    if status == 200:
        assert isinstance(body["result"], list)
        if n_queries is not None:
            assert len(body["result"]) == n_queries
    else:
        assert isinstance(body["error"], str) and body["error"]
    return body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
near_requests = st.fixed_dictionaries(
    {},
    optional={
        "queries": st.lists(st.text(max_size=80), max_size=10) | json_values,
        "query": st.text(max_size=80) | json_values,
        "topk": st.integers(min_value=-3, max_value=10) | st.integers() | json_values,
        "return_scores": st.booleans() | json_values,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=near_requests | json_values)
def test_any_json_body_gets_json_answer(server: BackgroundServer, payload: Any) -> None:
    status, ctype, raw = post_raw(server.url, json.dumps(payload).encode())
    body = assert_well_formed(status, ctype, raw)
    valid = (
        isinstance(payload, dict)
        and ("queries" in payload) != ("query" in payload)
        and isinstance(q := payload.get("queries", [payload.get("query")]), list)
        and all(isinstance(x, str) and len(x) <= LIMITS["max_query_chars"] for x in q)
        and len(q) <= LIMITS["max_queries"]
        and (payload.get("topk") is None or (type(payload["topk"]) is int and 1 <= payload["topk"] <= 5))
        and isinstance(payload.get("return_scores", False), bool)
    )
    assert (status == 200) == valid, (payload, status, body)
    if valid:
        assert len(body["result"]) == len(q)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_any_bytes_get_json_answer(server: BackgroundServer, raw: bytes) -> None:
    assert_well_formed(*post_raw(server.url, raw))


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b'{"queries": ["river"], "topk": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, 413, "exceeds"),
        (b'{"queries": ["river \\ud800 x"]}', 400, "lone surrogate"),
        (b'{"queries": ["river"], "topk": 1e999}', 400, "integer"),
        (b'{"queries": ["river"], "topk": NaN}', 400, "integer"),
        (b'{"query": null}', 400, "list of strings"),
        (b"\xff\xfe{", 400, "not valid JSON"),
    ],
)
def test_named_hostile_bodies(server: BackgroundServer, body: bytes, status: int, words: str) -> None:
    got, ctype, raw = post_raw(server.url, body)
    assert got == status and words in assert_well_formed(got, ctype, raw)["error"]


def test_deep_nesting_within_the_size_limit_is_a_400(index_dir: Path) -> None:
    with serve_in_background(index_dir, max_body_bytes=300_000) as s:
        status, ctype, raw = post_raw(s.url, b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and "nested too deeply" in assert_well_formed(status, ctype, raw)["error"]
        status, ctype, raw = post_raw(s.url, b'{"queries": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
        assert status == 400 and ctype.startswith("application/json")


def _raw_exchange(url: str, data: bytes, wait: float = 10.0) -> bytes:
    """Send ``data`` on a fresh socket and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=wait) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status_and_json(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), raw[:300]
    return int(head.split()[1]), json.loads(body)


def test_malformed_http_and_huge_content_length_get_json_4xx(server: BackgroundServer) -> None:
    status, body = _status_and_json(_raw_exchange(server.url, b"GARBAGE / NOT-HTTP\r\n\r\n"))
    assert status == 400 and "malformed HTTP" in body["error"]
    huge = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n{}"
    status, body = _status_and_json(_raw_exchange(server.url, huge))
    assert 400 <= status < 500 and body["error"]


@pytest.mark.parametrize("http", HTTP)
def test_stalled_headers_and_bodies_time_out_and_the_cap_holds(index_dir: Path, http: str) -> None:
    with serve_in_background(index_dir, http=http, header_timeout=0.5, body_timeout=0.5, max_connections=8) as s:
        t0 = time.perf_counter()
        partial = _raw_exchange(s.url, b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert 0.4 < time.perf_counter() - t0 < 5
        status, body = _status_and_json(partial)
        assert status == 408 and "headers" in body["error"]
        t0 = time.perf_counter()
        silent = _raw_exchange(s.url, b"")  # opened, nothing sent: closed without an answer
        assert silent == b"" and 0.4 < time.perf_counter() - t0 < 5
        head = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        status, body = _status_and_json(_raw_exchange(s.url, head))
        assert status == 408 and "body" in body["error"]

        idle = [socket.create_connection(("127.0.0.1", _port(s.url)), timeout=10) for _ in range(8)]
        try:
            time.sleep(0.1)
            status, body = _status_and_json(_raw_exchange(s.url, b""))  # the 9th connection: refused at once,
            # i.e. while the server still held all 8 stalled ones (it counts them when it refuses), not
            # after their header timeout dropped any: an order of events, not a wall-clock bound
            assert status == 503 and body["error"].startswith("server has 8 open connections (limit 8)")
            for sock in idle:  # the stalled ones are dropped after the header timeout
                assert sock.recv(100) == b""
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.1)
        status, _, raw = post_raw(s.url, b'{"query": "stone river"}')
        assert status == 200 and len(json.loads(raw)["result"][0]) == 3


def _read_response(sock: socket.socket) -> tuple[int, Any]:
    """One HTTP response (status, JSON body) read off a kept-alive socket."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, raw
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("http", HTTP)
def test_header_timeout_restarts_with_each_request_on_a_kept_alive_connection(index_dir: Path, http: str) -> None:
    """Idle time between requests is not header time; a stalled second request still gets its 408."""
    with serve_in_background(index_dir, http=http, header_timeout=0.5) as s:
        assert json.loads(urllib_get(s.url + "/health"))["serving"]["http"] == http
        body = b'{"query": "stone river"}'
        request = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        with socket.create_connection(("127.0.0.1", _port(s.url)), timeout=10) as sock:
            sock.sendall(request)
            status, answer = _read_response(sock)
            assert status == 200 and len(answer["result"][0]) == 3
            time.sleep(1.0)  # twice the header timeout, idle: the connection stays open (keep-alive is 5 s)
            sock.sendall(request)
            assert _read_response(sock)[0] == 200
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le")
            t0 = time.perf_counter()
            status, answer = _read_response(sock)
            assert status == 408 and "headers" in answer["error"] and 0.3 < time.perf_counter() - t0 < 5


def urllib_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def test_unknown_http_parser_is_refused(index_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown HTTP implementation 'uvloop'"):
        serve_in_background(index_dir, http="uvloop")


def test_keep_alive_connection_serves_several_requests(server: BackgroundServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", _port(server.url), timeout=10)
    try:
        for i in range(5):
            conn.request("POST", "/retrieve", body=json.dumps({"query": f"token{i}"}).encode())
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["result"][0][0]["id"] == str(i)
    finally:
        conn.close()


class _CountingSearcher:
    """The real searcher; records how many searches run at the same time."""

    def __init__(self, inner: IndexSearcher) -> None:
        self.inner, self.manifest, self.num_docs = inner, inner.manifest, inner.num_docs
        self.live = self.peak = 0
        self.lock = threading.Lock()

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        with self.lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
        try:
            time.sleep(0.02)
            return self.inner.search(queries, topk)
        finally:
            with self.lock:
                self.live -= 1


def test_worker_pool_bounds_concurrent_searches(index_dir: Path) -> None:
    searcher = _CountingSearcher(load_searcher(index_dir))
    with serve_in_background(searcher, workers=2) as s:
        results: list[tuple[int, str]] = []

        def one(i: int) -> None:
            status, _, raw = post_raw(s.url, json.dumps({"query": f"token{i}"}).encode())
            results.append((status, json.loads(raw)["result"][0][0]["id"]))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(results, key=lambda r: int(r[1])) == [(200, str(i)) for i in range(32)]
    assert searcher.peak == 2


def test_bad_limits_are_refused(index_dir: Path) -> None:
    with pytest.raises(ValueError, match="header_timeout=0"):
        serve_in_background(index_dir, header_timeout=0)
    with pytest.raises(ValueError, match="max_connections=0"):
        serve_in_background(index_dir, max_connections=0)
