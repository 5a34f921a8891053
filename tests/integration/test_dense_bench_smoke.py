"""The dense serving benchmark's pinned path still runs (tiny corpus; timings not asserted).

Servers pinned to one CPU and the client to one CPU, ``--load-generator wrk`` with wrk hidden
from PATH: the benchmark says it falls back to the Python client and records the pinning and
the client's CPU share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.slow  # four server processes start, each loading torch: ~30-60 s on 2 cores

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "dense_retrieval.py"


def test_pinned_serving_falls_back_to_python_client_without_wrk(tmp_path):
    cpu = str(min(os.sched_getaffinity(0)))
    out = tmp_path / "out.json"
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no wrk here
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path / "w"), "--reuse", "--serve-only",
         "--num-docs", "300", "--clients", "4", "--per-client", "1", "--repeats", "1",
         "--server-cpus", cpu, "--client-cpus", cpu, "--load-generator", "wrk", "--json-out", str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "wrk is not installed" in result.stdout
    res = json.loads(out.read_text())
    assert res["load_generators"] == ["python"] and "load_generator_fallback" in res
    assert res["server_cpus"] == [int(cpu)] and res["client_cpus"] == [int(cpu)]
    assert set(res["library_default_threads_on_server_cpus"]) == {"torch", "faiss"}
    assert len(res["http"]) == 4
    assert [row["http"] for row in res["http"]] == ["httptools", "httptools", "h11", "h11"]
    for row in res["http"]:
        assert row["load_generator"] == "python" and row["requests"] in (4, 40)  # batched: 10x per client
        assert row["server_affinity"]["cpus_allowed"] == [cpu]
        assert row["client_cpu_share"] >= 0 and row["server_cpu_ms_per_request"] > 0
    by = {r["server"]: r for r in res["summary"]}
    assert "batched_qps_ratio" in by["flat unbatched, default threads, h11 (as before)"]
