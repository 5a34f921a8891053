"""Build an index directory from a JSON-lines corpus.

``build_index(corpus_path, out_dir, method="bm25", **params)`` streams the corpus once: it
hashes the raw bytes (sha256), writes the normalized document store and feeds the indexer,
then writes ``manifest.json``. The directory is assembled under a temporary name and renamed
into place, so a reader never sees a half-built index.

CLI: ``python -m sorl_verl.retrieval.build --corpus X.jsonl --out DIR [--method bm25|dense ...]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from . import bm25, bm25_build
from .corpus import DOCS_FILE, OFFSETS_FILE, CorpusFormatError, DocWriter, iter_corpus
from .manifest import FORMAT_VERSION, METHODS, write_manifest


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sorl-verl")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def build_index(
    corpus_path: str | Path,
    out_dir: str | Path,
    method: str = "bm25",
    *,
    overwrite: bool = False,
    show_progress: bool = True,
    workers: int = 1,
    memory_mb: float | None = None,
    **params: Any,
) -> Path:
    """Index ``corpus_path`` into ``out_dir`` with ``method`` (``bm25`` or ``dense``).

    BM25 params: ``k1`` (1.5), ``b`` (0.75), ``stopwords`` ("en"), ``stemmer`` ("english").
    Dense params: ``model`` (local sentence-transformers path, required), ``query_prefix``
    ("query: "), ``passage_prefix`` ("passage: "), ``batch_size`` (64), ``device`` (None = auto),
    ``max_seq_length`` (None = the model's), ``prebuilt_index`` (adopt an existing faiss index),
    ``index_type`` (flat | hnsw | ivfpq) with ``hnsw_m``, ``nlist``, ``pq_m``, ``train_size``,
    ``nprobe``, ``ef_search`` (see :mod:`.dense`).
    ``workers``: BM25 text analysis in that many processes (same index, faster on many cores).
    ``memory_mb``: BM25 postings budget (default 1/8 of RAM within [256 MB, 4 GB]); postings
    beyond it go to sorted runs on disk, merged at the end, with byte-identical output.
    Returns ``out_dir``. Raises ``FileExistsError`` if it exists and ``overwrite`` is False.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}")
    corpus_path, out_dir = Path(corpus_path), Path(out_dir)
    if not corpus_path.is_file():
        raise FileNotFoundError(f"corpus not found: {corpus_path}")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    if method == "bm25":
        params = bm25.bm25_params(**params)
    else:
        from . import dense

        params = dense.dense_params(**params)

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    started = time.perf_counter()
    digest = hashlib.sha256()
    size = corpus_path.stat().st_size
    try:
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"index {method}", disable=not show_progress) as bar:
            writer = DocWriter(tmp)

            def texts() -> Iterator[str]:
                for doc in iter_corpus(corpus_path, digest=digest, progress=bar):
                    writer.add(doc)
                    yield doc["contents"]

            if method == "bm25":

                def merge_bar(total: int, desc: str) -> Any:
                    return tqdm(total=total, unit="posting", unit_scale=True, desc=desc, disable=not show_progress)

                num_docs = bm25_build.build_bm25(
                    texts(), tmp, params, workers=workers, memory_mb=memory_mb, progress_factory=merge_bar
                )
                files = [DOCS_FILE, OFFSETS_FILE, *bm25.BM25_FILES]
            else:
                num_docs = dense.build_dense(texts(), tmp, params, show_progress=show_progress)
                files = [DOCS_FILE, OFFSETS_FILE, *(f for f in dense.DENSE_FILES if (tmp / f).exists())]
            writer.close()
        if num_docs != len(writer):
            raise RuntimeError(f"indexed {num_docs} documents but stored {len(writer)}")
        write_manifest(
            tmp,
            {
                "format_version": FORMAT_VERSION,
                "method": method,
                "params": params,
                "num_docs": num_docs,
                "corpus_path": str(corpus_path.resolve()),
                "corpus_sha256": digest.hexdigest(),
                "corpus_bytes": size,
                "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "build_seconds": round(time.perf_counter() - started, 3),
                "files": files,
                "sorl_verl_version": _version(),
            },
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _show_progress(flag: bool | None, stream: Any = None) -> bool:
    """``--progress``/``--no-progress`` as given; unset: bars only when ``stream`` (stderr) is a terminal."""
    if flag is not None:
        return flag
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sorl_verl.retrieval.build", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", required=True, help="JSON lines {id, contents} (Search-R1 wiki-18 format)")
    p.add_argument("--out", required=True, help="index directory to create")
    p.add_argument("--method", choices=METHODS, default="bm25")
    p.add_argument("--overwrite", action="store_true", help="replace an existing index directory")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bars on stderr (default: only when stderr is a terminal, so logs hold no carriage returns)",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=1, help="bm25: processes for text analysis (default 1)")
    p.add_argument("--memory-mb", type=float, help="bm25: postings held in memory before spilling sorted runs to disk "
                   f"(default {bm25_build.default_memory_mb()} here: 1/8 of RAM within [256, 4096])")  # fmt: skip
    g = p.add_argument_group("bm25")
    g.add_argument("--k1", type=float)
    g.add_argument("--b", type=float)
    g.add_argument("--stopwords", help='bm25s stopword list name ("en"), or "none"')
    g.add_argument("--stemmer", help='PyStemmer language ("english"), or "none"')
    g = p.add_argument_group("dense")
    g.add_argument(
        "--model", help="local path of a sentence-transformers model (e.g. a download of intfloat/e5-base-v2)"
    )
    g.add_argument("--query-prefix")
    g.add_argument("--passage-prefix")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the model's choice)")
    g.add_argument("--max-seq-length", type=int)
    g.add_argument("--prebuilt-index", help="adopt this faiss index (row i = corpus line i) instead of encoding")
    g.add_argument("--index-type", choices=("flat", "hnsw", "ivfpq"), help="faiss index (default flat, exact)")
    g.add_argument("--hnsw-m", type=int, help="hnsw: links per node (32)")
    g.add_argument("--nlist", type=int, help="ivfpq: inverted lists (4096)")
    g.add_argument("--pq-m", type=int, help="ivfpq: bytes per passage (default: largest divisor of dim <= 64)")
    g.add_argument("--train-size", type=int, help="ivfpq: passages to train on (default 64 x nlist)")
    g.add_argument("--nprobe", type=int, help="ivfpq: lists scanned per query (32; also a serve-time option)")
    g.add_argument("--ef-search", type=int, help="hnsw: search breadth (128; also a serve-time option)")
    a = p.parse_args(argv)
    names = ("k1", "b", "stopwords", "stemmer") if a.method == "bm25" else (
        "model", "query_prefix", "passage_prefix", "batch_size", "device", "max_seq_length", "prebuilt_index",
        "index_type", "hnsw_m", "nlist", "pq_m", "train_size", "nprobe", "ef_search")  # fmt: skip
    params = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    for n in ("stopwords", "stemmer"):
        if params.get(n) == "none":
            params[n] = None
    try:
        out = build_index(
            a.corpus, a.out, a.method, overwrite=a.overwrite, show_progress=_show_progress(a.progress), workers=a.workers,
            memory_mb=a.memory_mb, **params,
        )  # fmt: skip
    except (CorpusFormatError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    print(f"index written to {out}")


if __name__ == "__main__":
    main()
