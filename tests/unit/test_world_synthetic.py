"""The synthetic multi-hop world: determinism, valid hop chains, parquet rows."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pandas as pd
import pytest

from sorl_verl.agent.prompts import qa_prompt
from sorl_verl.embedded.qa_world import CHAINS, generate_world, questions_to_parquet
from sorl_verl.embedded.world import read_jsonl, write_world


def _digest(paths: dict[str, Path]) -> dict[str, str]:
    return {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in paths.items()}


@pytest.fixture(scope="module")
def world():
    return generate_world(seed=11, num_entities=80, num_val_per_hop=20, num_test_per_hop=20)


def test_same_seed_same_bytes_new_seed_new_world(tmp_path: Path) -> None:
    a = _digest(write_world(generate_world(3, num_entities=40), tmp_path / "a"))
    b = _digest(write_world(generate_world(3, num_entities=40), tmp_path / "b"))
    c = _digest(write_world(generate_world(4, num_entities=40), tmp_path / "c"))
    assert a == b
    assert set(a) == {"corpus", "train", "val", "test"}
    assert all(a[k] != c[k] for k in a)


def test_names_unique_and_unambiguous(world) -> None:
    names = [e.name for e in world.entities.values()]
    assert len(names) == len(set(names))
    words = [w for n in names for w in n.split() if w != "River" and not w.endswith(("Works", "Industries", "Group",
                                                                                      "Labs", "Foundry", "Traders"))]
    assert len(words) == len(set(words)), "a name word is reused, so a search term could hit two entities"
    titles = [d["contents"].split("\n", 1)[0].strip('"') for d in world.corpus]
    assert len(titles) == len(set(titles)) == len(world.entities)


def test_passages_are_short_wiki_format(world) -> None:
    for d in world.corpus:
        title, text = d["contents"].split("\n", 1)
        assert title.startswith('"') and title.endswith('"')
        assert 1 <= text.count(". ") + 1 <= 2 and len(text.split()) <= 30


def test_hop_chains_are_valid_and_answers_reachable(world) -> None:
    by_id = {d["id"]: d["contents"] for d in world.corpus}
    seen = 0
    for split, qs in world.questions.items():
        for q in qs:
            k = q["hops"]
            assert len(q["support_ids"]) == len(q["hop_queries"]) == len(q["chain"]) == k
            assert tuple(q["chain"]) in CHAINS[k]
            assert q["hop_queries"][0] in q["question"]
            for i, (doc_id, query) in enumerate(zip(q["support_ids"], q["hop_queries"], strict=True)):
                doc = by_id[doc_id]
                assert world.passage(doc_id) == doc
                assert doc.startswith(f'"{query}"\n'), "support doc of hop i is the passage of hop i's entity"
                nxt = q["hop_queries"][i + 1] if i + 1 < k else q["golden_answers"][0]
                assert re.search(rf"\b{re.escape(nxt)}\b", doc), f"{split} {q['id']}: hop {i} doc lacks {nxt!r}"
                if i > 0:  # a later hop's entity must not be given away by the question
                    assert query not in q["question"]
            assert q["golden_answers"][0] not in q["question"]
            seen += 1
    assert seen > 300


def test_splits_disjoint_and_balanced(world) -> None:
    keys = {s: {(tuple(q["chain"]), q["hop_queries"][0]) for q in qs} for s, qs in world.questions.items()}
    assert not keys["train"] & keys["val"] and not keys["train"] & keys["test"] and not keys["val"] & keys["test"]
    for split in ("val", "test"):
        hops = [q["hops"] for q in world.questions[split]]
        assert {h: hops.count(h) for h in (1, 2, 3)} == {1: 20, 2: 20, 3: 20}
    assert len({q["id"] for qs in world.questions.values() for q in qs}) == sum(map(len, world.questions.values()))


def test_write_world_round_trips(world, tmp_path: Path) -> None:
    paths = write_world(world, tmp_path)
    assert read_jsonl(paths["corpus"]) == world.corpus
    assert read_jsonl(paths["val"]) == world.questions["val"]


def test_parquet_rows_valid(world, tmp_path: Path) -> None:
    qs = world.questions["val"]
    df = pd.read_parquet(questions_to_parquet(qs, tmp_path / "val.parquet", "val"))
    assert len(df) == len(qs)
    assert set(df["data_source"]) == {"synthetic_1hop", "synthetic_2hop", "synthetic_3hop"}
    row, q = df.iloc[5], qs[5]
    assert row["data_source"] == f"synthetic_{q['hops']}hop"
    assert list(row["prompt"])[0]["content"] == qa_prompt(q["question"])
    assert list(row["reward_model"]["ground_truth"]["target"]) == q["golden_answers"]
    assert list(row["extra_info"]["support_ids"]) == q["support_ids"]
    assert row["extra_info"]["split"] == "val" and row["agent_name"] == "search_r1"
