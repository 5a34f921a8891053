"""A seeded, fictional medical knowledge world with multiple-choice questions that need 1-2 searches.

Entities: conditions (each affects one organ and has one first-line drug), findings (each
indicates one condition), drugs (each has one mechanism of action and is contraindicated in one
condition it does not treat) and mechanisms (a target and an action, e.g. ``Qomase inhibition``;
answers only, no passage). Every condition, finding and drug has exactly one passage
(Search-R1 wiki format ``"Title"\\ntext``) stating its own facts and nothing else::

    "Drakitis"  Drakitis is a disease of the liver. The first-line drug for Drakitis is Kexapril.
    "Tharune nodules"  Tharune nodules is a clinical finding that indicates Drakitis.
    "Kexapril"  Kexapril is a drug whose mechanism of action is Qomase inhibition. Kexapril is
                contraindicated in Velosis.

A question of type ``t`` follows the relation chain ``QUESTION_TYPES[t].chain`` from its subject;
hop i searches the entity reached after i-1 hops (``hop_queries[i]``), whose passage is
``support_ids[i]``. Options (4 or 5, letters A..E) are the gold answer and distractors of the same
kind from the same world; one distractor is *near* when the world has one: an entity of the
answer's kind named in a passage that the last hop's search also brings up (e.g. for "first-line
drug for C", the drug contraindicated in C). The gold letter is uniform over the option positions.

Question records use MedQA's keys (``question``, ``options`` letter -> text, ``answer_idx``,
``answer``), so the project's MedQA converter reads them, plus ``id``, ``type``, ``hops``,
``chain``, ``support_ids``, ``hop_queries``. Splits are disjoint in (type, subject). Names are
syllable-built, not real, and no name word is shared by two entities. Same arguments -> same bytes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sorl_verl.embedded.world import (
    Entity,
    EntityRegistry,
    KnowledgeWorld,
    NameMaker,
    follow,
    index_passages,
    rows_to_parquet,
    search_extra,
)

ORGANS = ("heart", "lung", "liver", "kidney", "skin", "brain", "stomach", "pancreas", "thyroid", "spleen")
CONDITION_SUFFIXES = ("itis", "osis", "emia", "pathy", "algia", "oma")
FINDING_NOUNS = ("nodules", "rash", "tremor", "murmur", "plaques", "cough", "edema", "spots")
DRUG_SUFFIXES = ("pril", "olol", "azole", "mab", "statin", "cillin", "sartan", "tinib")
ENZYME_ACTIONS = ("inhibition", "activation")
RECEPTOR_ACTIONS = ("receptor blockade", "receptor agonism")
LETTERS = "ABCDE"


@dataclass(frozen=True)
class Relation:
    """A functional relation ``subject -> object`` and the sentence that states it."""

    name: str
    subject: str  # entity kind
    obj: str  # entity kind of the answer: condition, drug, organ, mechanism
    fact: str  # states the relation, e.g. "The first-line drug for {x} is {y}."


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation("indicates", "finding", "condition", "{x} indicates {y}."),
        Relation("first_line", "condition", "drug", "The first-line drug for {x} is {y}."),
        Relation("organ", "condition", "organ", "{x} affects the {y}."),
        Relation("mechanism", "drug", "mechanism", "The mechanism of action of {x} is {y}."),
        Relation("contraindicated", "drug", "condition", "{x} is contraindicated in {y}."),
    )
}


@dataclass(frozen=True)
class QuestionType:
    """A relation chain applied from a subject, and the question that asks for its end."""

    name: str
    chain: tuple[str, ...]
    template: str  # question text with {x} = the subject's name

    @property
    def subject(self) -> str:
        return RELATIONS[self.chain[0]].subject

    @property
    def answer_kind(self) -> str:
        return RELATIONS[self.chain[-1]].obj


QUESTION_TYPES: dict[str, QuestionType] = {
    t.name: t
    for t in (
        QuestionType("diagnosis", ("indicates",), "A patient presents with {x}. What is the most likely diagnosis?"),
        QuestionType("treatment", ("first_line",), "What is the first-line drug for {x}?"),
        QuestionType("organ", ("organ",), "Which organ does {x} affect?"),
        QuestionType("mechanism", ("mechanism",), "What is the mechanism of action of {x}?"),
        QuestionType("contraindication", ("contraindicated",), "In which condition is {x} contraindicated?"),
        QuestionType(
            "diagnosis_treatment",
            ("indicates", "first_line"),
            "A patient presents with {x}. What is the first-line drug for the most likely diagnosis?",
        ),
        QuestionType(
            "diagnosis_organ",
            ("indicates", "organ"),
            "A patient presents with {x}. Which organ does the most likely diagnosis affect?",
        ),
        QuestionType(
            "treatment_mechanism",
            ("first_line", "mechanism"),
            "What is the mechanism of action of the first-line drug for {x}?",
        ),
        QuestionType(
            "treatment_contraindication",
            ("first_line", "contraindicated"),
            "In which condition is the first-line drug for {x} contraindicated?",
        ),
    )
}


@dataclass(frozen=True)
class MedicalWorldConfig:
    """Sizes of the world and of its splits (all enter the build stamps)."""

    seed: int = 0
    num_conditions: int = 150
    findings_per_condition: int = 2
    num_drugs: int = 100
    num_mechanisms: int = 30
    num_val_per_type: int = 50
    num_test_per_type: int = 50
    max_train_per_type: int = 1000


@dataclass
class MedicalWorld(KnowledgeWorld):
    """The medical world of ``config``: entities (organs are attribute values), passages, questions."""

    config: MedicalWorldConfig = field(default_factory=MedicalWorldConfig)

    def pool(self, kind: str) -> list[str]:
        """Every answer string of ``kind`` in the world, in a fixed order."""
        if kind == "organ":
            return list(ORGANS)
        return [e.name for e in self.entities.values() if e.kind == kind]

    def near(self, subject_key: str, kind: str) -> list[str]:
        """Names of ``kind`` in the passages that name ``subject_key`` (its own and others'), as subject or object."""
        subject = self.entities[subject_key]
        found: list[str] = []
        for e in self.entities.values():
            if e.doc_id and (e.key == subject_key or subject_key in e.facts.values()):
                found += [e.name] if e.kind == kind else []
                found += [
                    _answer_name(self.entities, rel, v) for rel, v in e.facts.items() if RELATIONS[rel].obj == kind
                ]
        return sorted(set(found) - {subject.name})

    def with_options(self, question: dict[str, Any], rng: random.Random, suffix: str = "") -> dict[str, Any]:
        """A copy of ``question`` with freshly drawn options (same rule as the world's own draw)."""
        qtype = QUESTION_TYPES[question["type"]]
        options, letter = _draw_options(self, qtype, question["chain_keys"][-1], question["answer"], rng)
        return {**question, "id": question["id"] + suffix, "options": options, "answer_idx": letter}


def _answer_name(ents: dict[str, Entity], rel: str, value: str) -> str:
    return value if RELATIONS[rel].obj == "organ" else ents[value].name


def _passage_text(e: Entity, ents: dict[str, Entity]) -> str:
    """One or two sentences stating exactly the facts of ``e``."""
    f = e.facts
    if e.kind == "condition":
        return f"{e.name} is a disease of the {f['organ']}. The first-line drug for {e.name} is {ents[f['first_line']].name}."
    if e.kind == "finding":
        return f"{e.name} is a clinical finding that indicates {ents[f['indicates']].name}."
    if e.kind == "drug":
        return (
            f"{e.name} is a drug whose mechanism of action is {ents[f['mechanism']].name}. "
            f"{e.name} is contraindicated in {ents[f['contraindicated']].name}."
        )
    raise ValueError(e.kind)


def _follow(ents: dict[str, Entity], start: str, chain: Sequence[str]) -> tuple[list[Entity], str]:
    """Entities searched (one per hop) and the final answer string."""
    return follow(ents, start, chain, lambda rel: RELATIONS[rel].obj == "organ")


def _draw_options(
    world: MedicalWorld, qtype: QuestionType, last_subject: str, answer: str, rng: random.Random
) -> tuple[dict[str, str], str]:
    """4 or 5 options: the answer, at most one near distractor, the rest from the kind's pool."""
    n = rng.choice((4, 5))
    near = [x for x in world.near(last_subject, qtype.answer_kind) if x != answer]
    distractors = [rng.choice(near)] if near else []
    rest = sorted(set(world.pool(qtype.answer_kind)) - {answer, *distractors})
    distractors += rng.sample(rest, n - 1 - len(distractors))
    rng.shuffle(distractors)
    position = rng.randrange(n)
    texts = distractors[:position] + [answer] + distractors[position:]
    return dict(zip(LETTERS, texts, strict=False)), LETTERS[position]


def _make_entities(cfg: MedicalWorldConfig, rng: random.Random) -> dict[str, Entity]:
    names = NameMaker(rng, min_length=5, coda_and_suffix=False)
    ents = EntityRegistry()

    mechanisms = []
    for i in range(cfg.num_mechanisms):
        if rng.random() < 0.5:
            name = f"{names.word(1, 'ase')} {rng.choice(ENZYME_ACTIONS)}"
        else:
            name = f"{names.word(2)} {rng.choice(RECEPTOR_ACTIONS)}"
        mechanisms.append(ents.make("mechanism", i, name))
    conditions = [
        ents.make("condition", i, names.word(2, rng.choice(CONDITION_SUFFIXES))) for i in range(cfg.num_conditions)
    ]
    drugs = [ents.make("drug", i, names.word(2, rng.choice(DRUG_SUFFIXES))) for i in range(cfg.num_drugs)]
    findings = [
        ents.make("finding", i, f"{names.word(2)} {rng.choice(FINDING_NOUNS)}")
        for i in range(cfg.num_conditions * cfg.findings_per_condition)
    ]

    treats: dict[str, set[str]] = {d.key: set() for d in drugs}
    for i, c in enumerate(conditions):
        c.facts["organ"] = rng.choice(ORGANS)
        drug = drugs[i % len(drugs)] if i < len(drugs) else rng.choice(drugs)  # every drug treats something
        c.facts["first_line"] = drug.key
        treats[drug.key].add(c.key)
    for d in drugs:
        d.facts["mechanism"] = rng.choice(mechanisms).key
        d.facts["contraindicated"] = rng.choice([c for c in conditions if c.key not in treats[d.key]]).key
    for i, f in enumerate(findings):
        f.facts["indicates"] = conditions[i % len(conditions)].key
    return ents


def generate_medical_world(config: MedicalWorldConfig | None = None) -> MedicalWorld:
    """Build the world of ``config`` (see the module docstring); deterministic in ``config``."""
    cfg = config or MedicalWorldConfig()
    if cfg.num_conditions < 6 or cfg.num_drugs < 6 or cfg.num_mechanisms < 5 or cfg.findings_per_condition < 1:
        raise ValueError("need >= 6 conditions, >= 6 drugs, >= 5 mechanisms and >= 1 finding per condition")
    if cfg.num_drugs > cfg.num_conditions:
        raise ValueError("num_drugs must be <= num_conditions (every drug is first-line for some condition)")
    rng = random.Random(cfg.seed)
    ents = _make_entities(cfg, rng)
    order = [e for e in ents.values() if e.kind != "mechanism"]
    rng.shuffle(order)
    corpus = index_passages(order, lambda e: _passage_text(e, ents))
    world = MedicalWorld(entities=ents, corpus=corpus, questions={}, config=cfg)

    splits: dict[str, list[dict[str, Any]]] = {"train": [], "val": [], "test": []}
    for qtype in QUESTION_TYPES.values():
        subjects = sorted((e.key for e in order if e.kind == qtype.subject), key=lambda k: (len(k), k))
        rng.shuffle(subjects)
        n_val = min(cfg.num_val_per_type, len(subjects) // 4)
        n_test = min(cfg.num_test_per_type, len(subjects) // 4)
        parts = {
            "val": subjects[:n_val],
            "test": subjects[n_val : n_val + n_test],
            "train": subjects[n_val + n_test : n_val + n_test + cfg.max_train_per_type],
        }
        for split, keys in parts.items():
            for key in keys:
                visited, answer = _follow(ents, key, qtype.chain)
                options, letter = _draw_options(world, qtype, visited[-1].key, answer, rng)
                splits[split].append(
                    {
                        "id": f"med{cfg.seed}-{split}-{qtype.name}-{len(splits[split])}",
                        "question": qtype.template.format(x=ents[key].name),
                        "options": options,
                        "answer_idx": letter,
                        "answer": answer,
                        "type": qtype.name,
                        "hops": len(qtype.chain),
                        "chain": list(qtype.chain),
                        "chain_keys": [v.key for v in visited],
                        "support_ids": [v.doc_id for v in visited],
                        "hop_queries": [v.name for v in visited],
                    }
                )
    for split in splits:
        rng.shuffle(splits[split])
    world.questions = splits
    return world


def data_source(question_type: str) -> str:
    """``data_source`` of a question type's parquet rows (validation metrics are grouped by it)."""
    return f"synthetic_med_{question_type}"


def medical_records(questions: Sequence[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """verl rows via the MedQA/MedMCQA converters' builder :func:`sorl_verl.data.records.mcq_record`."""
    from sorl_verl.data.records import mcq_record

    return [
        mcq_record(
            q["question"],
            q["options"],
            q["answer_idx"],
            data_source(q["type"]),
            split,
            i,
            extra={**search_extra(q), "type": q["type"]},
        )
        for i, q in enumerate(questions)
    ]


def medical_to_parquet(questions: Sequence[dict[str, Any]], out_path: str | Path, split: str) -> Path:
    """verl parquet of ``questions`` (rows of :func:`medical_records`)."""
    return rows_to_parquet(medical_records(questions, split), out_path)
