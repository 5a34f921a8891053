"""A seeded, fictional multi-hop world: entities, a short-passage corpus and k-hop questions.

Entities are people, cities, countries, companies and rivers with functional relations
(``birthplace``, ``employer``, ``founder``, ``headquarters``, ``country``, ``capital``,
``flows_through``) and attributes (years, occupations). Every entity has exactly one passage
(Search-R1 wiki format ``"Title"\\ntext``, one or two sentences) stating its own facts and
nothing else, so a k-hop question needs k searches: hop i searches the entity reached after
i-1 hops (``hop_queries[i]``), whose passage is ``support_ids[i]``.

Names are built from syllables, are unique across the whole world (no name is a prefix or
part of another), and the generator is deterministic: same arguments -> same bytes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
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

OCCUPATIONS = ("painter", "engineer", "poet", "chemist", "sculptor", "merchant", "architect", "botanist")
COMPANY_SUFFIXES = ("Works", "Industries", "Group", "Labs", "Foundry", "Traders")
COUNTRY_SUFFIXES = ("ia", "land", "mark", "stan")
CITY_SUFFIXES = ("vale", "ford", "holm", "mora", "port", "ton")


@dataclass(frozen=True)
class Relation:
    """A functional relation ``subject -> object`` and how questions phrase it."""

    name: str
    subject: str  # entity kind
    obj: str  # entity kind, or "year" for an attribute
    question: str  # asks for the object of {x}, e.g. "Where was {x} born?"
    phrase: str  # names the object, e.g. "the birthplace of {x}"


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation("birthplace", "person", "city", "Where was {x} born?", "the birthplace of {x}"),
        Relation("birth_year", "person", "year", "In what year was {x} born?", "the birth year of {x}"),
        Relation("employer", "person", "company", "Which company does {x} work for?", "the employer of {x}"),
        Relation("founder", "company", "person", "Who founded {x}?", "the founder of {x}"),
        Relation(
            "headquarters", "company", "city", "In which city is {x} headquartered?", "the headquarters city of {x}"
        ),
        Relation("company_year", "company", "year", "In what year was {x} founded?", "the founding year of {x}"),
        Relation("country", "city", "country", "In which country is {x}?", "the country of {x}"),
        Relation("city_year", "city", "year", "In what year was {x} founded?", "the founding year of {x}"),
        Relation("capital", "country", "city", "What is the capital of {x}?", "the capital of {x}"),
        Relation(
            "flows_through", "river", "city", "Which city does {x} flow through?", "the city that {x} flows through"
        ),
    )
}

#: question chains (relations applied left to right from the subject) by number of hops
CHAINS: dict[int, tuple[tuple[str, ...], ...]] = {
    1: (
        ("birthplace",),
        ("birth_year",),
        ("employer",),
        ("founder",),
        ("headquarters",),
        ("company_year",),
        ("country",),
        ("city_year",),
        ("capital",),
        ("flows_through",),
    ),
    2: (
        ("birthplace", "country"),
        ("birthplace", "city_year"),
        ("employer", "founder"),
        ("employer", "headquarters"),
        ("founder", "birthplace"),
        ("founder", "birth_year"),
        ("headquarters", "country"),
        ("country", "capital"),
        ("flows_through", "country"),
    ),
    3: (
        ("birthplace", "country", "capital"),
        ("employer", "founder", "birthplace"),
        ("employer", "headquarters", "country"),
        ("founder", "birthplace", "country"),
        ("headquarters", "country", "capital"),
        ("flows_through", "country", "capital"),
    ),
}


@dataclass
class World(KnowledgeWorld):
    """The QA world of ``seed``: entities, their passages and the questions asked about them."""

    seed: int = 0


def _passage_text(e: Entity, ents: dict[str, Entity]) -> str:
    """One or two sentences stating exactly the facts of ``e``."""
    f = e.facts

    def n(rel: str) -> str:
        return ents[f[rel]].name

    if e.kind == "person":
        article = "an" if f["occupation"][0] in "aeiou" else "a"
        return (
            f"{e.name} is {article} {f['occupation']} born in {f['birth_year']} in {n('birthplace')}. "
            f"{e.name} works for {n('employer')}."
        )
    if e.kind == "company":
        return (
            f"{e.name} is a company founded in {f['company_year']} by {n('founder')}. "
            f"{e.name} is headquartered in {n('headquarters')}."
        )
    if e.kind == "city":
        return f"{e.name} is a city in {n('country')}, founded in {f['city_year']}."
    if e.kind == "country":
        return f"{e.name} is a country whose capital is {n('capital')}."
    if e.kind == "river":
        return f"{e.name} is a river that flows through {n('flows_through')}."
    raise ValueError(e.kind)


def _question_text(chain: Sequence[str], subject: str) -> str:
    """Nested question, e.g. (employer, founder) -> 'Who founded the employer of X?'."""
    phrase = subject
    for rel in chain[:-1]:
        phrase = RELATIONS[rel].phrase.format(x=phrase)
    return RELATIONS[chain[-1]].question.format(x=phrase)


def _follow(ents: dict[str, Entity], start: str, chain: Sequence[str]) -> tuple[list[Entity], str]:
    """Entities visited (one per hop) and the final answer string."""
    return follow(ents, start, chain, lambda rel: RELATIONS[rel].obj == "year")


def _degenerate(ents: dict[str, Entity], start: str, chain: Sequence[str]) -> bool:
    """True when the chain revisits an entity (e.g. the capital of a capital's country)."""
    visited, answer = _follow(ents, start, chain)
    names = [v.name for v in visited]
    return len(set(names)) < len(names) or answer in names


def generate_world(
    seed: int,
    num_entities: int = 200,
    num_val_per_hop: int = 100,
    num_test_per_hop: int = 100,
    max_train_per_hop: int = 3000,
) -> World:
    """Build a world with ``num_entities`` people and proportional cities, companies, countries, rivers.

    Splits are disjoint in (chain, subject); val/test hold ``num_*_per_hop`` questions of each
    hop count (fewer if the world is too small), train the rest up to ``max_train_per_hop``.
    """
    if num_entities < 8:
        raise ValueError("num_entities must be >= 8")
    rng = random.Random(seed)
    names = NameMaker(rng, min_length=4, coda_and_suffix=True)
    counts = {
        "country": max(2, num_entities // 20),
        "city": max(4, num_entities // 4),
        "company": max(3, num_entities // 4),
        "river": max(2, num_entities // 10),
        "person": num_entities,
    }
    ents = EntityRegistry()
    countries = [ents.make("country", i, names.word(2, rng.choice(COUNTRY_SUFFIXES))) for i in range(counts["country"])]
    cities = [ents.make("city", i, names.word(1, rng.choice(CITY_SUFFIXES))) for i in range(counts["city"])]
    people = [ents.make("person", i, f"{names.word(2)} {names.word(2)}") for i in range(counts["person"])]
    companies = [
        ents.make("company", i, f"{names.word(2)} {rng.choice(COMPANY_SUFFIXES)}") for i in range(counts["company"])
    ]
    rivers = [ents.make("river", i, f"{names.word(2)} River") for i in range(counts["river"])]

    for i, c in enumerate(cities):  # every country gets at least one city
        c.facts["country"] = countries[i].key if i < len(countries) else rng.choice(countries).key
        c.facts["city_year"] = str(rng.randint(800, 1700))
    for co in countries:
        co.facts["capital"] = rng.choice([c for c in cities if c.facts["country"] == co.key]).key
    for co in companies:
        co.facts["founder"] = rng.choice(people).key
        co.facts["headquarters"] = rng.choice(cities).key
        co.facts["company_year"] = str(rng.randint(1800, 2000))
    for p in people:
        p.facts["birthplace"] = rng.choice(cities).key
        p.facts["birth_year"] = str(rng.randint(1850, 1990))
        p.facts["employer"] = rng.choice(companies).key
        p.facts["occupation"] = rng.choice(OCCUPATIONS)
    for r in rivers:
        r.facts["flows_through"] = rng.choice(cities).key

    order = countries + cities + people + companies + rivers
    rng.shuffle(order)
    corpus = index_passages(order, lambda e: _passage_text(e, ents))

    splits: dict[str, list[dict[str, Any]]] = {"train": [], "val": [], "test": []}
    for hops, chains in CHAINS.items():
        cands = [(chain, e.key) for chain in chains for e in order if e.kind == RELATIONS[chain[0]].subject]
        cands = [c for c in cands if not _degenerate(ents, c[1], c[0])]
        cands.sort(key=lambda c: (c[0], c[1]))
        rng.shuffle(cands)
        n_val = min(num_val_per_hop, len(cands) // 4)
        n_test = min(num_test_per_hop, len(cands) // 4)
        parts = {
            "val": cands[:n_val],
            "test": cands[n_val : n_val + n_test],
            "train": cands[n_val + n_test : n_val + n_test + max_train_per_hop],
        }
        for split, items in parts.items():
            for chain, key in items:
                visited, answer = _follow(ents, key, chain)
                splits[split].append(
                    {
                        "id": f"w{seed}-{split}-{hops}hop-{len(splits[split])}",
                        "question": _question_text(chain, ents[key].name),
                        "golden_answers": [answer],
                        "hops": hops,
                        "chain": list(chain),
                        "support_ids": [v.doc_id for v in visited],
                        "hop_queries": [v.name for v in visited],
                    }
                )
    for split in splits:
        rng.shuffle(splits[split])
    return World(entities=ents, corpus=corpus, questions=splits, seed=seed)


def questions_to_parquet(questions: Sequence[dict[str, Any]], out_path: str | Path, split: str) -> Path:
    """verl parquet of the questions (``data_source`` = ``synthetic_{k}hop``) via ``qa_record``."""
    from sorl_verl.data.records import qa_record

    rows = [qa_record(q["question"], q["golden_answers"], f"synthetic_{q['hops']}hop", split, i, extra=search_extra(q))
            for i, q in enumerate(questions)]  # fmt: skip
    return rows_to_parquet(rows, out_path)
