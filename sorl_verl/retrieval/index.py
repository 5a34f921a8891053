"""Load an index directory into an in-process :class:`Searcher`.

``load_searcher(index_dir).search(queries, topk)`` returns, per query, up to ``topk`` dicts
``{"id", "contents", "score"}`` sorted by score, highest first (ties: earlier document first).
BM25 returns fewer than ``topk`` when fewer documents share a term with the query.
Searchers are thread-safe: the server calls them from a thread pool.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from .corpus import DocStore
from .manifest import IndexFormatError, read_manifest


class Searcher(Protocol):
    manifest: dict[str, Any]
    num_docs: int

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]: ...


class _Scorer(Protocol):
    num_docs: int

    def topk_ids(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]: ...


class IndexSearcher:
    """A scorer (BM25 or dense) plus the document store of the same index directory."""

    def __init__(self, index_dir: str | Path, manifest: dict[str, Any], scorer: _Scorer) -> None:
        self.index_dir = Path(index_dir)
        self.manifest = manifest
        self.scorer = scorer
        self.docs = DocStore(index_dir)
        self.num_docs = len(self.docs)
        if self.num_docs != manifest["num_docs"] or scorer.num_docs != self.num_docs:
            raise IndexFormatError(
                f"{index_dir}: manifest says {manifest['num_docs']} documents, document store has "
                f"{self.num_docs}, {manifest['method']} index has {scorer.num_docs}; rebuild the index"
            )

    def search_ids(self, queries: list[str], topk: int) -> list[list[tuple[int, float]]]:
        """Per query, ``(document position, score)`` pairs, best first."""
        return self.scorer.topk_ids(list(queries), min(int(topk), self.num_docs))

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        """Per query, ``{"id", "contents", "score"}`` hits, best first (the batch's documents fetched together)."""
        hits = self.search_ids(queries, topk)
        docs = iter(self.docs.get_many([pos for row in hits for pos, _ in row]))
        out = []
        for row in hits:
            fetched = [next(docs) for _ in row]
            out.append(
                [{"id": d["id"], "contents": d["contents"], "score": s} for d, (_, s) in zip(fetched, row, strict=True)]
            )
        return out


def default_workers() -> int:
    """Cores this process may run on (the default number of search threads)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def load_searcher(
    index_dir: str | Path,
    *,
    n_threads: int = 1,
    mmap: bool = False,
    scratch_buffers: int | None = None,
    **dense_overrides: Any,
) -> IndexSearcher:
    """Searcher over ``index_dir`` after validating its manifest.

    ``n_threads``: BM25 splits a large batch over this many threads. ``mmap``: memory-map the
    BM25 postings instead of reading them into RAM. ``scratch_buffers``: BM25 full-corpus
    scratch arrays (4 bytes per passage each), i.e. queries scored at the same time (default
    ``max(n_threads, cores)``). ``dense_overrides`` (e.g. ``device="cuda"``, ``model="/new/path"``,
    ``faiss_gpu=True``, ``nprobe=64``) replace dense parameters recorded at build time.
    """
    manifest = read_manifest(index_dir)
    if manifest["method"] == "bm25":
        from .bm25 import BM25Scorer

        if dense_overrides:
            raise ValueError(f"{index_dir} is a BM25 index; dense options {sorted(dense_overrides)} do not apply")
        buffers = scratch_buffers or max(n_threads, default_workers())
        scorer: _Scorer = BM25Scorer(
            index_dir, manifest["params"], n_threads=n_threads, mmap=mmap, scratch_buffers=buffers
        )
    else:
        from .dense import DenseScorer, serve_params

        scorer = DenseScorer(index_dir, serve_params(manifest["params"], dense_overrides))
    return IndexSearcher(index_dir, manifest, scorer)
