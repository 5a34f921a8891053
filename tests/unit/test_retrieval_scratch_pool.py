"""BM25 scratch memory is bounded by the pool size, not by the number of concurrent queries."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from sorl_verl.retrieval.bm25 import ScratchPool
from sorl_verl.retrieval.build import build_index
from sorl_verl.retrieval.index import load_searcher

WORDS = [f"w{i}" for i in range(120)]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("scratch")
    rng = random.Random(0)
    with open(d / "c.jsonl", "w") as f:
        for i in range(3000):  # long posting lists: queries take the MaxScore path, which uses the scratch arrays
            words = rng.choices(WORDS, weights=[1 / (r + 1) for r in range(len(WORDS))], k=30)
            f.write(json.dumps({"id": str(i), "contents": f'"D{i}"\n' + " ".join(words)}) + "\n")
    return build_index(d / "c.jsonl", d / "index", show_progress=False)


def test_64_concurrent_queries_use_at_most_the_pool(index_dir: Path) -> None:
    rng = random.Random(1)
    queries = [" ".join(rng.sample(WORDS[:40], 4)) for _ in range(256)]
    expected = load_searcher(index_dir).search_ids(queries, 5)
    searcher = load_searcher(index_dir, scratch_buffers=2)
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda q: searcher.search_ids([q], 5)[0], queries))
    assert got == expected
    pool_ = searcher.scorer.scratch
    # the numpy MaxScore path fills the pool; the compiled kernel (numba installed) needs no scratch array
    assert pool_.size == 2 and pool_.made == (0 if searcher.scorer.compiled else 2)
    for acc in pool_._free:  # returned clean: the accumulator is all zeros again
        assert acc.dtype == np.float32 and acc.shape == (searcher.num_docs,) and not acc.any()


def test_pool_blocks_then_lends_a_returned_accumulator() -> None:
    pool = ScratchPool(num_docs=10, size=1)
    order: list[str] = []
    with pool.lend() as first:
        t = threading.Thread(target=lambda: (pool.lend().__enter__(), order.append("second")))
        t.start()
        t.join(0.2)
        assert t.is_alive() and order == []  # waits while the only accumulator is lent
        order.append("first")
    t.join(5)
    assert order == ["first", "second"] and pool.made == 1 and first.shape == (10,)
    with pytest.raises(ValueError, match=">= 1"):
        ScratchPool(10, 0)
