"""Dense retrieval path with a tiny sentence-transformers model created locally (no download).

The model is a randomly initialised 1-layer BERT with a word-level vocabulary of the corpus,
wrapped with mean pooling: a real SentenceTransformer end to end, just untrained. The tests
pin the plumbing (prefixes, normalization, faiss exact search, manifest, server) against
embeddings computed independently with the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")
st = pytest.importorskip("sentence_transformers")

from sorl_verl.retrieval.build import build_index, main  # noqa: E402
from sorl_verl.retrieval.index import load_searcher  # noqa: E402
from sorl_verl.retrieval.server import serve_in_background  # noqa: E402
from sorl_verl.retrieval.tiny_encoder import make_tiny_encoder  # noqa: E402

ANIMALS = ["otter", "heron", "lynx", "bison", "gecko", "puffin", "walrus", "ibex", "marten", "tapir"]
PLACES = ["marsh", "cliff", "forest", "tundra", "reef", "canyon", "meadow", "delta"]


def _docs() -> list[str]:
    return [f'"{a.title()} of the {p}"\nthe {a} lives in the {p} near stone {i}' for i, (a, p) in
            enumerate((a, p) for a in ANIMALS for p in PLACES)]  # fmt: skip


def _tiny_model(path: Path, docs: list[str]) -> Path:
    words = {w for d in docs for w in d.lower().replace('"', " ").split()}
    model = make_tiny_encoder(path, words)
    tokenizer = st.SentenceTransformer(str(model), device="cpu").tokenizer
    assert tokenizer.unk_token_id not in tokenizer("the otter lives")["input_ids"]  # a real word-level vocabulary
    return model


@pytest.fixture(scope="module")
def dense_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, Path]:
    d = tmp_path_factory.mktemp("dense")
    docs = _docs()
    with open(d / "c.jsonl", "w") as f:
        for i, c in enumerate(docs):
            f.write(json.dumps({"id": f"d{i}", "contents": c}) + "\n")
    model = _tiny_model(d / "model", docs)
    idx = build_index(d / "c.jsonl", d / "index", method="dense", model=str(model), batch_size=16, device="cpu",
                      show_progress=False)  # fmt: skip
    return docs, model, idx


def test_dense_scores_are_cosine_of_prefixed_embeddings(dense_index: tuple[list[str], Path, Path], fp32) -> None:
    docs, model_path, idx = dense_index
    model = st.SentenceTransformer(str(model_path), device="cpu")
    p = model.encode(["passage: " + d for d in docs], normalize_embeddings=True)
    queries = ["otter in the reef", "walrus cliff", "stone 42", "gecko"]
    q = model.encode(["query: " + x for x in queries], normalize_embeddings=True)
    expected = q @ p.T
    # each unit embedding is encoded twice (index/searcher vs here, batched differently): per component
    # within 2 * chain * u of the other (chain: encoder, mean pooling, norm); a score moves by at most
    # the two difference vectors' norms (sqrt(h) * that) plus the h-term dot's own roundings
    h = model[0].auto_model.config.hidden_size
    chain = fp32.transformer_chain(model[0].auto_model.config, model.max_seq_length) + model.max_seq_length + h
    atol = fp32.between(2 * h**0.5, chain) + fp32.between(1.0, h)
    res = load_searcher(idx, device="cpu").search_ids(queries, 5)
    for row, exp in zip(res, expected, strict=True):
        assert [pos for pos, _ in row] == np.argsort(-exp, kind="stable")[:5].tolist()
        np.testing.assert_allclose([s for _, s in row], np.sort(exp)[::-1][:5], rtol=0, atol=atol)


def test_dense_manifest_and_document_alignment(dense_index: tuple[list[str], Path, Path]) -> None:
    docs, model_path, idx = dense_index
    m = json.loads((idx / "manifest.json").read_text())
    assert m["method"] == "dense" and m["num_docs"] == len(docs)
    assert m["params"]["model"] == str(model_path.resolve()) and m["params"]["query_prefix"] == "query: "
    s = load_searcher(idx)
    for row in s.search(["otter marsh", "stone 7", "bison tundra"], 3):  # faiss row i <-> stored document i
        assert len(row) == 3
        assert all(h["contents"] == docs[int(h["id"][1:])] for h in row)


def test_dense_errors(dense_index: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    _, _, idx = dense_index
    corpus = idx / "docs.jsonl"
    with pytest.raises(ValueError, match="model="):
        build_index(corpus, tmp_path / "x", method="dense")
    with pytest.raises(FileNotFoundError, match="download it first"):
        build_index(corpus, tmp_path / "x", method="dense", model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="method"):
        build_index(corpus, tmp_path / "x", method="splade")


def test_dense_cli_and_server(dense_index: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    import urllib.request

    docs, model_path, idx = dense_index
    main(["--corpus", str(idx / "docs.jsonl"), "--out", str(tmp_path / "cli"), "--method", "dense",
          "--model", str(model_path), "--device", "cpu", "--no-progress"])  # fmt: skip
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["params"]["device"] == "cpu"
    main(["--corpus", str(idx / "docs.jsonl"), "--out", str(tmp_path / "cli-hnsw"), "--method", "dense",
          "--model", str(model_path), "--index-type", "hnsw", "--hnsw-m", "8", "--no-progress"])  # fmt: skip
    assert json.loads((tmp_path / "cli-hnsw" / "dense.json").read_text())["index_type"] == "hnsw"
    moved = tmp_path / "moved-model"
    model_path.rename(moved)  # the server can be pointed at the encoder's new place
    try:
        with pytest.raises(FileNotFoundError, match="--model"):
            load_searcher(tmp_path / "cli")
        searcher = load_searcher(tmp_path / "cli", model=str(moved))
    finally:
        moved.rename(model_path)
    with serve_in_background(searcher) as srv:
        req = urllib.request.Request(
            srv.retrieve_url, data=json.dumps({"query": "puffin delta", "topk": 4, "return_scores": True}).encode()
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            row = json.loads(r.read())["result"][0]
    assert len(row) == 4 and [h["score"] for h in row] == sorted((h["score"] for h in row), reverse=True)
    assert all(h["document"]["contents"] in docs for h in row)


def test_prebuilt_faiss_index_is_adopted_not_copied(dense_index: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    docs, model_path, idx = dense_index
    corpus = idx / "docs.jsonl"
    out = build_index(corpus, tmp_path / "pre", method="dense", model=str(model_path),
                      prebuilt_index=str(idx / "dense.faiss"), show_progress=False)  # fmt: skip
    assert not (out / "dense.faiss").exists()
    assert json.loads((out / "dense.json").read_text())["faiss_path"] == str((idx / "dense.faiss").resolve())
    queries = ["heron meadow", "stone 3", "ibex"]
    assert load_searcher(out).search(queries, 4) == load_searcher(idx).search(queries, 4)
    short = tmp_path / "short.jsonl"
    short.write_text("".join(corpus.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(ValueError, match=f"{len(docs) - 1} documents"):
        build_index(short, tmp_path / "bad", method="dense", model=str(model_path),
                    prebuilt_index=str(idx / "dense.faiss"), show_progress=False)  # fmt: skip


def test_concurrent_requests_share_encoder_calls(dense_index: tuple[list[str], Path, Path]) -> None:
    """64 concurrent single-query requests: identical answers, far fewer encoder+index calls than requests."""
    import asyncio

    import aiohttp

    docs, _, idx = dense_index
    queries = [f"{a} {p} stone {i}" for i, (a, p) in enumerate((a, p) for a in ANIMALS for p in PLACES)][:64]
    expected = [[h["id"] for h in row] for row in load_searcher(idx).search(queries, 3)]

    async def burst(url: str) -> list[list[str]]:
        async with aiohttp.ClientSession() as s:

            async def one(q: str) -> list[str]:
                async with s.post(f"{url}/retrieve", json={"query": q, "topk": 3}) as r:
                    assert r.status == 200
                    return [d["id"] for d in (await r.json())["result"][0]]

            return await asyncio.gather(*(one(q) for q in queries))

    for wait_ms, bound in ((20.0, 16), (0.0, 64)):
        searcher = load_searcher(idx)
        with serve_in_background(searcher, batch_wait_ms=wait_ms, max_batch=64) as srv:
            got = asyncio.run(burst(srv.url))
        assert got == expected
        calls = searcher.scorer.calls
        assert (calls <= bound) if wait_ms else (calls == 64), (wait_ms, calls)


def test_hnsw_and_ivfpq_indexes(dense_index: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    docs, model, flat = dense_index
    corpus = flat / "docs.jsonl"
    queries = [f"{a} in the {p}" for a in ANIMALS for p in PLACES[:3]]
    exact = load_searcher(flat).search_ids(queries, 3)
    for kind, extra, min_recall in (("hnsw", {"hnsw_m": 8}, 0.95), ("ivfpq", {"nlist": 4, "pq_m": 16}, 0.6)):
        idx = build_index(corpus, tmp_path / kind, method="dense", model=str(model), index_type=kind,
                          show_progress=False, **extra)  # fmt: skip
        meta = json.loads((idx / "dense.json").read_text())
        assert meta["index_type"] == kind and meta["num_docs"] == len(docs)
        approx = load_searcher(idx, nprobe=4, ef_search=64).search_ids(queries, 3)
        recall = np.mean([len({p for p, _ in a} & {p for p, _ in e}) / 3 for a, e in zip(approx, exact, strict=True)])
        assert recall >= min_recall, (kind, recall)
        assert all(len(row) == 3 and len({p for p, _ in row}) == 3 for row in approx)
    ivf_meta = json.loads((tmp_path / "ivfpq" / "dense.json").read_text())
    assert ivf_meta["nlist"] == 2 and ivf_meta["pq_nbits"] == 6  # 80 passages: 80 // 39 lists, 2**6 <= 80 codewords
    with pytest.raises(ValueError, match="pq_m=5 must divide"):
        build_index(corpus, tmp_path / "bad", method="dense", model=str(model), index_type="ivfpq", pq_m=5,
                    show_progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="index_type"):
        build_index(corpus, tmp_path / "bad", method="dense", model=str(model), index_type="lsh", show_progress=False)


def test_serve_time_options_are_checked(dense_index: tuple[list[str], Path, Path]) -> None:
    _, _, idx = dense_index
    if faiss.get_num_gpus() == 0:
        with pytest.raises(RuntimeError, match="GPU build of faiss"):
            load_searcher(idx, faiss_gpu=True)
    with pytest.raises(ValueError, match="unknown serve-time dense option"):
        load_searcher(idx, index_type="hnsw")
    with pytest.raises(ValueError, match="nprobe=0"):
        load_searcher(idx, nprobe=0)
    with pytest.raises(ValueError, match="intra_op_threads=0"):
        load_searcher(idx, intra_op_threads=0)


def test_dense_threads_reach_the_search_thread_and_batches_equal_single_queries(
    dense_index: tuple[list[str], Path, Path],
) -> None:
    """``intra_op_threads`` holds in the thread that searches; a batch (BLAS path) answers as one query at a time."""
    from concurrent.futures import ThreadPoolExecutor

    docs, _, idx = dense_index
    searcher = load_searcher(idx, intra_op_threads=1)
    queries = [f"{a} {p}" for a in ANIMALS for p in PLACES[:2]]  # 20 queries: >= the BLAS batch size
    with ThreadPoolExecutor(1) as pool:  # as the server does: searches run on worker threads
        batch, threads = pool.submit(lambda: (searcher.search_ids(queries, 3), faiss.omp_get_max_threads())).result()
    assert threads == 1
    singles = [searcher.search_ids([q], 3)[0] for q in queries]
    dim = searcher.scorer.index.d
    for b, s in zip(batch, singles, strict=True):  # unit vectors: a dot product's float32 error <= dim * eps
        assert [d for d, _ in b] == [d for d, _ in s]
        np.testing.assert_allclose([x for _, x in b], [x for _, x in s], rtol=0, atol=dim * np.finfo(np.float32).eps)
    stats = searcher.scorer.stats()
    assert stats["calls"] == 1 + len(queries) and stats["queries"] == 2 * len(queries)
    assert stats["encode_cpu_s"] > 0 and stats["search_cpu_s"] > 0


def test_health_reports_batches_and_encoder_and_index_time(dense_index: tuple[list[str], Path, Path]) -> None:
    import asyncio

    import aiohttp

    _, _, idx = dense_index
    queries = [f"{a} reef" for a in ANIMALS]

    async def burst(url: str) -> dict:
        async with aiohttp.ClientSession() as s:

            async def one(q: str) -> None:
                async with s.post(f"{url}/retrieve", json={"query": q, "topk": 2}) as r:
                    assert r.status == 200

            await asyncio.gather(*(one(q) for q in queries))
            async with s.get(f"{url}/health") as r:
                return (await r.json())["stats"]

    with serve_in_background(load_searcher(idx), batch_wait_ms=50.0, max_batch=64) as srv:
        stats = asyncio.run(burst(srv.url))
    assert stats["batched_queries"] == stats["queries"] == len(queries)
    assert 1 <= stats["batches"] == stats["calls"] < len(queries) and stats["largest_batch"] <= len(queries)
    assert stats["encode_cpu_s"] > 0 and stats["search_cpu_s"] > 0
