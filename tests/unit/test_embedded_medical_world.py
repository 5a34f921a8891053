"""The synthetic medical world: determinism, answerable questions, options, splits, verl rows and their reward."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_verl.data.records import mcq_record
from sorl_verl.embedded.medical_world import (
    FINDING_NOUNS,
    LETTERS,
    QUESTION_TYPES,
    MedicalWorldConfig,
    data_source,
    generate_medical_world,
    medical_records,
)
from sorl_verl.embedded.world import write_world
from sorl_verl.rewards.score import compute_score

SMALL = MedicalWorldConfig(seed=5, num_conditions=40, num_drugs=30, num_mechanisms=10, num_val_per_type=8,
                           num_test_per_type=8)  # fmt: skip
#: how a passage states each relation (what a reader of the passage sees)
PASSAGE_STATES = {
    "indicates": "{x} is a clinical finding that indicates {y}.",
    "first_line": "The first-line drug for {x} is {y}.",
    "organ": "{x} is a disease of the {y}.",
    "mechanism": "{x} is a drug whose mechanism of action is {y}.",
    "contraindicated": "{x} is contraindicated in {y}.",
}
GENERIC_WORDS = {*FINDING_NOUNS, "inhibition", "activation", "receptor", "blockade", "agonism"}


@pytest.fixture(scope="module")
def world():
    return generate_medical_world(SMALL)


def _digest(paths: dict[str, Path]) -> dict[str, str]:
    return {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in paths.items()}


def _all_questions(world) -> list[dict]:
    return [q for qs in world.questions.values() for q in qs]


def test_same_seed_same_bytes_new_seed_new_world(tmp_path: Path) -> None:
    a = _digest(write_world(generate_medical_world(SMALL), tmp_path / "a"))
    b = _digest(write_world(generate_medical_world(SMALL), tmp_path / "b"))
    other = MedicalWorldConfig(**{**SMALL.__dict__, "seed": 6})
    c = _digest(write_world(generate_medical_world(other), tmp_path / "c"))
    assert a == b
    assert set(a) == {"corpus", "train", "val", "test"}
    assert all(a[k] != c[k] for k in a)


def test_names_unique_word_by_word(world) -> None:
    names = [e.name for e in world.entities.values()]
    assert len(names) == len(set(names))
    words = [w.lower() for n in names for w in n.split() if w not in GENERIC_WORDS]
    assert len(words) == len(set(words)), "a name word is reused, so a search term could hit two entities"
    titles = [d["contents"].split("\n", 1)[0].strip('"') for d in world.corpus]
    assert len(titles) == len(set(titles)) == sum(e.kind != "mechanism" for e in world.entities.values())


def _check_answerable(world, q: dict) -> None:
    """Hop i's passage is titled with hop_queries[i] and states the next hop's entity (or the answer)."""
    qtype = QUESTION_TYPES[q["type"]]
    assert q["chain"] == list(qtype.chain) and q["hops"] == len(qtype.chain) in (1, 2)
    assert len(q["support_ids"]) == len(q["hop_queries"]) == q["hops"]
    assert q["hop_queries"][0] in q["question"]
    targets = [*q["hop_queries"][1:], q["answer"]]
    for i, (doc_id, query) in enumerate(zip(q["support_ids"], q["hop_queries"], strict=True)):
        title, text = world.passage(doc_id).split("\n", 1)
        assert title == f'"{query}"'
        assert PASSAGE_STATES[q["chain"][i]].format(x=query, y=targets[i]) in text, (q, text)


def test_every_question_is_answerable_from_its_passages(world) -> None:
    for q in _all_questions(world):
        _check_answerable(world, q)


def test_exactly_one_correct_option_and_distractors_from_the_world(world) -> None:
    for q in _all_questions(world):
        opts = q["options"]
        assert len(opts) in (4, 5) and "".join(opts) == LETTERS[: len(opts)]
        assert len(set(opts.values())) == len(opts), "options are distinct"
        assert [k for k, v in opts.items() if v == q["answer"]] == [q["answer_idx"]]
        pool = set(world.pool(QUESTION_TYPES[q["type"]].answer_kind))
        assert set(opts.values()) <= pool, "every option is an entity of the answer's kind"


def test_near_distractor_is_offered(world) -> None:
    """'First-line drug for C' offers the drug contraindicated in C when there is one (it shows up in C's search)."""
    seen = 0
    for q in _all_questions(world):
        if q["type"] != "treatment":
            continue
        condition = q["chain_keys"][0]
        contra = [e.name for e in world.entities.values() if e.kind == "drug"
                  and e.facts["contraindicated"] == condition and e.name != q["answer"]]  # fmt: skip
        if contra:
            seen += 1
            assert set(contra) & set(q["options"].values()), q
    assert seen > 0


def test_splits_disjoint_by_type_and_subject_and_cover_every_type(world) -> None:
    keyed = {s: {(q["type"], q["chain_keys"][0]) for q in qs} for s, qs in world.questions.items()}
    assert not keyed["train"] & keyed["val"] and not keyed["train"] & keyed["test"] and not keyed["val"] & keyed["test"]
    for split, qs in world.questions.items():
        assert {q["type"] for q in qs} == set(QUESTION_TYPES), split
        assert len({q["id"] for q in qs}) == len(qs)
    for t in QUESTION_TYPES:
        assert sum(q["type"] == t for q in world.questions["val"]) == min(
            SMALL.num_val_per_type, _subjects(world, t) // 4
        )


def _subjects(world, qtype: str) -> int:
    return sum(e.kind == QUESTION_TYPES[qtype].subject for e in world.entities.values())


def test_gold_letter_is_uniform_over_positions() -> None:
    """P(letter) = (1/4 + 1/5) / 2 for A-D and 1/10 for E; every share within 5 binomial standard deviations."""
    qs = _all_questions(generate_medical_world(MedicalWorldConfig(seed=1)))
    counts, n = Counter(q["answer_idx"] for q in qs), len(qs)
    for letter in LETTERS:
        p = 0.1 if letter == "E" else (1 / 4 + 1 / 5) / 2
        assert abs(counts[letter] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (letter, counts, n)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    conditions=st.integers(6, 40),
    drugs=st.integers(6, 40),
    mechanisms=st.integers(5, 12),
    findings=st.integers(1, 3),
)
def test_invariants_for_any_seed_and_size(seed, conditions, drugs, mechanisms, findings) -> None:
    cfg = MedicalWorldConfig(seed=seed, num_conditions=max(conditions, drugs), num_drugs=drugs,
                             num_mechanisms=mechanisms, findings_per_condition=findings, num_val_per_type=3,
                             num_test_per_type=3)  # fmt: skip
    world = generate_medical_world(cfg)
    for q in _all_questions(world):
        _check_answerable(world, q)
        assert list(q["options"].values()).count(q["answer"]) == 1
        assert q["options"][q["answer_idx"]] == q["answer"]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_drugs must be <= num_conditions"):
        generate_medical_world(MedicalWorldConfig(num_conditions=10, num_drugs=20))
    with pytest.raises(ValueError, match=">= 6 conditions"):
        generate_medical_world(MedicalWorldConfig(num_conditions=3, num_drugs=3))


def test_rows_are_mcq_records_scored_by_the_project_reward(world) -> None:
    qs = world.questions["val"]
    rows = medical_records(qs, "val")
    for i, (q, row) in enumerate(zip(qs, rows, strict=True)):
        extra = {"id": q["id"], "type": q["type"], "hops": q["hops"], "support_ids": q["support_ids"],
                 "hop_queries": q["hop_queries"]}  # fmt: skip
        assert row == mcq_record(q["question"], q["options"], q["answer_idx"], data_source(q["type"]), "val", i, extra)
        gt = row["reward_model"]["ground_truth"]
        assert gt == {"target": [q["answer_idx"]], "options": q["options"]}
        for letter, text in q["options"].items():
            expected = float(letter == q["answer_idx"])
            for said in (letter, f"({letter})", f"{letter}. {text}", text):
                response = f"<think> x </think>\n<answer> {said} </answer>"
                assert compute_score(row["data_source"], response, gt)["score"] == expected, (said, q)
        hedge = "<answer> " + " or ".join(q["options"]) + " </answer>"
        assert compute_score(row["data_source"], hedge, gt)["score"] == 0.0


def test_world_files_read_by_the_medqa_converter_give_the_same_rows(world, tmp_path: Path) -> None:
    from sorl_verl.data.convert import convert_rows

    paths = write_world(world, tmp_path)
    converted = convert_rows("medqa", paths["val"], "val")
    ours = medical_records(world.questions["val"], "val")
    assert len(converted) == len(ours)
    for a, b in zip(converted, ours, strict=True):
        assert a["prompt"] == b["prompt"] and a["reward_model"] == b["reward_model"] and a["ability"] == b["ability"]
        assert a["extra_info"]["id"] == b["extra_info"]["id"]
