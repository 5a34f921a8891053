"""Dense retrieval benchmark with the project's tiny local encoder: batched vs unbatched serving, faiss index types.

1. A synthetic corpus of N passages (default 200,000; 20-40 words from a Zipf(1) vocabulary of
   20k pseudo-words) and the tiny encoder over that vocabulary (``tiny_encoder.py``: random
   1-layer BERT, ``--hidden`` wide, mean pooling; untrained, so it measures plumbing and
   throughput, not retrieval quality).
2. The flat index (``build_index(method="dense")``), then hnsw and ivfpq indexes built from the
   same vectors; recall@3 of each against flat on 2,048 queries, index bytes, and in-process
   search time per query at batch 64.
3. The HTTP server in its own process, 64 concurrent clients each sending single-query requests
   in a closed loop: queries/s and p50/p99 latency without batching (``--batch-wait-ms 0``,
   one encoder call and one index search per request, as before) and with dynamic batching.
   Target: batched >= 10x unbatched.

    nice -n 19 python scripts/bench/dense_retrieval.py --workdir /tmp/dbench --json-out dense.json
    # serving only, on the saved flat index: unbatched / batched / unbatched with library-default
    # threads, interleaved 3 times, with the server CPU split into encoder, faiss and the rest
    nice -n 19 python scripts/bench/dense_retrieval.py --workdir /tmp/dbench --reuse --serve-only --json-out serve.json
    # the same, each server pinned to CPU 0 and the load generator to CPU 1, with the Python
    # client and with wrk (if installed; its client CPU is far lower), the client's CPU share recorded
    python scripts/bench/dense_retrieval.py --workdir /tmp/dbench --reuse --serve-only --repeats 2 \
        --server-cpus 0 --client-cpus 1 --load-generator both --json-out pinned.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retrieval import STOP_HEAD, cpu_seconds, pseudo_words  # noqa: E402
from serve_load import (  # noqa: E402
    cpu_simd,
    parse_cpus,
    pin_process,
    run_wrk,
    spawn_affinity,
    task_affinity,
    wait_idle,
    wrk_path,
)

from sorl_verl.retrieval.build import build_index  # noqa: E402
from sorl_verl.retrieval.dense import build_faiss_index, encode, load_encoder  # noqa: E402
from sorl_verl.retrieval.server import serve_in_background  # noqa: E402
from sorl_verl.retrieval.tiny_encoder import make_tiny_encoder  # noqa: E402
from sorl_verl.study.runner import cpu_name  # noqa: E402

TARGET_SPEEDUP = 10.0


def write_corpus(path: Path, n: int, vocab: list[str], seed: int) -> list[list[str]]:
    """Write the corpus; return a sample of passages' words for making queries."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, len(vocab) + 1))
    cdf /= cdf[-1]
    words = np.array(vocab, dtype=object)
    sample = []
    with open(path, "w", encoding="utf-8") as f:
        for s in range(0, n, 50_000):
            m = min(50_000, n - s)
            lengths = rng.integers(20, 41, size=m)
            ids = np.searchsorted(cdf, rng.random(int(lengths.sum())), side="right").clip(0, len(vocab) - 1)
            allw, start, lines = words[ids], 0, []
            for d in range(m):
                w = allw[start : start + lengths[d]]
                start += lengths[d]
                lines.append(json.dumps({"id": str(s + d), "contents": f'"{w[0].capitalize()}"\n{" ".join(w[1:])}'}))
                if len(sample) < 20_000 and rng.random() < 0.05:
                    sample.append(list(w))
            f.write("\n".join(lines) + "\n")
    return sample


def make_queries(sample: list[list[str]], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(sorted(set(w)), min(len(set(w)), rng.randint(2, 6)))) for w in rng.choices(sample, k=n)]


async def closed_loop(
    url: str, queries: list[str], clients: int, per_client: int, server_pid: int | None = None
) -> dict[str, Any]:
    """``clients`` coroutines, each sending ``per_client`` single-query requests one after another.

    ``client_cpu_share``: this process's CPU time (all threads) over the measured round's wall
    time (1.0 = one core busy); ``server_cpu_share``: the same for process ``server_pid``.
    """
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as s:

        async def client(c: int) -> None:
            for i in range(per_client):
                q = queries[(c * per_client + i) % len(queries)]
                t0 = time.perf_counter()
                async with s.post(f"{url}/retrieve", json={"query": q, "topk": 3}) as r:
                    body = await r.json()
                    assert r.status == 200 and len(body["result"][0]) == 3, body
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(client(c) for c in range(clients)))  # warm-up: one round
        lat.clear()
        srv0 = cpu_seconds(server_pid) if server_pid else 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
        srv = cpu_seconds(server_pid) - srv0 if server_pid else float("nan")
    ms = np.array(lat) * 1000
    return {"clients": clients, "requests": len(lat), "qps": len(lat) / wall, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "wall_s": wall, "client_cpu_s": client_cpu,
            "client_cpu_share": client_cpu / wall, "server_cpu_share": srv / wall, "load_generator": "python"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-docs", type=int, default=200_000)
    ap.add_argument("--hidden", type=int, default=64, help="tiny encoder width (= embedding dimension)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=12, help="requests per client, unbatched run")
    ap.add_argument("--batch-wait-ms", type=float, default=2.0)
    ap.add_argument("--dense-threads", type=int, default=1,
                    help="torch/faiss threads per search, here and in the servers (1: a shared, busy CPU)")  # fmt: skip
    ap.add_argument("--workdir", help="keep corpus, model and indexes here (default: a temporary directory)")
    ap.add_argument("--json-out")
    ap.add_argument("--reuse", action="store_true", help="reuse corpus, model and flat index already in --workdir")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only recall@3 vs flat of the hnsw/ivfpq indexes saved in --workdir, over ef_search/nprobe")  # fmt: skip
    ap.add_argument("--serve-only", action="store_true",
                    help="with --reuse: only the serving comparison, the three servers interleaved --repeats times")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the interleaved serving comparison")
    ap.add_argument("--server-cpus", help="pin every server process to these CPUs (e.g. 0, 0-1); default: not pinned")
    ap.add_argument("--client-cpus",
                    help="pin this process (the Python client, and wrk) to these CPUs (e.g. 1); default: not pinned")  # fmt: skip
    ap.add_argument("--load-generator", choices=("python", "wrk", "both"), default="python",
                    help="python: aiohttp coroutines in this process; wrk: the wrk program (one thread, "
                         "--clients connections, closed loop; falls back to python when wrk is not installed)")  # fmt: skip
    ap.add_argument("--wrk-seconds", type=float, default=10.0, help="measured seconds per wrk run")
    ap.add_argument("--wrk-warmup-seconds", type=float, default=3.0, help="wrk warm-up seconds before each run")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    server_cpus, client_cpus = parse_cpus(a.server_cpus), parse_cpus(a.client_cpus)
    if client_cpus is not None and server_cpus is None:  # servers keep the CPUs this process had
        server_cpus = os.sched_getaffinity(0)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="sorl-dense-"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"num_docs": a.num_docs, "hidden": a.hidden, "cpus": os.cpu_count(),
                           "cpu_model": cpu_name(), "cpu_simd": cpu_simd(), "loadavg_start": os.getloadavg()}  # fmt: skip

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    loads = ["python", "wrk"] if a.load_generator == "both" else [a.load_generator]
    if "wrk" in loads and wrk_path() is None:
        log("wrk is not installed (Debian/Ubuntu: apt-get install wrk): using the Python client only")
        res["load_generator_fallback"] = "wrk not installed; python client used"
        loads = ["python"]
    res["load_generators"] = loads
    if server_cpus is not None or client_cpus is not None:
        res["server_cpus"] = sorted(server_cpus) if server_cpus else None
        res["client_cpus"] = sorted(client_cpus) if client_cpus else None
        res["library_default_threads_on_server_cpus"] = _default_threads(server_cpus)
        log(f"server CPUs {res['server_cpus']}, client CPUs {res['client_cpus']}; torch/faiss default threads "
            f"there: {res['library_default_threads_on_server_cpus']}")  # fmt: skip
    if client_cpus is not None:
        pin_process(client_cpus)

    import faiss
    import torch

    faiss.omp_set_num_threads(a.dense_threads)
    torch.set_num_threads(a.dense_threads)
    res["dense_threads"] = a.dense_threads
    try:
        vocab = list(STOP_HEAD) + pseudo_words(20_000 - len(STOP_HEAD), random.Random(a.seed))
        flat_dir, model = work / "flat", work / "model" / "st"
        if a.reuse and (flat_dir / "manifest.json").is_file():
            sample = [line.split("\n", 1)[1].split() for line in sample_contents(work / "corpus.jsonl")]
        else:
            sample = write_corpus(work / "corpus.jsonl", a.num_docs, vocab, a.seed)
            model = make_tiny_encoder(work / "model", vocab, hidden=a.hidden, max_seq_length=48)
            t0 = time.perf_counter()
            flat_dir = build_index(work / "corpus.jsonl", flat_dir, method="dense", model=str(model),
                                   device="cpu", batch_size=256, overwrite=True, show_progress=False)  # fmt: skip
            res["encode_build_s"] = time.perf_counter() - t0
            log(f"flat index of {a.num_docs:,} x {a.hidden} built in {res['encode_build_s']:.0f} s")
        queries = make_queries(sample, 4096, a.seed)
        if a.sweep_only:
            res["sweep"] = sweep(work, flat_dir, queries[:2048])
            for row in res["sweep"]:
                log(str(row))
            if a.json_out:
                Path(a.json_out).write_text(json.dumps(res, indent=1))
            return
        res["http"] = []

        def serve(
            name: str, index_dir: Path, wait_ms: float, per_client: int, threads: int | None = a.dense_threads,
            http: str = "auto",
        ) -> None:  # fmt: skip
            for load in loads:
                r = serve_once(index_dir, queries, wait_ms, a.clients, per_client, threads, server_cpus=server_cpus,
                               load=load, wrk_seconds=a.wrk_seconds, wrk_warmup_seconds=a.wrk_warmup_seconds,
                               http=http)  # fmt: skip
                res["http"].append({"server": name, "batch_wait_ms": wait_ms, **r})
                log(f"{name} [{load}]: {r}")

        if a.serve_only:  # the four servers interleaved (A, B, C, D, A, ...): fair on a shared machine
            for _ in range(a.repeats):
                serve("flat unbatched", flat_dir, 0.0, a.per_client)
                serve("flat batched", flat_dir, a.batch_wait_ms, a.per_client * 10)
                serve("flat batched, h11", flat_dir, a.batch_wait_ms, a.per_client * 10, http="h11")
                serve(AS_BEFORE, flat_dir, 0.0, a.per_client, threads=None, http="h11")
            res["summary"] = summarize(res["http"])
            res["loadavg_end"] = os.getloadavg()
            for row in res["summary"]:
                log(str(row))
            if a.json_out:
                Path(a.json_out).write_text(json.dumps(res, indent=1))
            return
        serve("flat unbatched", flat_dir, 0.0, a.per_client)
        serve("flat batched", flat_dir, a.batch_wait_ms, a.per_client * 10)
        serve(AS_BEFORE, flat_dir, 0.0, max(1, a.per_client // 4), threads=None, http="h11")
        by = {r["server"]: r for r in res["http"] if r["load_generator"] == loads[0]}
        res["speedup"] = by["flat batched"]["qps"] / by["flat unbatched"]["qps"]
        log(f"batched / unbatched: {res['speedup']:.1f}x")
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(res, indent=1))
        flat = faiss.read_index(str(flat_dir / "dense.faiss"))
        vectors = flat.reconstruct_n(0, flat.ntotal)
        params = load_encoder_params(flat_dir)
        q = encode(load_encoder(params), queries[:2048], params["query_prefix"], 256)
        _, exact = flat.search(q, 3)
        res["indexes"] = {}
        for kind, extra in (("flat", {}), ("hnsw", {"hnsw_m": 32, "ef_search": 128}),
                            ("ivfpq", {"nlist": 1024, "pq_m": a.hidden // 4, "nprobe": 32})):  # fmt: skip
            p = {**params, "index_type": kind, "train_size": None, "nprobe": 32, "ef_search": 128, **extra}
            t0 = time.perf_counter()
            index = flat if kind == "flat" else build_faiss_index(iter(np.array_split(vectors, 20)), a.hidden, p)
            build_s = time.perf_counter() - t0
            if kind == "ivfpq":
                faiss.extract_index_ivf(index).nprobe = p["nprobe"]
            if kind == "hnsw":
                index.hnsw.efSearch = p["ef_search"]
            hits: list[float] = []
            t0 = time.perf_counter()
            for s in range(0, len(q), 64):
                _, got = index.search(q[s : s + 64], 3)
                hits += [len(set(g) & set(e)) / 3 for g, e in zip(got, exact[s : s + 64], strict=True)]
            search_ms = 1000 * (time.perf_counter() - t0) / len(q)
            path = work / f"{kind}.faiss"
            faiss.write_index(index, str(path))
            res["indexes"][kind] = {"recall_at_3_vs_flat": float(np.mean(hits)), "bytes": path.stat().st_size,
                                    "build_s": build_s, "search_ms_per_query_batch64": search_ms, **extra}  # fmt: skip
            log(f"{kind}: {res['indexes'][kind]}")
        del vectors

        ivf_dir = build_index(work / "corpus.jsonl", work / "ivfpq_index", method="dense", model=str(model),
                              device="cpu", prebuilt_index=str(work / "ivfpq.faiss"), overwrite=True,
                              show_progress=False)  # fmt: skip
        serve("ivfpq batched", ivf_dir, a.batch_wait_ms, a.per_client * 10)
        res["loadavg_end"] = os.getloadavg()
        report(res)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(res, indent=1))
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


AS_BEFORE = "flat unbatched, default threads, h11 (as before)"  # the server as it was: its only HTTP parser


def serve_once(
    index_dir: Path,
    queries: list[str],
    wait_ms: float,
    clients: int,
    per_client: int,
    threads: int | None,
    *,
    server_cpus: set[int] | None = None,
    load: str = "python",
    wrk_seconds: float = 10.0,
    wrk_warmup_seconds: float = 3.0,
    http: str = "auto",
) -> dict[str, Any]:
    """One server process, ``clients`` closed-loop single-query clients: q/s, latency, where the server CPU went.

    ``server_cpu_ms_per_request``: the server process's CPU time (all threads) per request, over
    the warm-up and measured rounds (``load="python"``) or over the measured wrk run, per query
    the server answered (``load="wrk"``); ``encode_``/``search_cpu_ms_per_request``: the searching
    thread's CPU time in the encoder and in faiss (from ``/health``; with more than one
    torch/faiss thread the other threads' share is not in these two but is in the total);
    ``other_cpu_ms_per_request``: the rest (HTTP, JSON, batching, thread hand-offs).
    ``server_cpus``: the server process (all its threads) runs on these CPUs only; ``http``: the
    server's HTTP parser (``h11`` for the server as it was, which had no other).
    """
    with contextlib.ExitStack() as stack:
        with spawn_affinity(server_cpus):  # the server process inherits the pinning at its start
            srv = stack.enter_context(serve_in_background(index_dir, subprocess_mode=True, batch_wait_ms=wait_ms,
                                      max_batch=256, startup_timeout=600, dense={"intra_op_threads": threads},
                                      http=http))  # fmt: skip
        if load == "wrk":
            bodies = [json.dumps({"query": q, "topk": 3}) for q in queries]
            req = urllib.request.Request(f"{srv.url}/retrieve", data=bodies[0].encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:  # the same answer check as the Python client's
                assert len(json.loads(resp.read())["result"][0]) == 3
            run_wrk(srv.url, bodies, clients, wrk_warmup_seconds)
            r_idle = wait_idle(lambda: cpu_seconds(srv.pid))  # the warm-up's abandoned requests are answered
            stats0, cpu0, t0 = _health_stats(srv.url), cpu_seconds(srv.pid), time.perf_counter()
            r = run_wrk(srv.url, bodies, clients, wrk_seconds)
            r["idle_wait_s"] = [r_idle, wait_idle(lambda: cpu_seconds(srv.pid))]  # in-flight ones: in CPU and queries
            cpu = cpu_seconds(srv.pid) - cpu0
            r["server_cpu_share"] = cpu / (time.perf_counter() - t0)  # over the run and the drain
            stats = {k: v - stats0.get(k, 0) for k, v in _health_stats(srv.url).items()}
            n = max(1, int(stats["queries"]))
        else:
            stats0 = _health_stats(srv.url)
            cpu0 = cpu_seconds(srv.pid)
            r = asyncio.run(closed_loop(srv.url, queries, clients, per_client, server_pid=srv.pid))
            cpu = cpu_seconds(srv.pid) - cpu0
            stats = {k: v - stats0.get(k, 0) for k, v in _health_stats(srv.url).items()}
            n = 2 * r["requests"]  # warm-up round + measured round
        r["server_affinity"] = task_affinity(srv.pid)
        r["http"] = _health(srv.url)["serving"].get("http", http)
    r["server_cpu_ms_per_request"] = 1000 * cpu / n
    r["encode_cpu_ms_per_request"] = 1000 * stats["encode_cpu_s"] / n
    r["search_cpu_ms_per_request"] = 1000 * stats["search_cpu_s"] / n
    r["other_cpu_ms_per_request"] = (
        r["server_cpu_ms_per_request"] - r["encode_cpu_ms_per_request"] - r["search_cpu_ms_per_request"]
    )
    r["mean_batch"] = stats["queries"] / max(1, stats["calls"])
    r["threads"] = threads
    r["server_cpus"] = sorted(server_cpus) if server_cpus else None
    return r


def _default_threads(cpus: set[int] | None) -> dict[str, int]:
    """torch's and faiss's default thread counts in a fresh process pinned to ``cpus`` (as a server gets them)."""
    code = "import faiss, torch; print(torch.get_num_threads(), faiss.omp_get_max_threads())"
    with spawn_affinity(cpus):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    torch_n, faiss_n = (int(x) for x in out.stdout.split()[-2:])
    return {"torch": torch_n, "faiss": faiss_n}


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return json.loads(resp.read())


def _health_stats(url: str) -> dict[str, Any]:
    return _health(url)["stats"]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server and load generator: medians over the repeats, and ratios of batched to each unbatched server."""
    out = []
    keys = ("qps", "p50_ms", "p99_ms", "server_cpu_ms_per_request", "encode_cpu_ms_per_request",
            "search_cpu_ms_per_request", "other_cpu_ms_per_request", "mean_batch", "client_cpu_share",
            "server_cpu_share")  # fmt: skip
    groups = dict.fromkeys((r.get("load_generator", "python"), r["server"]) for r in rows)
    for load, name in groups:
        mine = [r for r in rows if r.get("load_generator", "python") == load and r["server"] == name]
        med = {k: float(np.median([r[k] for r in mine])) for k in keys if all(k in r for r in mine)}
        out.append({"server": name, "load_generator": load, "runs": len(mine), **med})
    for load in dict.fromkeys(g[0] for g in groups):
        by = {r["server"]: r for r in out if r["load_generator"] == load}
        batched = by.get("flat batched")
        for r in by.values():
            if batched is not None and r is not batched:
                r["batched_qps_ratio"] = batched["qps"] / r["qps"]
                r["batched_cpu_ratio"] = r["server_cpu_ms_per_request"] / batched["server_cpu_ms_per_request"]
    return out


def sweep(work: Path, flat_dir: Path, queries: list[str]) -> list[dict[str, Any]]:
    """Recall@3 vs flat and search time of the saved hnsw and ivfpq indexes at several search breadths."""
    import faiss

    params = load_encoder_params(flat_dir)
    q = encode(load_encoder(params), queries, params["query_prefix"], 256)
    _, exact = faiss.read_index(str(work / "flat.faiss")).search(q, 3)
    rows = []
    for kind, knob, values in (("hnsw", "ef_search", (64, 128, 512, 2048)), ("ivfpq", "nprobe", (8, 32, 128, 512))):
        index = faiss.read_index(str(work / f"{kind}.faiss"))
        for v in values:
            if kind == "hnsw":
                index.hnsw.efSearch = v
            else:
                faiss.extract_index_ivf(index).nprobe = v
            t0 = time.perf_counter()
            _, got = index.search(q, 3)
            ms = 1000 * (time.perf_counter() - t0) / len(q)
            recall = float(np.mean([len(set(g) & set(e)) / 3 for g, e in zip(got, exact, strict=True)]))
            rows.append({"index": kind, knob: v, "recall_at_3_vs_flat": recall, "search_ms_per_query": ms})
    return rows


def sample_contents(corpus: Path, every: int = 20) -> list[str]:
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line)["contents"] for i, line in enumerate(f) if i % every == 0][:20_000]


def load_encoder_params(index_dir: Path) -> dict[str, Any]:
    return json.loads((index_dir / "manifest.json").read_text())["params"]


def report(res: dict[str, Any]) -> None:
    print(
        f"\n== dense retrieval: {res['num_docs']:,} passages x {res['hidden']} dims (tiny encoder), {res['cpus']} CPUs =="
    )
    print("load average start -> end:", res["loadavg_start"], "->", res["loadavg_end"])
    print("\n| index | recall@3 vs flat | bytes | build s | search ms/query (batch 64) |\n|---|---:|---:|---:|---:|")
    for k, v in res["indexes"].items():
        print(
            f"| {k} | {v['recall_at_3_vs_flat']:.3f} | {v['bytes']:,} | {v['build_s']:.1f} | {v['search_ms_per_query_batch64']:.3f} |"
        )
    print(
        f"\n| server ({res['http'][0]['clients']} concurrent single-query clients) | q/s | p50 ms | p99 ms |\n|---|---:|---:|---:|"
    )
    for r in res["http"]:
        print(
            f"| {r['server']} (wait {r['batch_wait_ms']:g} ms) | {r['qps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |"
        )
    ok = res["speedup"] >= TARGET_SPEEDUP
    print(
        f"\nbatched / unbatched = {res['speedup']:.1f}x (target >= {TARGET_SPEEDUP:.0f}x) -> {'PASS' if ok else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
