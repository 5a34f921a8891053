"""BM25 at wiki-18 scale on one machine: build, serve memory-mapped, benchmark, at several corpus sizes.

For each size N (default 250k, 1M, 4M passages) it
1. writes a synthetic wiki-18-like corpus in bounded memory (~100-word passages, Zipf(1)
   vocabulary of 200k pseudo-words led by English stopwords; as scripts/bench/retrieval.py),
2. builds the BM25 index in a subprocess (``python -m sorl_verl.retrieval.build --memory-mb``):
   wall and CPU time, peak RSS (``wait4``), index size on disk,
3. serves it memory-mapped (``--mmap``, default worker pool) in a subprocess: start time, RSS
   (total and anonymous, i.e. excluding page cache of the mapped index),
4. measures queries/s at batch 1/16/256 and p50/p99 at batch 16 over HTTP,
5. sends 64-way bursts of single-query requests: peak RSS growth and answers equal to the
   same queries sent as one batch,
6. for N <= ``--bm25s-max``, bm25s (in-memory) on the same corpus and queries: build time, peak
   RSS and queries/s at batch 256, in a subprocess killed if it passes ``--rss-limit-gb``.

Every subprocess is watched and killed if its RSS passes ``--rss-limit-gb`` (default 8).
Results are appended to ``--json-out`` after each size (partial runs keep what finished).
Run it at low priority on a shared machine:

    nice -n 19 python scripts/bench/retrieval_scale.py --workdir /tmp/rscale --json-out scale.json
    nice -n 19 python scripts/bench/retrieval_scale.py --sizes 10000000 --workdir /tmp/rscale ...
    # in-process scorer CPU per query on indexes kept there (--keep), top-3 checked against a saved run
    nice -n 19 python scripts/bench/retrieval_scale.py --sizes 1000000 --workdir /tmp/rscale --scoring-only \
        --topk-compare before.json --json-out scoring.json
    # the compiled kernel against the numpy MaxScore (top-3 compared), two threads pinned to the two cores
    ... --scoring-only --reuse --strategy maxscore-numpy --topk-out numpy.json --json-out s_numpy.json
    ... --scoring-only --reuse --strategy maxscore --threads 2 --pin --topk-compare numpy.json --json-out s_kernel.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retrieval import STOP_HEAD, http_load, make_queries, pseudo_words  # noqa: E402

from sorl_verl.retrieval.bm25 import STRATEGIES  # noqa: E402
from sorl_verl.retrieval.server import serve_in_background  # noqa: E402

TARGETS = {"build_rss_gb": 8.0, "serve_anon_gb": 4.0, "qps_256": 1000.0, "p99_16_ms": 100.0, "burst_mb": 100.0}


def write_corpus(path: Path, num_docs: int, vocab_size: int = 200_000, words_per_doc: int = 100, seed: int = 0) -> None:
    """Synthetic corpus in wiki-18 format, written in chunks of 100k passages (memory independent of N)."""
    rng = random.Random(seed)
    vocab = np.array(list(STOP_HEAD) + pseudo_words(vocab_size - len(STOP_HEAD), rng), dtype=object)
    cdf = np.cumsum(1.0 / np.arange(1, vocab_size + 1))
    cdf /= cdf[-1]
    nprng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for s in range(0, num_docs, 100_000):
            n = min(100_000, num_docs - s)
            lengths = nprng.integers(words_per_doc // 2, words_per_doc * 3 // 2 + 1, size=n)
            ids = np.searchsorted(cdf, nprng.random(int(lengths.sum())), side="right").clip(0, vocab_size - 1)
            words_all, start, lines = vocab[ids], 0, []
            for d in range(n):
                words = words_all[start : start + lengths[d]]
                start += lengths[d]
                title = f"{words[-1].capitalize()} {words[-2].capitalize()}"
                lines.append(json.dumps({"id": str(s + d), "contents": f'"{title}"\n{" ".join(words)}'}))
            f.write("\n".join(lines) + "\n")


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) / 1024
    return out


def _tree_rss_mb(pid: int) -> float:
    """RSS of a process and its children (MiB); 0 once it is gone."""
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        total = proc_status(pid).get("VmRSS", 0.0)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return total + sum(_tree_rss_mb(int(c)) for c in children)


def run_watched(cmd: list[str], limit_gb: float, log: Path) -> dict[str, Any]:
    """Run ``cmd``; kill it if its RSS (with children) passes ``limit_gb``. Wall, CPU, peak RSS via wait4."""
    t0 = time.perf_counter()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    killed = {"rss_mb": 0.0}
    done = threading.Event()

    def watch() -> None:  # never polls the child: wait4 below must be the one that reaps it
        while not done.wait(0.5):
            rss = _tree_rss_mb(proc.pid)
            killed["peak_tree_mb"] = max(killed.get("peak_tree_mb", 0.0), rss)
            if rss > limit_gb * 1024:
                killed["rss_mb"] = rss
                os.kill(proc.pid, 9)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    watcher.join(2)
    return {
        "rc": proc.returncode, "wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024, "peak_tree_rss_mb": killed.get("peak_tree_mb", 0.0),
        "killed_at_rss_mb": killed["rss_mb"] or None,
    }  # fmt: skip


async def burst(url: str, queries: list[str], pid: int, rounds: int = 5, width: int = 64) -> dict[str, Any]:
    """64 single-query requests at once, ``rounds`` times: peak RSS growth, answers equal to one batched request."""
    before = proc_status(pid)
    peak = {"VmRSS": before["VmRSS"], "RssAnon": before["RssAnon"]}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = proc_status(pid)
            for k in peak:
                peak[k] = max(peak[k], now[k])
            time.sleep(0.01)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=width)) as s:
        async with s.post(f"{url}/retrieve", json={"queries": queries[:width], "topk": 3}) as r:
            expected = [[d["id"] for d in row] for row in (await r.json())["result"]]

        async def one(q: str) -> list[str]:
            async with s.post(f"{url}/retrieve", json={"queries": [q], "topk": 3}) as r:
                assert r.status == 200
                return [d["id"] for d in (await r.json())["result"][0]]

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wrong = 0
        try:
            for i in range(rounds):
                qs = queries[:width] if i == 0 else queries[i * width : (i + 1) * width]
                got = await asyncio.gather(*(one(q) for q in qs))
                if i == 0:
                    wrong += sum(g != e for g, e in zip(got, expected, strict=True))
        finally:
            stop.set()
            sampler.join()
    return {"rss_before_mb": before["VmRSS"], "anon_before_mb": before["RssAnon"],
            "rss_growth_mb": peak["VmRSS"] - before["VmRSS"], "anon_growth_mb": peak["RssAnon"] - before["RssAnon"],
            "wrong_answers": wrong, "requests": rounds * width}  # fmt: skip


BM25S_SCRIPT = """
import json, sys, time, resource
import bm25s, Stemmer, numpy as np
corpus, queries_path, n_q = sys.argv[1], sys.argv[2], int(sys.argv[3])
texts = [json.loads(line)["contents"] for line in open(corpus, encoding="utf-8")]
t0 = time.perf_counter()
stem = Stemmer.Stemmer("english")
model = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
model.index(bm25s.tokenize(texts, stopwords="en", stemmer=stem, show_progress=False), show_progress=False)
build = time.perf_counter() - t0
del texts
queries = json.load(open(queries_path))[:n_q]
t0 = time.perf_counter()
tok = bm25s.tokenize(queries, stopwords="en", stemmer=stem, show_progress=False, return_ids=False)
docs, scores = model.retrieve(tok, k=3, show_progress=False, n_threads=1)
qps = len(queries) / (time.perf_counter() - t0)
print(json.dumps({"build_s": build, "qps_256": qps, "queries": len(queries), "top": docs.tolist()}))
"""


def bench_bm25s(corpus: Path, queries: list[str], work: Path, limit_gb: float) -> dict[str, Any]:
    qpath = work / "queries.json"
    qpath.write_text(json.dumps(queries[:1024]))
    out = run_watched(
        [sys.executable, "-c", BM25S_SCRIPT, str(corpus), str(qpath), "1024"], limit_gb, work / "bm25s.log"
    )
    res = {k: out[k] for k in ("rc", "wall_s", "cpu_s", "peak_rss_mb", "killed_at_rss_mb")}
    lines = (work / "bm25s.log").read_text().strip().splitlines()
    if out["rc"] == 0 and lines:
        res.update(json.loads(lines[-1]))
    return res


def _disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def bench_size(n: int, a: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    work = Path(a.workdir) / f"n{n}"
    work.mkdir(parents=True, exist_ok=True)
    corpus, index = work / "corpus.jsonl", work / "index"
    res: dict[str, Any] = {"num_docs": n, "loadavg_start": os.getloadavg()}
    if not (a.reuse and (index / "manifest.json").is_file()):
        t0 = time.perf_counter()
        write_corpus(corpus, n, a.vocab)
        res["corpus_gen_s"], res["corpus_mb"] = time.perf_counter() - t0, corpus.stat().st_size / 2**20
        log(f"[{n:,}] corpus {res['corpus_mb']:.0f} MiB in {res['corpus_gen_s']:.0f} s")
        shutil.rmtree(index, ignore_errors=True)
        cmd = [sys.executable, "-m", "sorl_verl.retrieval.build", "--corpus", str(corpus), "--out", str(index),
               "--no-progress", "--memory-mb", str(a.build_memory_mb)]  # fmt: skip
        res["build"] = run_watched(cmd, a.rss_limit_gb, work / "build.log")
        if res["build"]["rc"] != 0:
            log(f"[{n:,}] build failed: {res['build']} (see {work / 'build.log'})")
            return res
        res["index_mb"] = _disk_mb(index)
        res["postings_mb"] = (
            sum((index / f).stat().st_size for f in ("data.csc.index.npy", "indices.csc.index.npy")) / 2**20
        )
        log(f"[{n:,}] build {res['build']['wall_s']:.0f} s wall, {res['build']['cpu_s']:.0f} s CPU, "
            f"peak RSS {res['build']['peak_rss_mb']:.0f} MiB, index {res['index_mb']:.0f} MiB")  # fmt: skip
    queries = make_queries(index, 8192, 0)
    t0 = time.perf_counter()
    with serve_in_background(
        index, subprocess_mode=True, mmap=True, max_queries=4096, startup_timeout=600, threads=a.threads
    ) as srv:
        res["serve_start_s"] = time.perf_counter() - t0
        res["serve_rss_start_mb"] = proc_status(srv.pid)
        runs = [(1, 1, 600), (16, 1, 200), (256, 1, 24)]
        res["http"] = [asyncio.run(http_load(srv.url, queries, b, k, f, 3, srv.pid)) for b, f, k in runs]
        res["burst"] = asyncio.run(burst(srv.url, queries, srv.pid))
        res["serve_rss_end_mb"] = proc_status(srv.pid)
    log(f"[{n:,}] serve start {res['serve_start_s']:.1f} s; " + "; ".join(
        f"batch {r['batch']}: {r['qps']:.0f} q/s p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} ms" for r in res["http"]
    ) + f"; burst {res['burst']}")  # fmt: skip
    if a.compare_workers:  # the same burst against a server with many search threads (as before the bounded pool)
        with serve_in_background(index, subprocess_mode=True, mmap=True, workers=a.compare_workers) as srv:
            res["burst_many_workers"] = {"workers": a.compare_workers, **asyncio.run(burst(srv.url, queries, srv.pid))}
        log(f"[{n:,}] burst with {a.compare_workers} workers: {res['burst_many_workers']}")
    if n <= a.bm25s_max:
        res["bm25s"] = bench_bm25s(corpus, queries, work, a.rss_limit_gb)
        top = res["bm25s"].pop("top", None)
        if top:
            from sorl_verl.retrieval.index import load_searcher

            ours = load_searcher(index, mmap=True).search_ids(queries[: len(top)], 3)
            res["bm25s"]["top3_overlap"] = float(
                np.mean([len(set(t) & {p for p, _ in o}) / 3 for t, o in zip(top, ours, strict=True)])
            )
        log(f"[{n:,}] bm25s: {res['bm25s']}")
    res["loadavg_end"] = os.getloadavg()
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return res


def pinned_topk(scorer: Any, queries: list[str], n_threads: int, k: int = 3) -> list[Any]:
    """``scorer.topk_ids(queries, k)`` split over ``n_threads`` Python threads, thread ``i`` pinned to core ``i``."""
    cores = sorted(os.sched_getaffinity(0))
    parts = [queries[i * len(queries) // n_threads : (i + 1) * len(queries) // n_threads] for i in range(n_threads)]
    out: list[Any] = [None] * n_threads

    def work(i: int) -> None:
        os.sched_setaffinity(0, {cores[i % len(cores)]})  # this thread only
        out[i] = scorer.topk_ids(parts[i], k)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [row for part in out for row in part]


def scoring_only(n: int, a: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """In-process BM25 scoring of ``--queries`` queries on the index already in --workdir: CPU ms per query.

    The scorer runs the queries ``--reps`` times (the first run warms the page cache and the
    k-th-score cache; every run is reported). ``--topk-out`` saves the top-k (document, score)
    rows; ``--topk-compare`` checks them against a saved file: identical ids and float scores.
    ``--strategy`` picks the BM25 scorer (``maxscore``: compiled where numba is installed;
    ``maxscore-numpy``; ``matmul``) and ``--threads`` how many threads split each batch; CPU
    time is the whole process's (every thread), so CPU ms per query is comparable across them.
    ``--pin``: the threads are instead ``--threads`` Python threads, thread ``i`` pinned to core
    ``i`` (Linux), each scoring its contiguous share of the batch with a one-thread scorer.
    """
    from sorl_verl.retrieval.bm25 import BM25Scorer
    from sorl_verl.retrieval.index import read_manifest

    index = Path(a.workdir) / f"n{n}" / "index"
    queries = make_queries(index, a.queries, 0)
    t0 = time.perf_counter()
    params = read_manifest(index)["params"]
    scorer = BM25Scorer(index, params, n_threads=1 if a.pin else a.threads, mmap=True, strategy=a.strategy)
    load_s = time.perf_counter() - t0
    log(f"[{n:,}] {a.strategy} scorer (compiled: {scorer.compiled}, threads {a.threads}) loaded in {load_s:.1f} s")
    runs = []
    for _ in range(a.reps):
        c0, t0 = time.process_time(), time.perf_counter()
        rows = pinned_topk(scorer, queries, a.threads) if a.pin else scorer.topk_ids(queries, 3)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        runs.append({"cpu_ms_per_query": 1000 * cpu / len(queries), "wall_ms_per_query": 1000 * wall / len(queries)})
        log(f"[{n:,}] scoring {len(queries)} queries: {runs[-1]}")
    res: dict[str, Any] = {"num_docs": n, "queries": len(queries), "strategy": a.strategy, "compiled": scorer.compiled,
                           "threads": a.threads, "pinned": a.pin, "load_s": load_s, "runs": runs,
                           "loadavg": os.getloadavg()}  # fmt: skip
    if a.topk_out:
        Path(a.topk_out).write_text(json.dumps(rows))
    if a.topk_compare:
        expected = [[tuple(h) for h in row] for row in json.loads(Path(a.topk_compare).read_text())]
        res["differing_queries"] = sum(x != y for x, y in zip(rows, expected, strict=True))
        log(f"[{n:,}] top-3 differs from {a.topk_compare} on {res['differing_queries']} of {len(rows)} queries")
    return res


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| passages | build wall s | build CPU s | build peak RSS MiB | index MiB | serve start s | serve RSS / anon MiB "
            "| q/s b1 | q/s b16 | q/s b256 | p50/p99 b16 ms | 64-burst RSS growth MiB (anon) | wrong |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        if "http" not in r:
            rows.append(f"| {r['num_docs']:,} | build failed: {r.get('build')} |")
            continue
        b, h, s = r.get("build", {}), {x["batch"]: x for x in r["http"]}, r["serve_rss_end_mb"]
        rows.append(
            f"| {r['num_docs']:,} | {b.get('wall_s', float('nan')):.0f} | {b.get('cpu_s', float('nan')):.0f} | "
            f"{b.get('peak_rss_mb', float('nan')):.0f} | {r.get('index_mb', float('nan')):.0f} | {r['serve_start_s']:.1f} | "
            f"{s['VmRSS']:.0f} / {s['RssAnon']:.0f} | {h[1]['qps']:.0f} | {h[16]['qps']:.0f} | {h[256]['qps']:.0f} | "
            f"{h[16]['p50_ms']:.1f} / {h[16]['p99_ms']:.1f} | {r['burst']['rss_growth_mb']:.0f} ({r['burst']['anon_growth_mb']:.0f}) | "
            f"{r['burst']['wrong_answers']} |"
        )  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="250000,1000000,4000000", help="comma-separated corpus sizes")
    ap.add_argument("--workdir", required=True, help="corpora and indexes go here (removed per size unless --keep)")
    ap.add_argument("--json-out", required=True, help="results, rewritten after each size")
    ap.add_argument("--vocab", type=int, default=200_000)
    ap.add_argument("--build-memory-mb", type=float, default=1024)
    ap.add_argument("--rss-limit-gb", type=float, default=8.0)
    ap.add_argument("--bm25s-max", type=int, default=1_000_000, help="largest size to run bm25s on")
    ap.add_argument(
        "--compare-workers", type=int, default=40, help="also burst a server with this many workers (0: skip)"
    )
    ap.add_argument("--threads", type=int, default=1, help="server --threads (BM25 scoring threads per batch)")
    ap.add_argument("--scoring-only", action="store_true",
                    help="only in-process scorer CPU per query on the index already in --workdir (see scoring_only)")  # fmt: skip
    ap.add_argument("--queries", type=int, default=2048, help="--scoring-only: number of queries")
    ap.add_argument("--strategy", default="maxscore", choices=STRATEGIES, help="--scoring-only: BM25 scorer")
    ap.add_argument("--reps", type=int, default=2, help="--scoring-only: runs over the queries")
    ap.add_argument("--pin", action="store_true", help="--scoring-only: --threads pinned Python threads")
    ap.add_argument("--topk-out", help="--scoring-only: save the top-3 rows (JSON)")
    ap.add_argument("--topk-compare", help="--scoring-only: compare the top-3 rows with a saved file")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="reuse an index already built in --workdir")
    a = ap.parse_args()
    out = Path(a.json_out)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    if a.scoring_only:
        scoring = [scoring_only(int(x), a, log) for x in a.sizes.split(",")]
        out.write_text(json.dumps({"meta": {"cpus": os.cpu_count(), "nice": os.nice(0)}, "scoring": scoring}, indent=1))
        return
    results = json.loads(out.read_text())["results"] if out.is_file() else []
    for n in (int(x) for x in a.sizes.split(",")):
        res = bench_size(n, a, log)
        results = [r for r in results if r["num_docs"] != n] + [res]
        results.sort(key=lambda r: r["num_docs"])
        meta = {"cpus": os.cpu_count(), "nice": os.nice(0), "rss_limit_gb": a.rss_limit_gb, "targets": TARGETS,
                "build_memory_mb": a.build_memory_mb, "vocab": a.vocab, "threads": a.threads}  # fmt: skip
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
