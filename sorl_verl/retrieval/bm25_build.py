"""Bounded-memory BM25 index build: streaming analysis, sorted runs on disk, one sequential merge.

Pass 1 streams the corpus in chunks of ``chunk_docs`` passages (analysed in ``workers``
processes when > 1), maps chunk-local term ids to global ids, counts document frequencies and
keeps each passage's length. Postings (term, document, tf) are buffered up to
``memory_mb`` worth (:data:`BYTES_PER_POSTING` each, sorting temporaries included), then
written as a *run*: sorted by term, documents ascending within a term (runs follow corpus
order), stored as document ids (int32) and tf (uint16; uint32 if a count exceeds 65535), plus
the run's distinct terms and their posting counts.

Pass 2, once N, avgdl and every df are known, walks the vocabulary in blocks of at most the
same budget: it reads each block's contiguous slice from every run (in corpus order, so
documents stay ascending within a term), computes the scores and appends them to the output
arrays sequentially (no memory map, so page cache is not counted as the build's memory).

Memory: the budget, plus 4 bytes per passage (lengths), plus the vocabulary (a Python dict:
grows with distinct stems, not with passages), plus 12 bytes per (run, distinct term in that
run). The output is byte-identical to building everything in memory (a test pins this).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .analyzer import Analyzer
from .bm25 import DATA_FILE, INDICES_FILE, INDPTR_FILE, PARAMS_FILE, VOCAB_FILE

BYTES_PER_POSTING = 40  # buffered arrays (12 B) + concatenation, stable argsort and gathers while sorting a run
RUNS_DIR = ".bm25-runs"

_WORKER_ANALYZERS: dict[tuple[Any, Any], Analyzer] = {}


def default_memory_mb() -> int:
    """Postings budget of a build: 1/8 of physical RAM, within [256 MB, 4 GB]."""
    try:
        total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        total_mb = 8192
    return int(min(4096, max(256, total_mb / 8)))


def analyze_chunk(
    texts: list[str], stopwords: str | None, stemmer: str | None
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Term statistics of a chunk of documents, with chunk-local term ids.

    Returns ``(stems, lengths, keys, tf)``: ``stems[i]`` is local term i (in order of first
    appearance), ``lengths[d]`` the number of terms of document d, and one entry per distinct
    (document, term) pair with ``keys = d << 32 | term`` (sorted) and its count ``tf``.
    """
    analyzer = _WORKER_ANALYZERS.get((stopwords, stemmer))
    if analyzer is None:
        analyzer = _WORKER_ANALYZERS[(stopwords, stemmer)] = Analyzer(stopwords, stemmer)
    local: dict[str, int] = {}
    rows = analyzer.ids_growing(texts, local)
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter((t for row in rows for t in row), dtype=np.int64, count=int(lengths.sum()))
    local_doc = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    keys, tf = np.unique((local_doc << 32) | flat, return_counts=True)
    return list(local), lengths, keys, tf


@dataclass
class Run:
    """One sorted run on disk: ``docs`` (int32) and ``tf`` files, its distinct terms and their counts."""

    docs_path: Path
    tf_path: Path
    tf_dtype: np.dtype
    terms: np.ndarray  # distinct term ids, ascending (int32)
    ends: np.ndarray  # ends[i] = postings of terms[: i + 1] (int64)

    def block(self, t0: int, t1: int) -> tuple[int, int, np.ndarray]:
        """``(start, stop, terms)``: the postings of terms in ``[t0, t1)``, and the term of each."""
        i0, i1 = np.searchsorted(self.terms, [t0, t1])
        start = int(self.ends[i0 - 1]) if i0 else 0
        stop = int(self.ends[i1 - 1]) if i1 else 0
        counts = np.diff(self.ends[i0:i1], prepend=start)
        return start, stop, np.repeat(self.terms[i0:i1], counts)


def _read(f: BinaryIO, dtype: np.dtype, start: int, stop: int) -> np.ndarray:
    f.seek(start * dtype.itemsize)
    return np.fromfile(f, dtype=dtype, count=stop - start)


def _npy_header(f: BinaryIO, dtype: type, n: int) -> None:
    """The same header ``np.save`` writes for a 1-D array of ``n`` elements of ``dtype``."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (n,)}
    np.lib.format.write_array_header_1_0(f, header)


class BM25Builder:
    """Streams documents into sorted runs, then merges them into the bm25s layout (see module doc).

    With ``workers > 1`` the text analysis of chunks runs in that many processes; chunks are
    absorbed in corpus order, so the index is byte-identical to a single-process build.
    """

    def __init__(
        self,
        params: dict[str, Any],
        work_dir: Path,
        chunk_docs: int = 20_000,
        workers: int = 1,
        memory_mb: float | None = None,
    ) -> None:
        self.params = params
        self.vocab: dict[str, int] = {}
        self.memory_mb = float(memory_mb or default_memory_mb())
        if self.memory_mb <= 0:
            raise ValueError(f"memory_mb must be > 0, got {memory_mb}")
        self.max_postings = max(1, int(self.memory_mb * 2**20 // BYTES_PER_POSTING))
        self.chunk_docs = max(1, min(chunk_docs, self.max_postings // 64))  # a run holds whole chunks
        self.runs_dir = Path(work_dir) / RUNS_DIR
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.runs: list[Run] = []
        self.df = np.zeros(1024, dtype=np.int64)
        self._pending: list[str] = []
        self._buf: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._buffered = 0
        self._lengths: list[np.ndarray] = []
        self.num_docs = 0
        self.workers = max(1, int(workers))
        self._pool: ProcessPoolExecutor | None = None
        self._in_flight: deque[Future[Any]] = deque()
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))

    def add(self, contents: str) -> None:
        self._pending.append(contents)
        if len(self._pending) >= self.chunk_docs:
            self._flush_chunk()

    def _flush_chunk(self) -> None:
        if not self._pending:
            return
        args = (self._pending, self.params["stopwords"], self.params["stemmer"])
        self._pending = []
        if self._pool is None:
            self._absorb(*analyze_chunk(*args))
            return
        self._in_flight.append(self._pool.submit(analyze_chunk, *args))
        while len(self._in_flight) > 2 * self.workers:
            self._absorb(*self._in_flight.popleft().result())

    def _absorb(self, stems: list[str], lengths: np.ndarray, keys: np.ndarray, tf: np.ndarray) -> None:
        vocab = self.vocab
        remap = np.fromiter((vocab.setdefault(s, len(vocab)) for s in stems), dtype=np.int32, count=len(stems))
        terms = remap[keys & 0xFFFFFFFF]
        if len(vocab) > len(self.df):
            self.df = np.concatenate([self.df, np.zeros(max(len(vocab), 2 * len(self.df)) - len(self.df), np.int64)])
        self.df[: len(vocab)] += np.bincount(terms, minlength=len(vocab))
        self._buf.append((terms, ((keys >> 32) + self.num_docs).astype(np.int32), tf))
        self._buffered += len(terms)
        self._lengths.append(lengths.astype(np.float32))
        self.num_docs += len(lengths)
        if self._buffered >= self.max_postings:
            self._write_run()

    def _write_run(self) -> None:
        if not self._buf:
            return
        terms = np.concatenate([b[0] for b in self._buf])
        docs = np.concatenate([b[1] for b in self._buf])
        tf = np.concatenate([b[2] for b in self._buf])
        self._buf, self._buffered = [], 0
        order = np.argsort(terms, kind="stable")  # docs are ascending in the buffer: they stay so within a term
        terms = terms[order]
        docs = docs[order]
        tf = tf[order]
        del order
        uterms, counts = np.unique(terms, return_counts=True)
        del terms
        tf_dtype = np.dtype(np.uint16 if tf.max(initial=0) <= np.iinfo(np.uint16).max else np.uint32)
        i = len(self.runs)
        run = Run(self.runs_dir / f"{i}.docs", self.runs_dir / f"{i}.tf", tf_dtype, uterms.astype(np.int32),
                  np.cumsum(counts, dtype=np.int64))  # fmt: skip
        docs.tofile(run.docs_path)
        tf.astype(tf_dtype).tofile(run.tf_path)
        self.runs.append(run)

    def close(self, cancel: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=cancel)
            self._pool = None

    def save(self, out_dir: Path, progress: Any | None = None) -> None:
        """Write the index files into ``out_dir``; ``progress`` (tqdm-like) counts merged postings."""
        try:
            self._flush_chunk()
            while self._in_flight:
                self._absorb(*self._in_flight.popleft().result())
        finally:
            self.close()
        self._write_run()
        try:
            self._merge(out_dir, progress)
        finally:
            shutil.rmtree(self.runs_dir, ignore_errors=True)

    def _merge(self, out_dir: Path, progress: Any | None) -> None:
        n, vocab_size = self.num_docs, len(self.vocab)
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.float32)
        self._lengths = []
        df = self.df[:vocab_size]
        k1, b = float(self.params["k1"]), float(self.params["b"])
        idf = np.log1p((n - df.astype(np.float64) + 0.5) / (df + 0.5)).astype(np.float32)
        avgdl = float(lengths.mean()) if n and lengths.sum() > 0 else 1.0
        norm = (k1 * (1.0 - b + b * lengths / avgdl)).astype(np.float32)
        del lengths
        indptr = np.zeros(vocab_size + 1, dtype=np.int64)
        np.cumsum(df, out=indptr[1:])
        total = int(indptr[-1])
        files = [(open(r.docs_path, "rb"), open(r.tf_path, "rb")) for r in self.runs]  # noqa: SIM115 - closed below
        try:
            with open(out_dir / DATA_FILE, "wb") as data_f, open(out_dir / INDICES_FILE, "wb") as idx_f:
                _npy_header(data_f, np.float32, total)
                _npy_header(idx_f, np.int32, total)
                t0 = 0
                while t0 < vocab_size:
                    t1 = int(np.searchsorted(indptr, indptr[t0] + self.max_postings, side="right")) - 1
                    t1 = min(vocab_size, max(t1, t0 + 1))
                    scores, docs = self._merge_block(t0, t1, files, idf, norm)
                    scores.tofile(data_f)
                    docs.tofile(idx_f)
                    if progress is not None:
                        progress.update(len(docs))
                    t0 = t1
        finally:
            for pair in files:
                for f in pair:
                    f.close()
        np.save(out_dir / INDPTR_FILE, indptr)
        (out_dir / VOCAB_FILE).write_text(json.dumps(self.vocab, ensure_ascii=False), encoding="utf-8")
        bm25s_params = {
            "k1": k1, "b": b, "delta": 0.5, "method": "lucene", "idf_method": "lucene",
            "dtype": "float32", "int_dtype": "int32", "num_docs": n, "backend": "numpy",
        }  # fmt: skip
        (out_dir / PARAMS_FILE).write_text(json.dumps(bm25s_params, indent=2), encoding="utf-8")

    def _merge_block(
        self, t0: int, t1: int, files: list[tuple[BinaryIO, BinaryIO]], idf: np.ndarray, norm: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scores and documents of the postings of terms ``[t0, t1)``, term-major, documents ascending."""
        terms_parts, docs_parts, tf_parts = [], [], []
        for run, (docs_f, tf_f) in zip(self.runs, files, strict=True):
            start, stop, terms = run.block(t0, t1)
            if stop > start:
                terms_parts.append(terms)
                docs_parts.append(_read(docs_f, np.dtype(np.int32), start, stop))
                tf_parts.append(_read(tf_f, run.tf_dtype, start, stop))
        if not terms_parts:
            return np.zeros(0, np.float32), np.zeros(0, np.int32)
        terms = np.concatenate(terms_parts)
        docs = np.concatenate(docs_parts)
        tf = np.concatenate(tf_parts).astype(np.float32)
        del terms_parts, docs_parts, tf_parts
        if len(self.runs) > 1:
            order = np.argsort(terms, kind="stable")  # runs are in corpus order: documents stay ascending
            terms, docs, tf = terms[order], docs[order], tf[order]
        scores = idf[terms] * tf / (tf + norm[docs])
        return scores.astype(np.float32, copy=False), docs


def build_bm25(
    texts: Iterable[str],
    out_dir: Path,
    params: dict[str, Any],
    workers: int = 1,
    memory_mb: float | None = None,
    progress_factory: Any | None = None,
) -> int:
    """Index ``texts`` (in document order) into ``out_dir``; returns the number of documents.

    ``progress_factory(total, desc)`` (e.g. a tqdm partial), if given, makes the progress bar
    of the merge pass.
    """
    builder = BM25Builder(params, out_dir, workers=workers, memory_mb=memory_mb)
    try:
        for text in texts:
            builder.add(text)
        builder._flush_chunk()
        while builder._in_flight:
            builder._absorb(*builder._in_flight.popleft().result())
        total = int(builder.df[: len(builder.vocab)].sum())
        bar = progress_factory(total, "merge postings") if progress_factory else None
        try:
            builder.save(out_dir, bar)
        finally:
            if bar is not None:
                bar.close()
    finally:
        builder.close()
        shutil.rmtree(builder.runs_dir, ignore_errors=True)
    return builder.num_docs
