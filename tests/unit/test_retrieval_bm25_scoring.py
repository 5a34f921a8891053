"""The BM25 MaxScore scorer returns bit-identical top-k (ids and float32 scores) to its previous version.

Both MaxScore implementations are checked: the compiled kernel (``strategy="maxscore"``, the
default where numba is installed) and the numpy one (``strategy="maxscore-numpy"``).

``PreviousScorer`` below is the scorer's MaxScore path as it was before the speed-up (a frozen
copy kept only as the reference): every posting of the essential terms accumulated into the
scratch array, candidates de-duplicated with the stamp array, the non-essential terms looked up
for every candidate. Both must give the same documents, the same order and the same float32
scores, on every code path (small thresholds force pruning, sampling and long-list paths on a
small corpus).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sorl_verl.retrieval.bm25 import BM25Scorer
from sorl_verl.retrieval.build import build_index

WORDS = [f"t{i}q" for i in range(150)]


class PreviousScorer(BM25Scorer):
    """Reference: the MaxScore path before the speed-up (frozen copy)."""

    def _dedupe_old(self, docs: np.ndarray, stamp: np.ndarray) -> np.ndarray:
        order = np.arange(len(docs), dtype=np.int32)
        stamp[docs] = order
        return docs[stamp[docs] == order]

    def _topk_maxscore_one(self, term_ids, k):  # type: ignore[no-untyped-def]
        if not term_ids:
            return []
        with self.scratch.lend() as acc:  # (the previous pool also lent this int32 stamp array)
            return self._topk_maxscore_scratch(term_ids, k, acc, np.zeros(self.num_docs, dtype=np.int32))

    def _accumulate_select(self, slices, k, acc, stamp):  # type: ignore[no-untyped-def]
        touched = []
        try:
            for start, end, w in slices:
                docs = self.indices[start:end]
                touched.append(docs)
                acc[docs] += w * self.data[start:end]
            cand = self._dedupe_old(np.concatenate(touched), stamp)
            scores = acc[cand]
        finally:
            for docs in touched:
                acc[docs] = 0.0
        return self._select(cand, scores, k)

    def _topk_maxscore_scratch(self, term_ids, k, acc, stamp):  # type: ignore[no-untyped-def]
        if not term_ids:
            return []
        terms, counts = np.unique(np.asarray(term_ids, dtype=np.int64), return_counts=True)
        bounds = counts * self.max_score[terms]
        order = np.argsort(bounds, kind="stable")
        terms, counts, bounds = terms[order], counts[order].astype(np.float32), bounds[order]
        starts, ends = self.indptr[terms], self.indptr[terms + 1]
        slices = [(int(a), int(b), float(w)) for a, b, w in zip(starts, ends, counts, strict=True) if b > a]
        if not slices:
            return []
        if len(slices) == 1:
            start, end, w = slices[0]
            return self._select(np.asarray(self.indices[start:end]), w * self.data[start:end], k)
        if sum(end - start for start, end, _ in slices) <= self.exhaustive_postings:
            return self._accumulate_select(slices, k, acc, stamp)
        short = [sl for sl in slices if sl[1] - sl[0] <= self.short_list]
        j = int(np.argmin(ends - starts + (ends == starts) * np.iinfo(np.int32).max))
        sample = np.asarray(self.indices[starts[j] : min(ends[j], starts[j] + self.theta_sample)])
        theta = 0.0
        if len(sample) >= k:
            sample_scores = self._lookup(sample, short or [(int(starts[j]), int(ends[j]), float(counts[j]))])
            theta = float(np.partition(sample_scores, len(sample) - k)[len(sample) - k])
        for start, end, w in short:
            if end - start >= k:
                theta = max(theta, w * float(np.partition(self.data[start:end], end - start - k)[end - start - k]))
        n_non = int(np.searchsorted(np.cumsum(bounds), theta, side="left"))
        non_bound = float(bounds[:n_non].sum())
        essential = [
            (int(starts[i]), int(ends[i]), float(counts[i])) for i in range(n_non, len(terms)) if ends[i] > starts[i]
        ]
        touched = []
        try:
            for start, end, w in essential:
                docs = self.indices[start:end]
                touched.append(docs)
                acc[docs] += w * self.data[start:end]
            longest = max(touched, key=len)
            if len(longest) >= k:
                theta = max(theta, float(np.partition(acc[longest], len(longest) - k)[len(longest) - k]))
            floor = theta - non_bound - 1e-5 * max(1.0, abs(theta))
            kept = [docs[acc[docs] >= floor] for docs in touched]
            cand = kept[0] if len(kept) == 1 else self._dedupe_old(np.concatenate(kept), stamp)
            partial = acc[cand]
        finally:
            for docs in touched:
                acc[docs] = 0.0
        non_slices = [(int(starts[i]), int(ends[i]), float(counts[i])) for i in range(n_non) if ends[i] > starts[i]]
        full = partial + self._lookup(cand, non_slices) if non_slices else partial
        return self._select(cand, full, k)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bm25score")
    rng = random.Random(0)
    zipf = [1 / (r + 1) for r in range(len(WORDS))]
    with open(d / "c.jsonl", "w") as f:
        for i in range(2500):  # Zipf words: long lists for the head, short ones for the tail
            words = rng.choices(WORDS, weights=zipf, k=rng.randint(5, 60))
            f.write(json.dumps({"id": str(i), "contents": f'"D{i}"\n' + " ".join(words)}) + "\n")
    return build_index(d / "c.jsonl", d / "index", show_progress=False)


# (theta sample, "short list" length, exhaustive-path threshold): small values force every path
SETTINGS = [(8, 40, 0), (512, 10**6, 0), (3, 0, 0), (64, 300, 200), (512, 65536, 8192)]


STRATEGIES = ["maxscore", "maxscore-numpy"]


def _scorers(index_dir: Path, setting: tuple[int, int, int], strategy: str) -> tuple[BM25Scorer, BM25Scorer]:
    params = json.loads((index_dir / "manifest.json").read_text())["params"]
    pair = (
        PreviousScorer(index_dir, params, strategy="maxscore-numpy"),
        BM25Scorer(index_dir, params, mmap=True, strategy=strategy),
    )
    for s in pair:
        s.theta_sample, s.short_list, s.exhaustive_postings = setting
    return pair


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_ids_and_scores_are_bit_identical_to_the_previous_scorer(
    index_dir: Path, setting: tuple[int, int, int], k: int, strategy: str
) -> None:
    old, new = _scorers(index_dir, setting, strategy)
    rng = random.Random(k)
    # head-heavy queries (long lists, repeated terms weigh 2-3x), tail words, unknown words
    queries = [
        " ".join(rng.choices(WORDS[: rng.choice([8, 30, 150])], k=rng.randint(1, 8))) + rng.choice(["", " zzz"])
        for _ in range(200)
    ]
    expected = old.topk_ids(queries, k)
    got = new.topk_ids(queries, k)
    assert got == expected  # same documents, order and float scores (Python floats of the float32 values)
    assert all(len(row) == k for row in got if row)
    if not new.compiled:
        acc = new.scratch._free[0]
        assert not acc.any()  # the scratch accumulator is returned all zeros


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=st.lists(st.integers(0, len(WORDS) - 1), min_size=1, max_size=10),
    k=st.integers(1, 20),
    setting=st.sampled_from(SETTINGS),
    strategy=st.sampled_from(STRATEGIES),
)
def test_any_query_matches_the_previous_scorer(
    index_dir: Path, words: list[int], k: int, setting: tuple[int, int, int], strategy: str
) -> None:
    old, new = _scorers(index_dir, setting, strategy)
    query = " ".join(WORDS[w] for w in words)
    assert new.topk_ids([query], k) == old.topk_ids([query], k)
