"""BM25 over the synthetic multi-hop world finds the gold passage (sorl_verl.embedded.qa_world)."""

from __future__ import annotations

import pytest

from sorl_verl.embedded.qa_world import generate_world
from sorl_verl.embedded.world import write_world
from sorl_verl.retrieval.build import build_index
from sorl_verl.retrieval.index import IndexSearcher, load_searcher


@pytest.fixture(scope="module", params=[0, 1])
def world_index(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    world = generate_world(seed=request.param, num_entities=300)
    d = tmp_path_factory.mktemp(f"world{request.param}")
    paths = write_world(world, d)
    return world, load_searcher(build_index(paths["corpus"], d / "index", show_progress=False))


def _recall_at(searcher: IndexSearcher, queries: list[str], gold: list[str], k: int) -> float:
    hits = searcher.search(queries, k)
    return sum(g in {h["id"] for h in row} for g, row in zip(gold, hits, strict=True)) / len(gold)


def test_one_hop_question_recall_at_3(world_index) -> None:
    world, searcher = world_index
    qs = [q for split in ("train", "val", "test") for q in world.questions[split] if q["hops"] == 1]
    assert len(qs) >= 100
    recall = _recall_at(searcher, [q["question"] for q in qs], [q["support_ids"][0] for q in qs], 3)
    assert recall >= 0.9, f"1-hop recall@3 = {recall:.3f} over {len(qs)} questions"


def test_every_hop_entity_query_finds_its_passage(world_index) -> None:
    world, searcher = world_index
    qs = [q for q in world.questions["test"] if q["hops"] >= 2]
    queries = [name for q in qs for name in q["hop_queries"]]
    gold = [doc for q in qs for doc in q["support_ids"]]
    assert len(queries) >= 100
    assert _recall_at(searcher, queries, gold, 3) >= 0.95
