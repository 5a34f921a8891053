"""The compiled MaxScore kernel (:mod:`sorl_verl.retrieval.bm25_kernel`) returns the numpy scorer's top-k.

Identical means: the same documents in the same order (score descending, ties by smaller
document) and the same float32 scores, bit for bit. Indexes are written directly in the bm25s
layout so that the tests control ties (scores drawn from a few values), list lengths and
repeated query terms; small ``theta_sample`` / ``short_list`` / ``exhaustive_postings`` and
small blocks force every path of both scorers on small corpora.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
from pathlib import Path

import numba  # noqa: F401 - a declared dependency: a missing or broken numba fails here, never skips
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_verl.retrieval import bm25_kernel
from sorl_verl.retrieval.bm25 import DEFAULT_PARAMS, BM25Scorer
from sorl_verl.retrieval.build import build_index

# (theta sample, "short list" length, exhaustive-path threshold): small values force every path
SETTINGS = [(8, 40, 0), (512, 10**6, 0), (3, 0, 0), (64, 300, 200), (512, 65536, 8192)]


def write_index(directory: Path, lists: list[tuple[np.ndarray, np.ndarray]], num_docs: int) -> Path:
    """A BM25 index in bm25s' layout from per-term ``(sorted doc ids, float32 scores)``; terms named ``w<i>``."""
    indptr = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(d) for d, _ in lists], out=indptr[1:])
    docs = np.concatenate([d for d, _ in lists] + [np.zeros(0, np.int32)]).astype(np.int32)
    vals = np.concatenate([v for _, v in lists] + [np.zeros(0, np.float32)]).astype(np.float32)
    np.save(directory / "data.csc.index.npy", vals)
    np.save(directory / "indices.csc.index.npy", docs)
    np.save(directory / "indptr.csc.index.npy", indptr)
    (directory / "vocab.index.json").write_text(json.dumps({f"w{i}": i for i in range(len(lists))}))
    (directory / "params.index.json").write_text(json.dumps({"num_docs": num_docs}))
    return directory


def random_lists(seed: int, num_docs: int, n_terms: int, n_values: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Posting lists of random densities (some empty, some full); scores from ``n_values`` values (0: continuous)."""
    rng = np.random.default_rng(seed)
    palette = rng.uniform(0.1, 4.0, size=max(1, n_values)).astype(np.float32)
    lists = []
    for _ in range(n_terms):
        density = rng.choice([0.0, 0.02, 0.1, 0.5, 1.0])
        docs = np.flatnonzero(rng.random(num_docs) < density).astype(np.int32)
        if n_values:
            vals = palette[rng.integers(0, len(palette), size=len(docs))]
        else:
            vals = rng.uniform(0.05, 5.0, size=len(docs)).astype(np.float32)
        lists.append((docs, vals))
    return lists


class SmallBlocks(BM25Scorer):
    """Blocks of 4 postings: block maxima bite on small lists."""

    kernel_block = 4


def scorer_pair(index_dir: Path, setting: tuple[int, int, int], small_blocks: bool) -> tuple[BM25Scorer, BM25Scorer]:
    kernel_cls = SmallBlocks if small_blocks else BM25Scorer
    pair = (
        BM25Scorer(index_dir, DEFAULT_PARAMS, strategy="maxscore-numpy"),
        kernel_cls(index_dir, DEFAULT_PARAMS, mmap=True, strategy="maxscore"),
    )
    assert not pair[0].compiled and pair[1].compiled
    for s in pair:
        s.theta_sample, s.short_list, s.exhaustive_postings = setting
    return pair


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_docs=st.integers(1, 400),
    n_terms=st.integers(1, 8),
    n_values=st.sampled_from([0, 1, 2, 5]),
    queries=st.lists(st.lists(st.integers(0, 7), max_size=9), min_size=1, max_size=6),
    k=st.integers(1, 25),
    setting=st.sampled_from(SETTINGS),
    small_blocks=st.booleans(),
    window=st.sampled_from([1, 7, 64, 8192]),
    accumulate=st.sampled_from([0.0, 2.0, 1e9]),
)
def test_random_index_top_k_is_identical_to_numpy(
    seed: int,
    num_docs: int,
    n_terms: int,
    n_values: int,
    queries: list[list[int]],
    k: int,
    setting: tuple[int, int, int],
    small_blocks: bool,
    window: int,
    accumulate: float,
) -> None:
    """Random postings, ties (few distinct scores), repeated and absent terms, k above the hits; windows from
    one document to more than the corpus, non-essential lists all probed (0), by length (2) or all read (1e9)."""
    with tempfile.TemporaryDirectory() as d:
        index_dir = write_index(Path(d), random_lists(seed, num_docs, n_terms, n_values), num_docs)
        numpy_scorer, kernel_scorer = scorer_pair(index_dir, setting, small_blocks)
        kernel_scorer.kernel_window, kernel_scorer.kernel_accumulate = window, accumulate
        for q in queries:
            terms = [t for t in q if t < n_terms]
            expected = numpy_scorer._topk_maxscore_one(terms, k)
            got = kernel_scorer._topk_maxscore_one(terms, k)
            assert got == expected, (terms, k)


def reference_plan(scorer: BM25Scorer, term_ids: list[int], k: int) -> tuple[list[int], int, float]:
    """``(non-empty terms in order, n_non, tau0)`` composed from the numpy scorer's own methods."""
    terms, counts, bounds, starts, ends = scorer._query_terms(term_ids)
    lengths = ends - starts
    nonempty = terms[lengths > 0].tolist()
    n_lists = len(nonempty)
    if n_lists <= 1 or int(lengths.sum()) <= scorer.exhaustive_postings:
        return nonempty, 0, 0.0
    slices = [(int(a), int(b), float(w)) for a, b, w in zip(starts, ends, counts, strict=True) if b > a]
    theta = scorer._theta(slices, starts, ends, counts, k)
    n_prefix = int(np.searchsorted(np.cumsum(bounds), theta, side="left"))
    if not lengths[n_prefix:].any():
        return nonempty, 0, 0.0
    rel = (n_lists + 2) * 2.0**-23
    return nonempty, int(np.count_nonzero(lengths[:n_prefix])), theta * (1.0 - 2.0 * rel)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_docs=st.integers(1, 300),
    n_terms=st.integers(1, 8),
    n_values=st.sampled_from([0, 1, 3]),
    queries=st.lists(st.lists(st.integers(0, 7), max_size=9), min_size=1, max_size=6),
    k=st.integers(1, 12),
    setting=st.sampled_from(SETTINGS),
)
def test_compiled_plan_is_the_numpy_scorers_decision(
    seed: int,
    num_docs: int,
    n_terms: int,
    n_values: int,
    queries: list[list[int]],
    k: int,
    setting: tuple[int, int, int],
) -> None:
    """``plan_query`` orders the terms, splits them and bounds theta exactly as the numpy scorer does."""
    with tempfile.TemporaryDirectory() as d:
        index_dir = write_index(Path(d), random_lists(seed, num_docs, n_terms, n_values), num_docs)
        numpy_scorer, kernel_scorer = scorer_pair(index_dir, setting, small_blocks=False)
        sample, short_list, exhaustive = setting
        for q in queries:
            term_ids = [t for t in q if t < n_terms]
            expected = reference_plan(numpy_scorer, term_ids, k)
            for _ in range(2):  # the second time with the k-th largest scores cached
                plan = bm25_kernel.plan_query(
                    kernel_scorer.indices, kernel_scorer.data, kernel_scorer.indptr, kernel_scorer.max_score,
                    kernel_scorer._kth_table(k), np.array(term_ids, np.int64), k, short_list, sample, exhaustive,
                )  # fmt: skip
                terms, starts, ends, w, ub, n_non, tau0 = plan
                assert (terms.tolist(), n_non, tau0) == expected, (term_ids, k)
                np.testing.assert_array_equal(starts, kernel_scorer.indptr[terms])
                np.testing.assert_array_equal(ends, kernel_scorer.indptr[terms + 1])
                assert np.all(ends > starts) and np.all(np.diff(ub) >= 0)


@given(values=st.lists(st.floats(0, 100, width=32), min_size=1, max_size=300), data=st.data())
def test_kth_largest_is_the_partition_value(values: list[float], data: st.DataObject) -> None:
    arr = np.array(values, np.float32)
    start = data.draw(st.integers(0, len(arr) - 1))
    end = data.draw(st.integers(start + 1, len(arr)))
    k = data.draw(st.integers(1, end - start))
    expected = np.partition(arr[start:end], end - start - k)[end - start - k]
    assert bm25_kernel.kth_largest(arr, start, end, k) == expected


def test_max_score_and_block_maxima_match_numpy(tmp_path: Path) -> None:
    lists = random_lists(7, 1000, 12, 0)
    index_dir = write_index(tmp_path, lists, 1000)
    numpy_scorer, kernel_scorer = scorer_pair(index_dir, SETTINGS[-1], small_blocks=True)
    np.testing.assert_array_equal(kernel_scorer.max_score, numpy_scorer.max_score)
    block = kernel_scorer.kernel_block
    for t, (docs, vals) in enumerate(lists):
        first, last = kernel_scorer._bbase[t], kernel_scorer._bbase[t + 1]
        assert last - first == -(-len(docs) // block)
        for j in range(last - first):
            assert kernel_scorer._bmax[first + j] == vals[j * block : (j + 1) * block].max()
            assert kernel_scorer._blast[first + j] == docs[min((j + 1) * block, len(docs)) - 1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_theta_sample_matches_the_numpy_lookup(tmp_path: Path, k: int) -> None:
    lists = random_lists(3, 2000, 6, 3)
    index_dir = write_index(tmp_path, lists, 2000)
    numpy_scorer, kernel_scorer = scorer_pair(index_dir, SETTINGS[-1], small_blocks=False)
    rng = random.Random(k)
    for _ in range(50):
        sample = np.unique(np.array(rng.sample(range(2000), rng.randint(k, 300)), dtype=np.int32))
        if len(sample) < k:
            continue
        terms = rng.sample(range(6), rng.randint(1, 6))
        slices = [
            (int(kernel_scorer.indptr[t]), int(kernel_scorer.indptr[t + 1]), float(rng.randint(1, 3))) for t in terms
        ]
        slices = [sl for sl in slices if sl[1] > sl[0]] or [(0, 0, 1.0)]
        a = np.array(slices, dtype=np.float64).reshape(-1, 3)
        starts, ends, w = a[:, 0].astype(np.int64), a[:, 1].astype(np.int64), a[:, 2].astype(np.float32)
        got = bm25_kernel.sample_kth(kernel_scorer.indices, kernel_scorer.data, sample, starts, ends, w, k)
        assert float(got) == numpy_scorer._sample_kth(sample, slices, k)


def test_score_is_the_numpy_fold_not_another_order(tmp_path: Path) -> None:
    """Three terms whose float32 sum depends on the order: the kernel must give the numpy scorer's bits."""
    a, b, c = np.float32(1.0), np.float32(2**-24), np.float32(2**-24)  # (a + b) + c != a + (b + c)
    assert (a + b) + c != a + (b + c)
    docs = np.array([0, 1, 2], dtype=np.int32)
    lists = [(docs, np.full(3, x, np.float32)) for x in (b, c, a)]
    index_dir = write_index(tmp_path, lists, 3)
    numpy_scorer, kernel_scorer = scorer_pair(index_dir, SETTINGS[-1], small_blocks=False)
    for setting in SETTINGS:
        for s in (numpy_scorer, kernel_scorer):
            s.theta_sample, s.short_list, s.exhaustive_postings = setting
        expected = numpy_scorer._topk_maxscore_one([0, 1, 2], 2)
        assert kernel_scorer._topk_maxscore_one([0, 1, 2], 2) == expected
        assert [d for d, _ in expected] == [0, 1]  # three equal scores: the smaller documents first


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bm25kernel")
    words = [f"t{i}q" for i in range(300)]
    zipf = [1 / (r + 1) for r in range(len(words))]
    rng = random.Random(1)
    with open(d / "c.jsonl", "w") as f:
        for i in range(4000):
            text = " ".join(rng.choices(words, weights=zipf, k=rng.randint(5, 80)))
            f.write(json.dumps({"id": str(i), "contents": f'"D{i}"\n{text}'}) + "\n")
    return build_index(d / "c.jsonl", d / "index", show_progress=False)


def corpus_queries(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [f"t{i}q" for i in range(300)]
    return [
        " ".join(rng.choices(words[: rng.choice([10, 40, 300])], k=rng.randint(1, 8))) + rng.choice(["", " zzz"])
        for _ in range(n)
    ] + ["", "zzz", "the of and"]


@pytest.mark.parametrize("window", [100, BM25Scorer.kernel_window])  # 40 windows over 4,000 documents; one
@pytest.mark.parametrize("k", [1, 3, 10, 5000])
def test_built_corpus_top_k_is_identical_to_numpy(corpus_index: Path, k: int, window: int) -> None:
    params = json.loads((corpus_index / "manifest.json").read_text())["params"]
    numpy_scorer = BM25Scorer(corpus_index, params, strategy="maxscore-numpy")
    kernel_scorer = BM25Scorer(corpus_index, params, mmap=True)
    kernel_scorer.kernel_window = window
    assert kernel_scorer.compiled and kernel_scorer.strategy == "maxscore"  # the default where numba is installed
    queries = corpus_queries(300, k)
    expected = numpy_scorer.topk_ids(queries, k)
    assert kernel_scorer.topk_ids(queries, k) == expected
    assert sum(map(len, expected)) > 0 and expected[-3:] == [[], [], []]


def test_two_threads_give_the_single_thread_answers(corpus_index: Path) -> None:
    params = json.loads((corpus_index / "manifest.json").read_text())["params"]
    queries = corpus_queries(400, 99)
    expected = BM25Scorer(corpus_index, params).topk_ids(queries, 3)
    two = BM25Scorer(corpus_index, params, n_threads=2)
    assert two.topk_ids(queries, 3) == expected  # chunks of max_chunk queries
    for n in (4, 13, 16, 33):  # chunks of 1, 1, 2 and 4 queries; the last chunk shorter
        assert two.topk_ids(queries[:n], 3) == expected[:n]
    scorer, results = BM25Scorer(corpus_index, params), {}

    def run(i: int) -> None:
        results[i] = scorer.topk_ids(queries, 3)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == expected for r in results.values())


def test_kernel_functions_release_the_gil() -> None:
    kernel_fns = (bm25_kernel.topk_query, bm25_kernel.sample_kth, bm25_kernel.block_maxima, bm25_kernel.kth_largest)
    for fn in (*kernel_fns, bm25_kernel.plan_query, bm25_kernel.search):
        assert fn.targetoptions.get("nogil") is True


def test_environment_switch_falls_back_to_numpy(corpus_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = json.loads((corpus_index / "manifest.json").read_text())["params"]
    monkeypatch.setenv("SORL_BM25_KERNEL", "0")
    scorer = BM25Scorer(corpus_index, params)
    assert scorer.strategy == "maxscore" and not scorer.compiled
    queries = corpus_queries(50, 5)
    monkeypatch.delenv("SORL_BM25_KERNEL")
    assert scorer.topk_ids(queries, 3) == BM25Scorer(corpus_index, params).topk_ids(queries, 3)


def test_unknown_strategy_names_the_choices(corpus_index: Path) -> None:
    params = json.loads((corpus_index / "manifest.json").read_text())["params"]
    with pytest.raises(ValueError, match="maxscore-numpy"):
        BM25Scorer(corpus_index, params, strategy="wand")
