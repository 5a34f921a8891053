"""Dense retrieval: a sentence-transformers encoder from a local path + a faiss index.

Passages are encoded as ``passage_prefix + contents`` and queries as ``query_prefix + query``
(e5 convention: ``"passage: "`` / ``"query: "``), L2-normalized, and scored by inner product,
i.e. cosine similarity. ``index_type`` picks the faiss index:

- ``flat`` (default): ``IndexFlatIP``, exact search, as Search-R1's e5 index; 4 * dim bytes
  per passage in RAM (65 GB for wiki-18 with e5-base) and a full scan per query batch.
- ``hnsw``: ``IndexHNSWFlat`` (``hnsw_m`` links per node, ``ef_search`` breadth); the flat
  vectors plus the graph (~8 * hnsw_m bytes per passage), sub-linear CPU search, approximate.
- ``ivfpq``: ``IVF{nlist},PQ{pq_m}x8``: ``pq_m`` bytes per passage (64 B -> 1.3 GB for
  wiki-18), ``nprobe`` of the ``nlist`` inverted lists scanned per query, approximate. The
  coarse quantizer and codebooks are trained on the first ``train_size`` passages.

``faiss_gpu`` (serve time) moves a flat or IVF index onto every visible GPU (sharded), which
needs a GPU build of faiss.
Needs the ``dense`` extra: ``pip install "sorl-verl[dense]"``. No model is downloaded: ``model``
must be a local directory (e.g. a download of ``intfloat/e5-base-v2``).

``prebuilt_index``: adopt an existing faiss index whose row i embeds corpus line i (e.g.
Search-R1's ``e5_Flat.index`` for wiki-18) instead of encoding the corpus; it is referenced by
absolute path, not copied, and must hold as many vectors as the corpus has documents.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from .manifest import IndexFormatError

FAISS_FILE = "dense.faiss"
DENSE_META_FILE = "dense.json"
DENSE_FILES = (FAISS_FILE, DENSE_META_FILE)

DEFAULT_PARAMS: dict[str, Any] = {
    "model": None,
    "query_prefix": "query: ",
    "passage_prefix": "passage: ",
    "batch_size": 64,
    "device": None,
    "max_seq_length": None,
    "prebuilt_index": None,
    "index_type": "flat",
    "hnsw_m": 32,
    "nlist": 4096,
    "pq_m": None,  # None: the largest divisor of dim that is <= 64
    "train_size": None,  # None: 64 * nlist passages
    "nprobe": 32,
    "ef_search": 128,
    "intra_op_threads": None,  # torch and faiss threads per search (None: their defaults); serve time
}
INDEX_TYPES = ("flat", "hnsw", "ivfpq")
SERVE_OPTIONS = (
    "device",
    "model",
    "faiss_gpu",
    "nprobe",
    "ef_search",
    "intra_op_threads",
)  # may differ from the build's values
ENCODE_CHUNK = 4096  # passages per encode call while building (bounds memory)
# Flat search of a batch: faiss's default path scans the vectors once per query (~2.7 ms per query
# at 200k x 64 on one core here, whatever the batch), its BLAS path once per batch (~9 ms + ~0.45
# ms per query). Batches of at least FLAT_BLAS_MIN_BATCH queries take the BLAS path.
FLAT_BLAS_MIN_BATCH = 8
FLAT_BLAS_THRESHOLD = 20  # faiss.cvar.distance_compute_blas_threshold then (measured: 1.5 ms/query at 8, 0.5 at 64)


def dense_params(**overrides: Any) -> dict[str, Any]:
    """Default dense parameters updated with ``overrides``; checks names and the model path."""
    unknown = set(overrides) - set(DEFAULT_PARAMS)
    if unknown:
        raise ValueError(f"unknown dense parameter(s) {sorted(unknown)}; known: {sorted(DEFAULT_PARAMS)}")
    params = {**DEFAULT_PARAMS, **overrides}
    if not params["model"]:
        raise ValueError("dense retrieval needs model=<local sentence-transformers directory> (CLI: --model)")
    if not Path(params["model"]).is_dir():
        raise FileNotFoundError(
            f"dense model directory not found: {params['model']}; download it first, e.g. "
            "`hf download intfloat/e5-base-v2 --local-dir models/e5-base-v2`"
        )
    params["model"] = str(Path(params["model"]).resolve())
    if params["prebuilt_index"]:
        if not Path(params["prebuilt_index"]).is_file():
            raise FileNotFoundError(f"prebuilt faiss index not found: {params['prebuilt_index']}")
        params["prebuilt_index"] = str(Path(params["prebuilt_index"]).resolve())
    if int(params["batch_size"]) < 1:
        raise ValueError("batch_size must be >= 1")
    if params["index_type"] not in INDEX_TYPES:
        raise ValueError(f"unknown index_type {params['index_type']!r}; choose from {list(INDEX_TYPES)}")
    positive = ("hnsw_m", "nlist", "pq_m", "train_size", "nprobe", "ef_search")
    bad = [n for n in positive if params[n] is not None and int(params[n]) < 1]
    if bad:
        raise ValueError(f"dense parameters must be >= 1: {', '.join(f'{n}={params[n]}' for n in bad)}")
    return params


def serve_params(built: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Build-time parameters with serve-time ``overrides`` (only :data:`SERVE_OPTIONS`) applied."""
    unknown = set(overrides) - set(SERVE_OPTIONS)
    if unknown:
        raise ValueError(f"unknown serve-time dense option(s) {sorted(unknown)}; known: {list(SERVE_OPTIONS)}")
    bad = [
        n for n in ("nprobe", "ef_search", "intra_op_threads") if overrides.get(n) is not None and int(overrides[n]) < 1
    ]
    if bad:
        raise ValueError(f"dense options must be >= 1: {', '.join(f'{n}={overrides[n]}' for n in bad)}")
    return {**DEFAULT_PARAMS, **built, **{k: v for k, v in overrides.items() if v is not None}}


def auto_pq_m(dim: int) -> int:
    """Largest divisor of ``dim`` that is <= 64 (bytes per PQ code)."""
    return max(m for m in range(1, min(dim, 64) + 1) if dim % m == 0)


def load_encoder(params: dict[str, Any]) -> Any:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise ImportError('dense retrieval needs the dense extra: pip install "sorl-verl[dense]"') from e
    model = SentenceTransformer(params["model"], device=params["device"], local_files_only=True)
    if params["max_seq_length"]:
        model.max_seq_length = int(params["max_seq_length"])
    return model


def embedding_dim(model: Any) -> int:
    """Output dimension of a SentenceTransformer (method renamed in sentence-transformers 6)."""
    fn = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(fn())


def encode(model: Any, texts: list[str], prefix: str, batch_size: int) -> np.ndarray:
    """L2-normalized float32 embeddings of ``prefix + text``."""
    emb = model.encode(
        [prefix + t for t in texts],
        batch_size=batch_size,
        convert_to_numpy=True,
        normalize_embeddings=True,
        show_progress_bar=False,
    )
    return np.ascontiguousarray(emb, dtype=np.float32)


def _chunks(it: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(it)
    while chunk := list(islice(it, n)):
        yield chunk


def build_dense(texts: Iterable[str], out_dir: Path, params: dict[str, Any], show_progress: bool = True) -> int:
    """Encode ``texts`` into a flat inner-product faiss index (or adopt ``prebuilt_index``).

    Writes ``dense.json`` (dimension, size, where the faiss index is) and, when encoding,
    ``dense.faiss``; returns the number of documents.
    """
    import faiss

    model = load_encoder(params)
    dim = embedding_dim(model)
    if params["prebuilt_index"]:
        num_texts = sum(1 for _ in texts)  # still streams the corpus into the document store
        index = faiss.read_index(params["prebuilt_index"], faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
        if index.ntotal != num_texts or index.d != dim:
            raise ValueError(
                f"prebuilt index {params['prebuilt_index']} has {index.ntotal} vectors of dimension {index.d}; "
                f"the corpus has {num_texts} documents and the model gives dimension {dim}"
            )
        faiss_path = params["prebuilt_index"]
    else:
        batches = (
            encode(model, c, params["passage_prefix"], int(params["batch_size"])) for c in _chunks(texts, ENCODE_CHUNK)
        )
        index = build_faiss_index(batches, dim, params)
        faiss.write_index(index, str(out_dir / FAISS_FILE))
        faiss_path = FAISS_FILE
    meta = {"dim": dim, "num_docs": int(index.ntotal), "faiss_path": faiss_path, "metric": "inner_product"}
    meta["index_type"] = params["index_type"] if not params["prebuilt_index"] else type(index).__name__
    if params["index_type"] == "ivfpq" and not params["prebuilt_index"]:
        ivf = faiss.extract_index_ivf(index)
        pq = faiss.downcast_index(ivf).pq
        meta.update(nlist=int(ivf.nlist), pq_m=int(pq.M), pq_nbits=int(pq.nbits))
    (out_dir / DENSE_META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return int(index.ntotal)


def build_faiss_index(batches: Iterable[np.ndarray], dim: int, params: dict[str, Any]) -> Any:
    """A faiss inner-product index of ``params["index_type"]`` holding the embedding ``batches`` in order."""
    import faiss

    kind = params["index_type"]
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, int(params["hnsw_m"]), faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = max(40, 2 * int(params["hnsw_m"]))
    else:
        return _build_ivfpq(iter(batches), dim, params)
    for emb in batches:
        index.add(emb)
    return index


def _build_ivfpq(batches: Iterator[np.ndarray], dim: int, params: dict[str, Any]) -> Any:
    import faiss

    nlist = int(params["nlist"])
    pq_m = int(params["pq_m"] or auto_pq_m(dim))
    if dim % pq_m:
        raise ValueError(f"pq_m={pq_m} must divide the embedding dimension {dim}")
    train_size = int(params["train_size"] or 64 * nlist)
    head, n_head = [], 0
    for emb in batches:  # the first train_size passages train the quantizers
        head.append(emb)
        n_head += len(emb)
        if n_head >= train_size:
            break
    train = np.concatenate(head) if head else np.zeros((0, dim), np.float32)
    if len(train) < 2:
        raise ValueError(f"ivfpq needs at least 2 passages to train on, got {len(train)}")
    nlist = max(1, min(nlist, len(train) // 39))  # faiss k-means wants >= 39 points per list
    nbits = min(8, int(np.log2(len(train))))  # 256 codewords per sub-quantizer, fewer for a tiny corpus
    index = faiss.index_factory(dim, f"IVF{nlist},PQ{pq_m}x{nbits}", faiss.METRIC_INNER_PRODUCT)
    index.train(train[:train_size])
    index.add(train)
    del train, head
    for emb in batches:
        index.add(emb)
    return index


def _set_search_params(index: Any, params: dict[str, Any]) -> None:
    import faiss

    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        ivf = None
    if ivf is not None:
        ivf.nprobe = int(params["nprobe"])
    hnsw = getattr(faiss.downcast_index(index), "hnsw", None)
    if hnsw is not None:
        hnsw.efSearch = int(params["ef_search"])


def to_gpus(index: Any) -> Any:
    """``index`` sharded over every visible GPU; a clear error without GPU faiss or a GPU."""
    import faiss

    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if not hasattr(faiss, "StandardGpuResources") or gpus < 1:
        raise RuntimeError(
            f"--faiss-gpu needs a GPU build of faiss and a visible GPU; this faiss {faiss.__version__} sees {gpus} "
            "GPU(s) (install faiss-gpu, e.g. `conda install -c pytorch faiss-gpu`, or drop --faiss-gpu)"
        )
    if getattr(faiss.downcast_index(index), "hnsw", None) is not None:
        raise ValueError("faiss has no GPU HNSW index; serve an hnsw index without --faiss-gpu, or build flat/ivfpq")
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    return faiss.index_cpu_to_all_gpus(index, options)


class DenseScorer:
    """Top-k cosine similarity between encoded queries and the indexed passages."""

    def __init__(self, index_dir: str | Path, params: dict[str, Any]) -> None:
        import faiss

        index_dir = Path(index_dir)
        self.params = params
        meta = json.loads((index_dir / DENSE_META_FILE).read_text(encoding="utf-8"))
        faiss_path = index_dir / meta["faiss_path"]  # an absolute path stays absolute
        if not faiss_path.is_file():
            raise IndexFormatError(f"{index_dir}: faiss index {faiss_path} is missing")
        if not Path(params["model"]).is_dir():
            raise FileNotFoundError(
                f"dense encoder directory not found: {params['model']}; if it moved, pass its new place "
                "(load_searcher(..., model=DIR), server: --model DIR)"
            )
        self._faiss_threads = int(params["intra_op_threads"] or 0)
        if self._faiss_threads:  # torch's is process-wide (the server process runs one scorer)
            import torch

            torch.set_num_threads(self._faiss_threads)
        self.index = faiss.read_index(str(faiss_path))
        _set_search_params(self.index, params)
        if params.get("faiss_gpu"):
            self.index = to_gpus(self.index)
        self.num_docs = int(self.index.ntotal)
        self._flat = isinstance(faiss.downcast_index(self.index), faiss.IndexFlat)
        self._blas_default = int(faiss.cvar.distance_compute_blas_threshold)
        self.model = load_encoder(params)
        dim = embedding_dim(self.model)
        if dim != self.index.d:
            raise IndexFormatError(
                f"{index_dir}: index has dimension {self.index.d}, model {params['model']} gives {dim}"
            )
        self._lock = threading.Lock()  # one encode at a time: the model already uses every core
        self.calls = 0  # encoder forwards + index searches made (one per call)
        self.queries = 0
        self.encode_cpu_s = 0.0  # CPU time of the calling thread in encoder forwards (all of it with 1 thread)
        self.search_cpu_s = 0.0  # ... and in index searches

    def stats(self) -> dict[str, float]:
        """Calls, queries, and the searching thread's CPU seconds in the encoder and in the index."""
        return {"calls": self.calls, "queries": self.queries, "encode_cpu_s": self.encode_cpu_s,
                "search_cpu_s": self.search_cpu_s}  # fmt: skip

    def topk_ids(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        import faiss

        if k <= 0 or not queries:
            return [[] for _ in queries]
        with self._lock:
            if self._faiss_threads:  # OpenMP's thread count is per calling thread: set it in this (worker) thread
                faiss.omp_set_num_threads(self._faiss_threads)
            t0 = time.thread_time()
            q = encode(self.model, queries, self.params["query_prefix"], int(self.params["batch_size"]))
            t1 = time.thread_time()
            if self._flat:  # a batch goes through one matrix product (BLAS) instead of one scan per query
                faiss.cvar.distance_compute_blas_threshold = (
                    FLAT_BLAS_THRESHOLD if len(q) >= FLAT_BLAS_MIN_BATCH else self._blas_default
                )
            scores, ids = self.index.search(q, k)
            t2 = time.thread_time()
            self.calls += 1
            self.queries += len(queries)
            self.encode_cpu_s += t1 - t0
            self.search_cpu_s += t2 - t1
        return [
            [(int(i), float(s)) for i, s in zip(row_i, row_s, strict=True) if i >= 0]
            for row_i, row_s in zip(ids, scores, strict=True)
        ]
