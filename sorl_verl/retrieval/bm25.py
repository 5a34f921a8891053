"""BM25 index (bm25s on-disk format) with batched sparse scoring.

Scores are bm25s' ``method="lucene"``: for query term t and document d,

    score(t, d) = idf(t) * tf / (tf + k1 * (1 - b + b * |d| / avgdl)),
    idf(t) = log(1 + (N - df(t) + 0.5) / (df(t) + 0.5)),

and a query scores the sum over its terms (a repeated query term counts again). The scores are
precomputed per (term, document) (:mod:`.bm25_build`, in bounded memory) and saved in bm25s' layout (``data/indices/indptr.csc.index.npy``,
``vocab.index.json``, ``params.index.json``), so ``bm25s.BM25.load(index_dir)`` reads the same
index. Retrieval is exact top-k with MaxScore pruning (see :class:`BM25Scorer`; compiled in
:mod:`.bm25_kernel` where numba is installed), or a sparse
query-term x term-document product (scipy) for a whole batch.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .analyzer import Analyzer

DATA_FILE = "data.csc.index.npy"
INDICES_FILE = "indices.csc.index.npy"
INDPTR_FILE = "indptr.csc.index.npy"
VOCAB_FILE = "vocab.index.json"
PARAMS_FILE = "params.index.json"
BM25_FILES = (DATA_FILE, INDICES_FILE, INDPTR_FILE, VOCAB_FILE, PARAMS_FILE)

STRATEGIES = ("maxscore", "maxscore-numpy", "matmul")

DEFAULT_PARAMS: dict[str, Any] = {"k1": 1.5, "b": 0.75, "stopwords": "en", "stemmer": "english"}


def load_kernel() -> Any:
    """The compiled MaxScore module :mod:`.bm25_kernel`; None where numba is not installed or
    ``SORL_BM25_KERNEL=0`` (then ``"maxscore"`` is the numpy code, e.g. for a baseline server)."""
    if os.environ.get("SORL_BM25_KERNEL", "1") == "0":
        return None
    try:
        from . import bm25_kernel
    except ImportError:
        return None
    return bm25_kernel


def bm25_params(**overrides: Any) -> dict[str, Any]:
    """Default BM25 parameters updated with ``overrides``; unknown names or bad values raise."""
    unknown = set(overrides) - set(DEFAULT_PARAMS)
    if unknown:
        raise ValueError(f"unknown BM25 parameter(s) {sorted(unknown)}; known: {sorted(DEFAULT_PARAMS)}")
    params = {**DEFAULT_PARAMS, **overrides}
    if not params["k1"] >= 0 or not 0 <= params["b"] <= 1:
        raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={params['k1']} b={params['b']}")
    return params


class ScratchPool:
    """At most ``size`` full-corpus scratch accumulators, each lent to one query at a time.

    An accumulator is a float32 array of ``num_docs`` scores, all zeros between queries (4 bytes
    per passage). Accumulators are made on first need and reused (last returned, first lent); a
    query that finds all ``size`` in use waits, so scratch memory is ``<= size * 4 * num_docs``
    bytes whatever the concurrency.
    """

    def __init__(self, num_docs: int, size: int) -> None:
        if size < 1:
            raise ValueError(f"scratch pool size must be >= 1, got {size}")
        self.num_docs, self.size = num_docs, size
        self.made = 0
        self._free: list[np.ndarray] = []
        self._cond = threading.Condition()

    @contextmanager
    def lend(self) -> Iterator[np.ndarray]:
        with self._cond:
            while not self._free and self.made >= self.size:
                self._cond.wait()
            acc = self._free.pop() if self._free else None
            if acc is None:
                self.made += 1
        if acc is None:
            try:
                acc = np.zeros(self.num_docs, dtype=np.float32)
            except BaseException:
                with self._cond:
                    self.made -= 1
                    self._cond.notify()
                raise
        try:
            yield acc
        finally:
            with self._cond:
                self._free.append(acc)
                self._cond.notify()


class BM25Scorer:
    """Top-k BM25 over a saved index: ``topk_ids(queries, k) -> [[(doc_position, score), ...], ...]``.

    ``strategy="maxscore"`` (default) is exact top-k with MaxScore pruning: with per-term upper
    bounds ``U_t = w_t * max_d score(t, d)`` sorted ascending and a lower bound ``theta`` on the
    k-th best score (from fully scoring a sample of real documents), the longest prefix of terms
    with ``sum U < theta`` is non-essential: a document matching only those terms cannot reach
    the top k. Only the essential terms' postings are accumulated; candidates whose partial
    score plus the non-essential bound cannot reach ``theta`` are dropped, and the survivors get
    the remaining terms' scores by binary search in the (document-sorted) postings.
    ``strategy="matmul"`` scores every posting of every query term with one sparse product
    per batch; both give the same documents (scores equal up to float32 summation order).

    Where numba is installed, ``"maxscore"`` runs the compiled windowed block-max MaxScore of
    :mod:`.bm25_kernel` (no full-corpus scratch array, GIL released while scoring) with the same
    ``theta`` and essential/non-essential split as the numpy code, so its top-k (documents,
    float32 scores and tie order) is bit-identical; ``"maxscore-numpy"`` forces the numpy code.
    """

    max_matmul_rows = 64
    theta_sample = 512
    short_list = 65536
    exhaustive_postings = 8192
    max_kth_cache = 1 << 20
    max_chunk = 8  # queries a scoring thread takes at a time from a batch split over threads
    kernel_block = 128  # postings per block of the compiled kernel's block maxima
    kernel_window = 16384  # documents per window of the compiled kernel (16,384 vs 8,192: 1.6% less time at 21M)
    kernel_accumulate = 2.0  # read a non-essential list in order when <= this x the essential lists' postings

    def __init__(
        self,
        index_dir: str | Path,
        params: dict[str, Any],
        n_threads: int = 1,
        mmap: bool = False,
        strategy: str = "maxscore",
        scratch_buffers: int | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown BM25 strategy {strategy!r}; use one of {STRATEGIES}")
        index_dir = Path(index_dir)
        mode = "r" if mmap else None
        # plain ndarray views of the (maybe memory-mapped) arrays: slicing a np.memmap costs more per call
        self.data = np.asarray(np.load(index_dir / DATA_FILE, mmap_mode=mode))
        self.indices = np.asarray(np.load(index_dir / INDICES_FILE, mmap_mode=mode))
        indptr = np.load(index_dir / INDPTR_FILE)
        if int(indptr[-1]) < np.iinfo(np.int32).max:
            indptr = indptr.astype(np.int32)  # same index dtype as `indices`: scipy then copies nothing
        self.indptr = indptr
        self.vocab: dict[str, int] = json.loads((index_dir / VOCAB_FILE).read_text(encoding="utf-8"))
        self.num_docs = int(json.loads((index_dir / PARAMS_FILE).read_text())["num_docs"])
        if (
            len(indptr) != len(self.vocab) + 1
            or len(self.data) != len(self.indices)
            or int(indptr[-1]) != len(self.data)
        ):
            raise ValueError(f"{index_dir}: BM25 arrays are inconsistent with each other or with the vocabulary")
        self.matrix = sp.csr_matrix(
            (self.data, self.indices, indptr), shape=(len(self.vocab), self.num_docs), copy=False
        )
        self._kernel = load_kernel() if strategy == "maxscore" else None
        if self._kernel is not None:  # one pass: per-block maxima and last documents, per-term maxima
            blocks = self._kernel.block_maxima(self.data, self.indices, indptr, self.kernel_block)
            self._bbase, self._bmax, self._blast, self.max_score = blocks
            self._warm_kernel()
        else:
            nonempty = np.flatnonzero(np.diff(indptr))
            self.max_score = np.zeros(len(self.vocab), dtype=np.float32)
            if len(nonempty):
                self.max_score[nonempty] = np.maximum.reduceat(np.asarray(self.data), indptr[nonempty])
        self.analyzer = Analyzer(params["stopwords"], params["stemmer"])
        self.strategy = strategy
        self.n_threads = max(1, n_threads)
        self._pool = ThreadPoolExecutor(self.n_threads) if self.n_threads > 1 else None
        self.scratch = ScratchPool(self.num_docs, scratch_buffers or self.n_threads)
        self._kth_cache: dict[tuple[int, int], float] = {}
        self._kth_tables: dict[int, np.ndarray] = {}

    def query_matrix(self, queries: list[str]) -> sp.csr_matrix:
        """Sparse (queries x terms) matrix of query-term counts."""
        rows = [self.analyzer.ids(q, self.vocab) for q in queries]
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=indptr[1:])
        cols = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(indptr[-1]))
        q = sp.csr_matrix((np.ones(len(cols), np.float32), cols, indptr), shape=(len(rows), len(self.vocab)))
        q.sum_duplicates()
        return q

    @staticmethod
    def _select(docs: np.ndarray, vals: np.ndarray, k: int) -> list[tuple[int, float]]:
        if len(vals) > k:
            keep = np.argpartition(-vals, k - 1)[:k]
            kth = vals[keep].min()
            keep = np.flatnonzero(vals >= kth)  # every tie of the k-th score, so ties resolve by position
            docs, vals = docs[keep], vals[keep]
        order = np.lexsort((docs, -vals))[:k]  # score descending, ties by document position
        return [(int(d), float(v)) for d, v in zip(docs[order], vals[order], strict=True)]

    def _topk_matmul(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        out = []
        for s in range(0, len(queries), self.max_matmul_rows):  # bounds the (queries x docs) temporary
            scores = self.query_matrix(queries[s : s + self.max_matmul_rows]) @ self.matrix
            for i in range(scores.shape[0]):
                start, end = scores.indptr[i], scores.indptr[i + 1]
                out.append(self._select(scores.indices[start:end], scores.data[start:end], k))
        return out

    def _lookup(self, cand: np.ndarray, term_slices: list[tuple[int, int, float]]) -> np.ndarray:
        """Scores of the sorted documents ``cand`` summed over ``(start, end, weight)`` posting slices."""
        total = np.zeros(len(cand), dtype=np.float32)
        for start, end, w in term_slices:
            docs = self.indices[start:end]
            pos = np.minimum(np.searchsorted(docs, cand), len(docs) - 1)
            hit = docs[pos] == cand
            total[hit] += w * self.data[start + pos[hit]]
        return total

    def _sample_kth(self, sample: np.ndarray, slices: list[tuple[int, int, float]], k: int) -> float:
        """The ``k``-th largest of :meth:`_lookup` ``(sample, slices)`` (the compiled path's twin is
        :func:`.bm25_kernel.sample_kth`, called from :func:`.bm25_kernel.plan_query`)."""
        sample_scores = self._lookup(sample, slices)
        return float(np.partition(sample_scores, len(sample) - k)[len(sample) - k])

    def _kth_largest(self, start: int, end: int, k: int) -> float:
        """The ``k``-th largest stored score of the posting list at ``start:end`` (cached per ``(start, k)``)."""
        key = (start, k)
        value = self._kth_cache.get(key)
        if value is None:
            if len(self._kth_cache) >= self.max_kth_cache:
                self._kth_cache.clear()
            value = self._kth_cache[key] = float(np.partition(self.data[start:end], end - start - k)[end - start - k])
        return value

    def _accumulate(self, slices: list[tuple[int, int, float]], acc: np.ndarray) -> list[np.ndarray]:
        """Add ``weight * score`` of every posting of ``slices`` into the zeroed ``acc``, in order; their documents.

        Per document the result is the float32 left fold of the slices' contributions in the given
        order (the first slice is assigned: ``0 + x == x``). On any exception (an interrupt included)
        ``acc`` is zeroed again before it propagates: the next query needs it all zeros.
        """
        touched = []
        try:
            for i, (start, end, w) in enumerate(slices):
                docs = self.indices[start:end]
                vals = self.data[start:end] if w == 1.0 else w * self.data[start:end]
                if i == 0:
                    acc[docs] = vals
                else:
                    acc[docs] += vals  # docs are unique within one posting list
                touched.append(docs)
        except BaseException:
            for start, end, _ in slices:
                acc[self.indices[start:end]] = 0.0
            raise
        return touched

    @staticmethod
    def _harvest(touched: list[np.ndarray], acc: np.ndarray, floor: float) -> tuple[np.ndarray, np.ndarray]:
        """Distinct documents of ``touched`` with ``acc >= floor`` and their ``acc``; leaves ``acc`` all zeros.

        Each list's values are read and then zeroed, so a document seen in an earlier list reads 0
        in a later one: with positive scores (``floor`` is raised above 0) every document is
        returned once without a de-duplication pass.
        """
        floor = max(floor, float(np.finfo(np.float32).tiny))
        cands, vals = [], []
        for docs in touched:
            v = acc[docs]
            acc[docs] = 0.0
            keep = np.flatnonzero(v >= floor)
            cands.append(docs[keep])
            vals.append(v[keep])
        if len(cands) == 1:
            return cands[0], vals[0]
        return np.concatenate(cands), np.concatenate(vals)

    def _accumulate_select(
        self, slices: list[tuple[int, int, float]], k: int, acc: np.ndarray
    ) -> list[tuple[int, float]]:
        """Exhaustive top-k over every posting of the query terms (few postings: cheaper than pruning)."""
        touched = self._accumulate(slices, acc)
        cand, scores = self._harvest(touched, acc, 0.0)
        return self._select(cand, scores, k)

    def _warm_kernel(self) -> None:
        """Compile (or load from numba's cache) the kernel for these arrays' types now, not at the first query."""
        none = np.zeros(0, np.int64)
        self._kernel.search(
            self.indices, self.data, self.indptr, self.max_score, self._bbase, self._bmax, self._blast,
            np.full(1, np.nan, np.float32), none, 1, 1, 1, 0, *self._kernel_shape(), none, np.zeros(1, np.float32),
        )  # fmt: skip

    def _kernel_shape(self) -> tuple[int, int, float]:
        """``(block, window, accumulate)`` of :func:`.bm25_kernel.topk_query`."""
        return self.kernel_block, max(1, int(self.kernel_window)), float(self.kernel_accumulate)

    @property
    def compiled(self) -> bool:
        """Whether MaxScore runs in the compiled kernel (:mod:`.bm25_kernel`) rather than numpy."""
        return self._kernel is not None

    def _kth_table(self, k: int) -> np.ndarray:
        """Per term, its list's ``k``-th largest score for :func:`.bm25_kernel.plan_query` (NaN: not yet
        computed; filled as queries need it). 4 bytes per term and ``k``; at most 4 values of ``k`` kept."""
        table = self._kth_tables.get(k)
        if table is None:
            if len(self._kth_tables) >= 4:
                self._kth_tables.clear()
            table = self._kth_tables[k] = np.full(len(self.vocab), np.nan, np.float32)
        return table

    def _topk_kernel(self, term_ids: list[int], k: int) -> list[tuple[int, float]]:
        """The numpy MaxScore path's result (bit-identical), computed by :func:`.bm25_kernel.search`."""
        out_docs, out_scores = np.empty(k, np.int64), np.empty(k, np.float32)
        n = self._kernel.search(
            self.indices, self.data, self.indptr, self.max_score, self._bbase, self._bmax, self._blast,
            self._kth_table(k), np.array(term_ids, np.int64), k, self.short_list, self.theta_sample,
            self.exhaustive_postings, *self._kernel_shape(), out_docs, out_scores,
        )  # fmt: skip
        return list(zip(out_docs[:n].tolist(), out_scores[:n].tolist(), strict=True))

    def _topk_maxscore_one(self, term_ids: list[int], k: int) -> list[tuple[int, float]]:
        if not term_ids:
            return []
        if self._kernel is not None:
            return self._topk_kernel(term_ids, k)
        with self.scratch.lend() as acc:
            return self._topk_maxscore_scratch(term_ids, k, acc)

    def _query_terms(self, term_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(terms, counts, bounds, starts, ends)`` of the distinct query terms, by ascending bound (stable).

        A term's weight ``w`` is its count in the query (float32) and its bound
        ``U = count * max_score`` (float64); terms first sorted by id, so the order is a function
        of the query's multiset of terms. Empty posting lists are kept (bound 0).
        """
        tally = Counter(term_ids)
        terms = np.array(sorted(tally), dtype=np.int64)
        counts = np.array([tally[t] for t in terms.tolist()], dtype=np.int64)
        bounds = counts * self.max_score[terms]
        order = np.argsort(bounds, kind="stable")
        terms, counts, bounds = terms[order], counts[order].astype(np.float32), bounds[order]
        return terms, counts, bounds, self.indptr[terms], self.indptr[terms + 1]

    def _theta(
        self, slices: list[tuple[int, int, float]], starts: np.ndarray, ends: np.ndarray, counts: np.ndarray, k: int
    ) -> float:
        """A lower bound on the k-th best score, from partial scores (each <= the full score) of
        distinct real documents: a sample of the shortest list scored against the short lists,
        and the k-th best single-term score of each short list."""
        short = [sl for sl in slices if sl[1] - sl[0] <= self.short_list]
        j = int(np.argmin(ends - starts + (ends == starts) * np.iinfo(np.int32).max))
        sample = np.asarray(self.indices[starts[j] : min(ends[j], starts[j] + self.theta_sample)])
        theta = 0.0
        if len(sample) >= k:
            theta = self._sample_kth(sample, short or [(int(starts[j]), int(ends[j]), float(counts[j]))], k)
        for start, end, w in short:
            if end - start >= k:
                theta = max(theta, w * self._kth_largest(start, end, k))
        return theta

    def _topk_maxscore_scratch(self, term_ids: list[int], k: int, acc: np.ndarray) -> list[tuple[int, float]]:
        if not term_ids:
            return []
        _, counts, bounds, starts, ends = self._query_terms(term_ids)
        slices = [(int(a), int(b), float(w)) for a, b, w in zip(starts, ends, counts, strict=True) if b > a]
        if not slices:
            return []
        if len(slices) == 1:  # one term: its postings are the scores
            start, end, w = slices[0]
            vals = self.data[start:end] if w == 1.0 else w * self.data[start:end]
            if end - start > k:  # keep the k-th best (cached; float32 scaling keeps the order) and its ties
                keep = np.flatnonzero(vals >= np.float32(w) * np.float32(self._kth_largest(start, end, k)))
                return self._select(self.indices[start + keep], vals[keep], k)
            return self._select(self.indices[start:end], vals, k)
        if sum(end - start for start, end, _ in slices) <= self.exhaustive_postings:
            return self._accumulate_select(slices, k, acc)
        theta = self._theta(slices, starts, ends, counts, k)
        n_non = int(np.searchsorted(np.cumsum(bounds), theta, side="left"))  # prefix with sum(U) < theta
        non_bound = float(bounds[:n_non].sum())
        essential = [
            (int(starts[i]), int(ends[i]), float(counts[i])) for i in range(n_non, len(counts)) if ends[i] > starts[i]
        ]
        if len(essential) == 1:  # the partial scores are the one list's contributions: no accumulator
            start, end, w = essential[0]
            docs = np.asarray(self.indices[start:end])
            partial = self.data[start:end] if w == 1.0 else w * self.data[start:end]
            if len(docs) >= k:  # one list has unique documents: its k-th partial score bounds theta too
                theta = max(theta, float(np.partition(partial, len(docs) - k)[len(docs) - k]))
            floor = theta - non_bound - 1e-5 * max(1.0, abs(theta))  # float32 slack: never drop a tie
            keep = np.flatnonzero(partial >= floor)
            cand, partial = docs[keep], partial[keep]
        elif essential:
            touched = self._accumulate(essential, acc)
            floor = theta - non_bound - 1e-5 * max(1.0, abs(theta))  # float32 slack: never drop a tie
            cand, partial = self._harvest(touched, acc, floor)
            if len(cand) > k:  # the candidates hold every partial score >= floor: their k-th best bounds theta
                theta = max(theta, float(np.partition(partial, len(cand) - k)[len(cand) - k]))
                keep = np.flatnonzero(partial >= theta - non_bound - 1e-5 * max(1.0, abs(theta)))
                cand, partial = cand[keep], partial[keep]
        else:  # float rounding put every term below theta: score every document exhaustively
            return self._accumulate_select(slices, k, acc)
        non_slices = [(int(starts[i]), int(ends[i]), float(counts[i])) for i in range(n_non) if ends[i] > starts[i]]
        if not non_slices:
            return self._select(cand, partial, k)
        return self._select(*self._complete(cand, partial, non_slices, bounds[:n_non], theta, k), k)

    def _complete(
        self,
        cand: np.ndarray,
        partial: np.ndarray,
        slices: list[tuple[int, int, float]],
        bounds: np.ndarray,
        theta: float,
        k: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Full scores ``partial + fold(slices)`` of the candidates that can still reach the top ``k``.

        ``theta`` is a lower bound on the k-th best score. The slices' contributions are looked
        up from the largest bound down; after each, the k-th best score so far of the (distinct)
        candidates raises ``theta`` (a score so far never exceeds the full score), and a
        candidate whose score so far plus the remaining slices' bounds is below ``theta`` is
        dropped. The survivors' contributions are then summed in the slices' own order and
        added to ``partial``: the same float32 arithmetic as :meth:`_lookup` on every candidate.
        """
        contrib: list[np.ndarray | None] = [None] * len(slices)
        remaining = float(bounds.sum())
        upper = partial.astype(np.float64)
        for i in range(len(slices) - 1, -1, -1):
            start, end, w = slices[i]
            docs = self.indices[start:end]
            pos = np.minimum(np.searchsorted(docs, cand), len(docs) - 1)
            c = np.where(docs[pos] == cand, w * self.data[start + pos], np.float32(0.0))
            contrib[i] = c
            remaining -= float(bounds[i])
            upper += c
            if i and len(cand) > k:
                theta = max(theta, float(np.partition(upper, len(upper) - k)[len(upper) - k]))
                floor = theta - 1e-5 * max(1.0, abs(theta))  # float32 slack: never drop a tie
                keep = np.flatnonzero(upper + remaining >= floor)
                if len(keep) < len(cand):
                    cand, partial, upper = cand[keep], partial[keep], upper[keep]
                    contrib = [None if x is None else x[keep] for x in contrib]
        total = np.zeros(len(cand), dtype=np.float32)
        for c in contrib:
            total += c
        return cand, partial + total

    def _topk_chunk(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        if self.strategy == "matmul":
            return self._topk_matmul(queries, k)
        return [self._topk_maxscore_one(self.analyzer.ids(q, self.vocab), k) for q in queries]

    def topk_ids(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        if k <= 0 or not queries:
            return [[] for _ in queries]
        if self._pool is None or len(queries) < 2 * self.n_threads:
            return self._topk_chunk(queries, k)
        # small chunks, taken by whichever thread is free: query costs are heavy-tailed, so equal halves
        # leave one thread idle (at 21M, 2 threads: ~770-860 q/s in halves, ~900-930 in chunks of 8)
        step = max(1, min(self.max_chunk, len(queries) // (4 * self.n_threads)))
        parts = self._pool.map(lambda s: self._topk_chunk(queries[s : s + step], k), range(0, len(queries), step))
        return [row for part in parts for row in part]
