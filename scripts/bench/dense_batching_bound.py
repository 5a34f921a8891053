#!/usr/bin/env python
"""How much can batching speed up exact (flat) dense serving on this CPU? In-process, no HTTP.

For each index directory made by ``dense_retrieval.py`` (``--workdir DIR`` -> ``DIR/flat``), on
one thread pinned to one CPU, the CPU time per query of

- the encoder and the flat index search, through the server's own search call
  (``DenseScorer.topk_ids``, split by its CPU counters): one query per call (the unbatched
  server) against ``--batch`` queries per call (a full batch of the batched server);

and, independent of any index, this CPU's float32 matrix-multiply rate (GFLOP/s, the batched
scan's limit: it is compute-bound) and matrix-vector read rate (GB/s, the unbatched scan's
limit: it reads every vector once per query). Their quotient is the *machine balance*: a batch
of ``B`` queries reads the ``N x d`` vectors once and does ``2 N d B`` flops, one query alone
reads them all for ``2 N d`` flops, so batching can make the scan at most about
``(GFLOP/s) / (2 * GB/s / 4)`` times cheaper per query, however large the batch.

``ceiling`` = (encode_1 + search_1 + http_before) / (encode_B + search_B + http_now): the
largest queries/s ratio a batched server on one core can reach over the unbatched one, if HTTP
cost exactly ``--http-before-ms`` / ``--http-now-ms`` per request (0 by default: an upper bound
that ignores HTTP altogether).

    python scripts/bench/dense_batching_bound.py --workdirs /tmp/dbench /tmp/dbench768 --cpu 0 \
        --json-out /tmp/dense_batching_bound.json   # measured: docs/results/bench/dense_batching_bound.json
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread everywhere, set before
    os.environ[_var] = "1"  # before numpy loads its BLAS

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dense_retrieval import make_queries, sample_contents  # noqa: E402
from serve_load import cpu_simd  # noqa: E402

from sorl_verl.study.runner import cpu_name  # noqa: E402


def _cpu_time(fn: Any, reps: int) -> float:
    """Median thread CPU seconds of ``fn()`` over ``reps`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return float(np.median(times))


def machine_balance(n: int = 2_000_000, d: int = 64, chunk: int = 4096, reps: int = 5) -> dict[str, float]:
    """This thread's float32 GEMM rate and GEMV read rate over ``n x d`` vectors.

    GEMM: 64 queries against the vectors ``chunk`` rows at a time (the scores of a chunk stay in
    cache, as in faiss's blocked flat search), GFLOP/s; GEMV: one query against all of them,
    GB/s of vectors read.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d), dtype=np.float32)
    q1 = rng.standard_normal(d, dtype=np.float32)
    qb = rng.standard_normal((d, 64), dtype=np.float32)
    out = np.empty((chunk, 64), dtype=np.float32)

    def gemm() -> None:
        for s in range(0, n, chunk):
            np.matmul(x[s : s + chunk], qb, out=out[: min(chunk, n - s)])

    gemv_s = _cpu_time(lambda: x @ q1, reps)
    gemm_s = _cpu_time(gemm, reps)
    return {"gemm_gflops": 2 * n * d * 64 / gemm_s / 1e9, "gemv_gbps": x.nbytes / gemv_s / 1e9, "n": n, "d": d}


def probe(workdir: Path, batch: int, rounds: int) -> dict[str, Any]:
    """Per-query CPU ms of the encoder and the flat search (the server's search call), alone and in batches.

    ``rounds`` times: ``batch`` queries one call each, then the same queries in one call; the
    scorer's own thread-CPU counters split each into encoder and index time; medians per query.
    """
    from sorl_verl.retrieval.index import load_searcher

    scorer = load_searcher(workdir / "flat", intra_op_threads=1).scorer
    sample = [line.split("\n", 1)[1].split() for line in sample_contents(workdir / "corpus.jsonl")]
    queries = make_queries(sample, (rounds + 2) * batch, 0)  # the serving benchmark's kind of query
    rows: dict[str, list[float]] = {"encode_ms_1": [], "index_ms_1": [], "encode_ms_batch": [], "index_ms_batch": []}
    scorer.topk_ids(queries[:batch], 3)  # warm-up: first calls allocate
    for r in range(rounds):
        qs = queries[(r + 1) * batch : (r + 2) * batch]
        for suffix, calls in (("1", [[q] for q in qs]), ("batch", [qs])):
            before = scorer.stats()
            for call in calls:
                scorer.topk_ids(call, 3)
            after = scorer.stats()
            rows[f"encode_ms_{suffix}"].append(1000 * (after["encode_cpu_s"] - before["encode_cpu_s"]) / len(qs))
            rows[f"index_ms_{suffix}"].append(1000 * (after["search_cpu_s"] - before["search_cpu_s"]) / len(qs))
    out: dict[str, Any] = {"workdir": str(workdir), "num_vectors": int(scorer.index.ntotal),
                           "dim": int(scorer.index.d), "batch": batch, "rounds": rounds}  # fmt: skip
    out.update({k: float(np.median(v)) for k, v in rows.items()})
    out["total_ms_1"] = out["encode_ms_1"] + out["index_ms_1"]
    out["total_ms_batch"] = out["encode_ms_batch"] + out["index_ms_batch"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdirs", nargs="+", required=True, help="dense_retrieval.py --workdir directories")
    ap.add_argument("--cpu", type=int, help="pin this process to one CPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="rounds (probe) and repetitions (machine balance)")
    ap.add_argument("--http-before-ms", type=float, default=0.0, help="HTTP CPU per request, server as it was")
    ap.add_argument("--http-now-ms", type=float, default=0.0, help="HTTP CPU per request, batched server")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    import faiss
    import torch

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    res: dict[str, Any] = {"cpu_model": cpu_name(), "cpu_simd": cpu_simd(), "cpu": a.cpu, "loadavg": os.getloadavg(),
                           "command": " ".join(sys.argv), "indexes": []}  # fmt: skip
    spawn = multiprocessing.get_context("spawn")  # a fresh process per index: a 64-wide index loaded
    for w in a.workdirs:  # first made the 768-wide one's single-query scan 3x slower in the same process
        with spawn.Pool(1) as pool:
            row = pool.apply(probe, (Path(w), a.batch, a.reps))
        before = row["total_ms_1"] + a.http_before_ms
        now = row["total_ms_batch"] + a.http_now_ms
        row["ceiling"] = before / now
        row["index_ratio"] = row["index_ms_1"] / row["index_ms_batch"]
        row["encode_ratio"] = row["encode_ms_1"] / row["encode_ms_batch"]
        res["indexes"].append(row)
        print(json.dumps(row), flush=True)
    bal = res["balance"] = machine_balance()
    bal["scan_ratio_bound"] = bal["gemm_gflops"] / (2 * bal["gemv_gbps"] / 4)
    print(f"machine balance: {bal}", flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
