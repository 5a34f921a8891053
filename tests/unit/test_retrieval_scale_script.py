"""The committed BM25 scaling command (scripts/bench/retrieval_scale.py) runs end to end, as users run it.

A 3,000-passage corpus goes through every step of the command that produced the wiki-18 figures
in docs/retrieval.md: corpus, bounded-memory build in a subprocess, memory-mapped server in a
subprocess, HTTP load at batch 1/16/256, 64-way bursts checked against one batched request, and
bm25s on the same corpus; then the in-process ``--scoring-only`` mode saves the numpy scorer's top 3
and checks the compiled kernel's (two pinned threads) against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "retrieval_scale.py"
N = 3000


def run(*args: str, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    d = tmp_path_factory.mktemp("rscale")
    out = run(
        "--sizes", str(N), "--vocab", "3000", "--workdir", str(d / "work"), "--json-out", str(d / "scale.json"),
        "--bm25s-max", str(N), "--compare-workers", "0", "--threads", "2", "--keep", cwd=d,
    )  # fmt: skip
    return d, json.loads((d / "scale.json").read_text()), out


def test_scaling_command_measures_every_figure(scaled: tuple[Path, dict, str]) -> None:
    _, result, stdout = scaled
    assert result["meta"]["threads"] == 2 and result["meta"]["targets"]["qps_256"] == 1000.0
    (r,) = result["results"]
    assert r["num_docs"] == N
    build = r["build"]
    assert build["wall_s"] > 0 and build["cpu_s"] > 0 and build["peak_rss_mb"] > 0 and r["index_mb"] > 0
    assert r["serve_start_s"] > 0 and 0 < r["serve_rss_end_mb"]["RssAnon"] <= r["serve_rss_end_mb"]["VmRSS"]
    assert [h["batch"] for h in r["http"]] == [1, 16, 256]
    for h in r["http"]:
        assert h["qps"] > 0 and 0 < h["p50_ms"] <= h["p99_ms"] and h["server_cpu_ms_per_query"] >= 0
    assert r["burst"]["requests"] == 5 * 64 and r["burst"]["wrong_answers"] == 0
    bm25s = r["bm25s"]
    assert bm25s["rc"] == 0 and bm25s["queries"] == 1024 and bm25s["qps_256"] > 0
    # the same analysis and lucene scores: the top 3 differ only where ties at the third place are ordered otherwise
    assert bm25s["top3_overlap"] >= 0.9
    assert f"| {N:,} |" in stdout


def test_scoring_only_kernel_top3_equals_numpy(scaled: tuple[Path, dict, str]) -> None:
    d = scaled[0]
    common = ("--sizes", str(N), "--workdir", str(d / "work"), "--scoring-only", "--reuse", "--reps", "1")
    run(*common, "--strategy", "maxscore-numpy", "--topk-out", "top.json", "--json-out", "numpy.json", cwd=d)
    for extra in ((), ("--threads", "2", "--pin")):
        run(*common, *extra, "--topk-compare", "top.json", "--json-out", "kernel.json", cwd=d)
        (s,) = json.loads((d / "kernel.json").read_text())["scoring"]
        assert s["strategy"] == "maxscore" and s["queries"] == 2048 and s["runs"][0]["cpu_ms_per_query"] > 0
        assert s["differing_queries"] == 0
    (s,) = json.loads((d / "numpy.json").read_text())["scoring"]
    assert s["strategy"] == "maxscore-numpy" and not s["compiled"]
    assert len(json.loads((d / "top.json").read_text())) == 2048
