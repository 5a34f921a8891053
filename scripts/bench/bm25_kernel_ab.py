"""Kernel-only A/B of BM25 ``topk_query`` variants on one index: the same prepared queries, alternating.

Each query is planned once with the installed :func:`sorl_verl.retrieval.bm25_kernel.plan_query`
(terms, bounds, split, ``tau0``); then the installed ``topk_query`` and every variant given on the
command line (a copy of ``bm25_kernel.py`` with a changed ``topk_query``, same signature) score
the prepared queries in turn, ``--reps`` times. It prints per run the mean time and how many
results are identical to the installed kernel's (documents and float32 scores), then per variant
the mean / p50 / p99 / max over the per-query minimum of the runs. Only the kernel is timed: no
text analysis, no planning, no Python result building. The kernel-only tables of
docs/retrieval.md ("Branch-free reads and a compiled query plan") were measured this way::

    python scripts/bench/bm25_kernel_ab.py --index /tmp/rscale/n21015324/index --queries 0:2048 \\
        /tmp/variant.py /tmp/variant.py:2@16384      # file[:accumulate[@window]]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retrieval import make_queries  # noqa: E402

from sorl_verl.retrieval.index import load_searcher  # noqa: E402


def load_variant(spec: str, default_window: int, default_accumulate: float) -> tuple[str, Any, int, float]:
    """``file[:accumulate[@window]]`` -> (label, topk_query, window, accumulate)."""
    path, _, rest = spec.partition(":")
    accumulate, _, window = rest.partition("@")
    file = Path(path).resolve()
    sys.path.insert(0, str(file.parent))  # imported under its own name: numba's on-disk cache finds it by that
    module = importlib.import_module(file.stem)
    return (
        spec,
        module.topk_query,
        int(window) if window else default_window,
        float(accumulate) if accumulate else default_accumulate,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--index", required=True, help="a BM25 index directory (e.g. one kept by retrieval_scale.py)")
    ap.add_argument("--queries", default="0:2048", help="lo:hi of the benchmark's query list (make_queries seed 0)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("variants", nargs="*", help="file[:accumulate[@window]]: a bm25_kernel.py copy to compare")
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.queries.split(":"))
    sc = load_searcher(a.index, n_threads=1, mmap=True).scorer
    assert sc.compiled, "needs numba: the compiled kernel"
    kernel, (block, window, accumulate) = sc._kernel, sc._kernel_shape()
    prepared = []
    for q in make_queries(Path(a.index), max(hi, 8192), 0)[lo:hi]:
        ids = np.array(sc.analyzer.ids(q, sc.vocab), np.int64)
        plan = kernel.plan_query(
            sc.indices, sc.data, sc.indptr, sc.max_score, sc._kth_table(a.k), ids, a.k,
            sc.short_list, sc.theta_sample, sc.exhaustive_postings,
        )  # fmt: skip
        terms, starts, ends, w, ub, n_non, tau0 = plan
        if len(terms):
            args = (sc.indices, sc.data, sc._bmax, sc._blast, starts, ends, sc._bbase[terms], w, ub, n_non)
            prepared.append((args, tau0, min(a.k, int((ends - starts).sum()))))
    fns = [("installed", kernel.topk_query, window, accumulate)]
    fns += [load_variant(v, window, accumulate) for v in a.variants]
    out_docs, out_scores = np.empty(a.k, np.int64), np.empty(a.k, np.float32)

    def run(fn: Any, win: int, acc: float) -> tuple[np.ndarray, list[Any]]:
        times, rows = [], []
        for args, tau0, room in prepared:
            t = time.perf_counter()
            n = fn(*args, tau0, room, block, win, acc, out_docs, out_scores)
            if n < room and tau0 > 0.0:  # as bm25_kernel.search does
                n = fn(*args, 0.0, room, block, win, acc, out_docs, out_scores)
            times.append(time.perf_counter() - t)
            rows.append((out_docs[:n].tolist(), out_scores[:n].tolist()))
        return np.array(times) * 1e3, rows

    for _, fn, win, acc in fns:  # compile / warm
        run(fn, win, acc)
    reference = run(fns[0][1], fns[0][2], fns[0][3])[1]
    per_query: dict[str, list[np.ndarray]] = {label: [] for label, *_ in fns}
    for _ in range(a.reps):
        for label, fn, win, acc in fns:
            ms, rows = run(fn, win, acc)
            per_query[label].append(ms)
            same = sum(x == y for x, y in zip(rows, reference, strict=True))
            print(f"{label:24s} {ms.mean():.3f} ms/query, identical {same}/{len(reference)}", flush=True)
    for label, runs in per_query.items():
        ms = np.minimum.reduce(runs)
        print(
            f"{label:24s} min of {a.reps} per query: mean {ms.mean():.3f} p50 {np.median(ms):.3f} "
            f"p99 {np.percentile(ms, 99):.2f} max {ms.max():.1f} ms ({len(ms)} queries)"
        )


if __name__ == "__main__":
    main()
