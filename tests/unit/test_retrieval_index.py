"""BM25 index building, manifest validation and in-process search (sorl_verl.retrieval)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import bm25s
import numpy as np
import pytest
import Stemmer

from sorl_verl.retrieval.build import build_index, main
from sorl_verl.retrieval.client import NO_RESULTS_TEXT, format_documents
from sorl_verl.retrieval.corpus import CorpusFormatError
from sorl_verl.retrieval.index import load_searcher
from sorl_verl.retrieval.manifest import IndexFormatError

WORDS = [f"w{i}x" for i in range(300)] + ["capital", "river", "mountain", "painter", "founded", "city"]


def _random_corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        body = " ".join(rng.choices(WORDS, weights=[1 / (r + 1) for r in range(len(WORDS))], k=rng.randint(5, 40)))
        docs.append(f'"Entity {i}"\n{body}')
    return docs


def _write(path: Path, docs: list[str]) -> Path:
    with open(path, "w") as f:
        for i, c in enumerate(docs):
            f.write(json.dumps({"id": f"doc-{i}", "contents": c}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, Path]:
    d = tmp_path_factory.mktemp("bm25")
    docs = _random_corpus(400)
    path = _write(d / "corpus.jsonl", docs)
    return docs, path, build_index(path, d / "index", show_progress=False)


# float32 roundings in one term's stored score (idf, length norm, tf saturation), in either implementation
TERM_SCORE_ROUNDINGS = 8


def test_scores_equal_bm25s_lucene(corpus: tuple[list[str], Path, Path], fp32) -> None:
    docs, _, index_dir = corpus
    stem = Stemmer.Stemmer("english")
    ref = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
    ref.index(bm25s.tokenize(docs, stopwords="en", stemmer=stem, show_progress=False), show_progress=False)
    rng = random.Random(1)
    queries = [" ".join(rng.sample(WORDS, 3)) + " of the" for _ in range(50)]
    searcher = load_searcher(index_dir)
    ours = searcher.search_ids(queries, 10)
    for q, hits in zip(queries, ours, strict=True):
        terms = bm25s.tokenize([q], stopwords="en", stemmer=stem, show_progress=False, return_ids=False)[0]
        full = ref.get_scores(terms)
        # two float32 evaluations of a sum of len(terms) positive term scores, each computed independently
        rel = fp32.between(1.0, TERM_SCORE_ROUNDINGS + len(terms))
        assert len(hits) == min(10, int((full > 0).sum()))
        for pos, score in hits:
            assert score == pytest.approx(float(full[pos]), rel=rel)
        kth = hits[-1][1]
        assert (full > kth * (1 + rel)).sum() < len(hits)  # nothing better was left out


def test_index_dir_is_a_bm25s_index(corpus: tuple[list[str], Path, Path], fp32) -> None:
    _, _, index_dir = corpus
    ref = bm25s.BM25.load(index_dir)
    tokens = bm25s.tokenize(
        ["capital river painter"], stopwords="en", stemmer=Stemmer.Stemmer("english"), show_progress=False
    )
    # bm25s.tokenize numbers terms itself: map back through its vocab to strings
    inv = {v: k for k, v in tokens.vocab.items()}
    q = [[inv[i] for i in tokens.ids[0]]]
    docs, scores = ref.retrieve(q, k=5, show_progress=False)
    every = ref.get_scores(q[0])  # bm25s's score of every passage
    ours = load_searcher(index_dir).search_ids(["capital river painter"], 5)[0]
    ids, mine = [p for p, _ in ours], [s for _, s in ours]
    rel = fp32.between(1.0, len(q[0]))  # the same stored float32 term scores, summed in two orders
    np.testing.assert_allclose(mine, scores[0], rtol=rel)  # the same top-5 scores, rank by rank
    np.testing.assert_allclose(every[ids], mine, rtol=rel)  # and each passage scores what bm25s gives it
    # the same passages, but where two scores tie within that rounding (their order is the summation's)
    tie = rel * float(np.max(np.abs(scores[0])))
    for rank, (p, theirs) in enumerate(zip(ids, docs[0].tolist(), strict=True)):
        assert p == theirs or abs(float(every[p]) - float(every[theirs])) <= tie, (rank, p, theirs, every[[p, theirs]])


def test_search_results_shape_order_and_topk(corpus: tuple[list[str], Path, Path]) -> None:
    docs, _, index_dir = corpus
    s = load_searcher(index_dir)
    res = s.search(["capital city", "w0x w1x", "nothingmatches", ""], 4)
    assert len(res) == 4
    for row in res[:2]:
        assert len(row) == 4
        assert [h["score"] for h in row] == sorted((h["score"] for h in row), reverse=True)
        for h in row:
            assert set(h) == {"id", "contents", "score"}
            assert h["contents"] == docs[int(h["id"].split("-")[1])]
    assert res[2] == [] and res[3] == []
    assert len(s.search(["w0x"], 10_000)[0]) == sum("w0x" in d.split() for d in docs)
    assert s.search([], 3) == []


def test_threaded_and_mmap_scoring_match_default(corpus: tuple[list[str], Path, Path]) -> None:
    _, _, index_dir = corpus
    queries = [f"w{i}x w{i + 7}x capital" for i in range(64)]
    expected = load_searcher(index_dir).search_ids(queries, 5)
    assert load_searcher(index_dir, n_threads=2).search_ids(queries, 5) == expected
    assert load_searcher(index_dir, mmap=True).search_ids(queries, 5) == expected


def test_manifest_records_corpus_and_params(corpus: tuple[list[str], Path, Path]) -> None:
    _, path, index_dir = corpus
    m = json.loads((index_dir / "manifest.json").read_text())
    assert m["method"] == "bm25" and m["num_docs"] == 400
    assert m["corpus_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert m["params"] == {"k1": 1.5, "b": 0.75, "stopwords": "en", "stemmer": "english"}
    assert m["created"].endswith("+00:00")


def test_loading_validates_manifest(corpus: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    _, path, _ = corpus
    idx = build_index(path, tmp_path / "idx", show_progress=False, k1=1.2)
    m = json.loads((idx / "manifest.json").read_text())
    (idx / "manifest.json").write_text(json.dumps({**m, "num_docs": 399}))
    with pytest.raises(IndexFormatError, match="399"):
        load_searcher(idx)
    (idx / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k != "corpus_sha256"}))
    with pytest.raises(IndexFormatError, match="corpus_sha256"):
        load_searcher(idx)
    (idx / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(IndexFormatError, match="rebuild"):
        load_searcher(idx)
    (idx / "manifest.json").write_text(json.dumps(m))
    (idx / "vocab.index.json").unlink()
    with pytest.raises(IndexFormatError, match="vocab.index.json"):
        load_searcher(idx)
    with pytest.raises(IndexFormatError, match="not an index directory"):
        load_searcher(tmp_path)


def test_build_refuses_to_clobber_and_checks_params(corpus: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    _, path, _ = corpus
    out = build_index(path, tmp_path / "i", show_progress=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        build_index(path, out, show_progress=False)
    build_index(path, out, show_progress=False, overwrite=True, b=0.0)
    assert json.loads((out / "manifest.json").read_text())["params"]["b"] == 0.0
    with pytest.raises(ValueError, match="k1x"):
        build_index(path, tmp_path / "j", show_progress=False, k1x=1)
    with pytest.raises(ValueError, match="0 <= b <= 1"):
        build_index(path, tmp_path / "j", show_progress=False, b=2.0)
    assert not (tmp_path / "j").exists() and not list(tmp_path.glob(".j.tmp-*"))


def test_corpus_variants_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text(
        json.dumps({"title": "Ada Lovelace", "text": "wrote the first program"})
        + "\n\n"
        + json.dumps({"contents": "plain"})
        + "\n"
    )
    s = load_searcher(build_index(p, tmp_path / "i", show_progress=False))
    hit = s.search(["program"], 1)[0][0]
    assert hit["contents"] == '"Ada Lovelace"\nwrote the first program' and hit["id"] == "0"
    assert s.search(["plain"], 1)[0][0]["id"] == "2"  # default id: line number
    p.write_text(json.dumps({"contents": "ok"}) + "\n{broken\n")
    with pytest.raises(CorpusFormatError, match=r"c.*\.jsonl line 2: invalid JSON"):
        build_index(p, tmp_path / "k", show_progress=False)
    p.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(CorpusFormatError, match="contents"):
        build_index(p, tmp_path / "k", show_progress=False)


def test_cli_builds_an_index(
    corpus: tuple[list[str], Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path, _ = corpus
    main(["--corpus", str(path), "--out", str(tmp_path / "cli"), "--k1", "0.9", "--stemmer", "none", "--no-progress"])
    assert "index written" in capsys.readouterr().out
    m = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert m["params"] == {"k1": 0.9, "b": 0.75, "stopwords": "en", "stemmer": None}
    assert load_searcher(tmp_path / "cli").search(["capital"], 2)[0]


def test_format_documents_search_r1_style() -> None:
    docs = [
        {"id": "1", "contents": '"Paris"\nParis is the capital.\nSecond line.'},
        {"document": {"contents": "no title"}, "score": 1.0},
    ]
    assert (
        format_documents(docs) == 'Doc 1(Title: "Paris") Paris is the capital.\nSecond line.\nDoc 2(Title: no title) '
    )
    assert format_documents([]) == NO_RESULTS_TEXT


@pytest.mark.parametrize("k", [1, 3, 10])
def test_maxscore_pruning_equals_exhaustive_scoring(corpus: tuple[list[str], Path, Path], k: int, fp32) -> None:
    from sorl_verl.retrieval.bm25 import BM25Scorer

    _, _, index_dir = corpus
    params = json.loads((index_dir / "manifest.json").read_text())["params"]
    rng = random.Random(k)
    # mixes of rare and frequent terms, repeated terms (weight 2), unknown words
    queries = [" ".join(rng.choices(WORDS, k=rng.randint(1, 7))) + rng.choice(["", " unknownword"]) for _ in range(300)]
    exhaustive = BM25Scorer(index_dir, params, strategy="matmul").topk_ids(queries, k)
    pruned = BM25Scorer(index_dir, params, strategy="maxscore")
    # (sample size, "short list" length, exhaustive-path threshold): the small values force the
    # pruning, sampling and long-list code paths on this small corpus; the last row is the default
    for sample, short, exhaustive_max in [(8, 40, 0), (512, 10**6, 0), (3, 0, 0), (512, 65536, 8192)]:
        pruned.theta_sample, pruned.short_list, pruned.exhaustive_postings = sample, short, exhaustive_max
        got = pruned.topk_ids(queries, k)
        for a, b in zip(got, exhaustive, strict=True):
            assert [d for d, _ in a] == [d for d, _ in b]
            # the same stored float32 term scores (<= 8 distinct query terms), summed in two orders
            np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=fp32.between(1.0, 8))
    assert BM25Scorer(index_dir, params).strategy == "maxscore"  # the default
    with pytest.raises(ValueError, match="strategy"):
        BM25Scorer(index_dir, params, strategy="wand")


def test_parallel_build_is_byte_identical(corpus: tuple[list[str], Path, Path], tmp_path: Path) -> None:
    from sorl_verl.retrieval.bm25 import BM25_FILES, bm25_params
    from sorl_verl.retrieval.bm25_build import BM25Builder

    docs, _, _ = corpus
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        out.mkdir()
        builder = BM25Builder(bm25_params(), out, chunk_docs=37, workers=workers)  # many chunks, merged in order
        for d in docs:
            builder.add(d)
        builder.save(out)
        assert builder.num_docs == len(docs)
        outs.append(out)
    for name in BM25_FILES:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    # and the CLI flag reaches it: same files as the single-process index of the fixture
    main(["--corpus", str(corpus[1]), "--out", str(tmp_path / "cli"), "--workers", "2", "--no-progress"])
    for name in BM25_FILES[:3]:
        assert (tmp_path / "cli" / name).read_bytes() == (corpus[2] / name).read_bytes(), name


def test_analyzer_matches_bm25s_and_keeps_its_cache_bounded() -> None:
    from sorl_verl.retrieval.analyzer import Analyzer

    texts = ["The runners were running quickly, to the hills!", "Émile's café in Zürich: 2019 reviews", "a I x"]
    ref = bm25s.tokenize(
        texts, stopwords="en", stemmer=Stemmer.Stemmer("english"), show_progress=False, return_ids=False
    )
    analyzer = Analyzer()
    analyzer.max_cache = 3
    assert [analyzer.stems(t) for t in texts] == [list(r) for r in ref[:2]] + [[]]
    assert len(analyzer._cache) <= 3


def test_doc_store_get_many_equals_reading_one_by_one(corpus: tuple[list[str], Path, Path]) -> None:
    from sorl_verl.retrieval.corpus import DocStore

    _, _, index_dir = corpus
    store = DocStore(index_dir)
    rng = random.Random(0)
    positions = [rng.randrange(len(store)) for _ in range(50)] + [0, 0, len(store) - 1]
    assert store.get_many(positions) == [store[i] for i in positions]
    assert store.get_many([]) == []
    for bad in (len(store), -1):
        with pytest.raises(IndexError, match="outside"):
            store.get_many([0, bad])
