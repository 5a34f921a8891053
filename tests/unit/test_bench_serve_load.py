"""Pure helpers of the serving benchmarks' load generation (scripts/bench/serve_load.py): CPU lists, wrk I/O."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "serve_load.py"
_spec = importlib.util.spec_from_file_location("serve_load", _PATH)
assert _spec is not None and _spec.loader is not None
serve_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_load)

# Real stdout of `wrk -t1 -c8 -d2s -s <lua_script(...)>` against the dense retrieval server (wrk 4.1.0, Debian).
WRK_OK = (
    "Running 2s test @ http://127.0.0.1:44951\n  1 threads and 8 connections\n"
    "  Thread Stats   Avg      Stdev     Max   +/- Stdev\n"
    "    Latency    49.27ms   46.84ms 171.80ms   82.25%\n    Req/Sec   252.56    191.00   484.00     62.50%\n"
    "  434 requests in 2.03s, 332.52KB read\nRequests/sec:    214.29\nTransfer/sec:    164.18KB\n"
    'WRK_JSON {"requests": 434, "duration_us": 2025314, "bytes": 340500, "errors": {"connect": 0, "read": 0, '
    '"write": 0, "status": 0, "timeout": 0}, "p50_us": 21849, "p99_us": 171770, "mean_us": 49272.5, "max_us": 171802}\n'
)
# ... and with a body the server rejects (`{"topk": 3}`: no query -> 4xx).
WRK_BAD_STATUS = (
    "Running 1s test @ http://127.0.0.1:37475\n  1 threads and 4 connections\n"
    "  Thread Stats   Avg      Stdev     Max   +/- Stdev\n"
    "    Latency     3.06ms    2.94ms  30.12ms   93.31%\n    Req/Sec     1.52k   432.57     1.90k    80.00%\n"
    "  1512 requests in 1.00s, 320.54KB read\n  Non-2xx or 3xx responses: 1512\n"
    "Requests/sec:   1509.84\nTransfer/sec:    320.09KB\n"
    'WRK_JSON {"requests": 1512, "duration_us": 1001432, "bytes": 328238, "errors": {"connect": 0, "read": 0, '
    '"write": 0, "status": 1512, "timeout": 0}, "p50_us": 2194, "p99_us": 18556, "mean_us": 3059.2, "max_us": 30118}\n'
)


def test_parse_wrk_output_reads_the_json_summary():
    s = serve_load.parse_wrk_output(WRK_OK)
    assert s["requests"] == 434
    assert s["qps"] == pytest.approx(434 / 2.025314)
    assert s["qps"] == pytest.approx(214.29, rel=1e-3)  # agrees with wrk's own Requests/sec line
    assert (s["p50_ms"], s["p99_ms"]) == (pytest.approx(21.849), pytest.approx(171.77))
    assert not any(s["errors"].values())


def test_parse_wrk_output_keeps_status_errors_and_rejects_missing_summary():
    assert serve_load.parse_wrk_output(WRK_BAD_STATUS)["errors"]["status"] == 1512
    with pytest.raises(ValueError, match="WRK_JSON"):
        serve_load.parse_wrk_output(WRK_OK.split("WRK_JSON")[0])


def test_lua_script_embeds_escaped_bodies_and_the_summary_tag():
    bodies = [json.dumps({"query": q, "topk": 3}) for q in ("alpha beta", 'say "hi"\\ there')]
    lua = serve_load.lua_script(bodies)
    assert '"{\\"query\\": \\"alpha beta\\", \\"topk\\": 3}"' in lua
    assert '\\"say \\\\\\"hi\\\\\\"\\\\\\\\ there\\"' in lua  # JSON's \" and \\ escaped once more for Lua
    assert 'wrk.format(nil, "/retrieve", nil, bodies[i])' in lua
    assert serve_load.WRK_TAG in lua and "%%" not in lua
    with pytest.raises(ValueError):
        serve_load.lua_script([])


def test_parse_cpus():
    assert serve_load.parse_cpus(None) is None and serve_load.parse_cpus("") is None
    assert serve_load.parse_cpus("1") == {1}
    assert serve_load.parse_cpus("0,2-4, 7") == {0, 2, 3, 4, 7}
    for bad in ("a", "3-1", "1-", "-2", "1;2"):
        with pytest.raises(ValueError):
            serve_load.parse_cpus(bad)


def test_spawn_affinity_restores_and_task_affinity_sees_this_process():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    with serve_load.spawn_affinity(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before
    with serve_load.spawn_affinity(None):
        assert os.sched_getaffinity(0) == before
    seen = serve_load.task_affinity(os.getpid())
    assert seen["threads"] >= 1 and seen["cpus_allowed"]


def test_run_wrk_without_wrk_says_so(monkeypatch):
    monkeypatch.setattr(serve_load, "wrk_path", lambda: None)
    with pytest.raises(FileNotFoundError, match="apt-get install wrk"):
        serve_load.run_wrk("http://127.0.0.1:9", ['{"query": "a"}'], 1, 1)


def test_cpu_simd_lists_the_known_flags_in_order():
    info = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx512_vnni fma avx2 avx512f avx512bw\n"
    assert serve_load.cpu_simd(info) == ["avx2", "fma", "avx512f", "avx512_vnni"]
    assert serve_load.cpu_simd("flags\t: fpu sse2 avx\n") == []
    assert serve_load.cpu_simd("model name\t: no flags line\n") == []
    assert set(serve_load.cpu_simd()) <= set(serve_load.SIMD_FLAGS)


def test_wait_idle_returns_once_cpu_stops_growing_and_times_out_when_it_does_not():
    readings = iter([0.0, 0.3, 0.6, 0.6002])  # busy, busy, then idle (< 5% of the interval)
    assert serve_load.wait_idle(lambda: next(readings), interval=0.01) >= 0.02
    busy = iter(float(i) for i in range(10_000))
    with pytest.raises(TimeoutError, match="still busy"):
        serve_load.wait_idle(lambda: next(busy), interval=0.01, timeout=0.05)
