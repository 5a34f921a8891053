"""What the embedded worlds share: entities with one passage each, syllable names, relation chains, JSON lines.

A world is a set of fictional :class:`Entity` records whose facts map a relation name to another
entity's key (or to an attribute value), a corpus with one passage per searchable entity
(Search-R1 wiki format ``"Title"\\ntext``, doc ids are corpus positions) and question records per
split. :func:`follow` walks a relation chain; hop i of a question searches the i-th entity it
visits. Everything here is deterministic in its random generator.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ONSETS = ("b", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "t", "th", "v", "vr", "z", "zh", "q")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ou", "y")
CODAS = ("", "", "n", "r", "l", "s", "th", "x", "m", "rk")


@dataclass
class Entity:
    """One fictional entity; ``facts`` maps relation name -> entity key or attribute value."""

    key: str
    kind: str
    name: str
    facts: dict[str, str] = field(default_factory=dict)
    doc_id: str = ""  # "" for an entity without a passage


@dataclass
class KnowledgeWorld:
    """Entities, their passages and the questions asked about them."""

    entities: dict[str, Entity]
    corpus: list[dict[str, str]]
    questions: dict[str, list[dict[str, Any]]]  # split -> question records

    def passage(self, doc_id: str) -> str:
        """``contents`` of one corpus passage (doc ids are corpus positions)."""
        doc = self.corpus[int(doc_id)]
        assert doc["id"] == doc_id
        return doc["contents"]


class NameMaker:
    """Unique capitalised syllable words; no word repeats anywhere in the world.

    A word is ``syllables`` onset+vowel pairs and an ending: a coda then ``suffix`` when
    ``coda_and_suffix``, else ``suffix`` in place of the coda (a coda when there is no suffix).
    """

    def __init__(self, rng: random.Random, min_length: int, coda_and_suffix: bool) -> None:
        self.rng = rng
        self.min_length = min_length
        self.coda_and_suffix = coda_and_suffix
        self.words: set[str] = set()

    def word(self, syllables: int, suffix: str = "") -> str:
        for _ in range(10_000):
            parts = [self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables)]
            ending = self.rng.choice(CODAS) + suffix if self.coda_and_suffix else suffix or self.rng.choice(CODAS)
            w = ("".join(parts) + ending).capitalize()
            if w.lower() not in self.words and len(w) >= self.min_length:
                self.words.add(w.lower())
                return w
        raise RuntimeError("name space exhausted; use fewer entities")


class EntityRegistry(dict[str, Entity]):
    """``key -> Entity`` in creation order; :meth:`make` names keys ``{kind}{i}``."""

    def make(self, kind: str, i: int, name: str) -> Entity:
        e = Entity(key=f"{kind}{i}", kind=kind, name=name)
        self[e.key] = e
        return e


def follow(
    entities: dict[str, Entity], start: str, chain: Sequence[str], is_attribute: Callable[[str], bool]
) -> tuple[list[Entity], str]:
    """Entities visited (one per hop) along ``chain`` from ``start`` and the final answer string.

    ``is_attribute(relation)`` is true for a relation whose value is the answer text itself (a year,
    an organ), not the key of an entity whose name is the answer.
    """
    visited, cur = [], entities[start]
    for rel in chain:
        visited.append(cur)
        value = cur.facts[rel]
        if is_attribute(rel):
            return visited, value
        cur = entities[value]
    return visited, cur.name


def index_passages(order: Sequence[Entity], passage_text: Callable[[Entity], str]) -> list[dict[str, str]]:
    """The corpus: one ``"Name"\\ntext`` passage per entity of ``order``, whose ``doc_id`` becomes its position."""
    corpus = []
    for i, e in enumerate(order):
        e.doc_id = str(i)
        corpus.append({"id": e.doc_id, "contents": f'"{e.name}"\n{passage_text(e)}'})
    return corpus


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_world(world: KnowledgeWorld, out_dir: str | Path) -> dict[str, Path]:
    """Write ``corpus.jsonl`` and ``{split}.jsonl`` per question split; returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"corpus": out / "corpus.jsonl"}
    write_jsonl(world.corpus, paths["corpus"])
    for split, rows in world.questions.items():
        paths[split] = out / f"{split}.jsonl"
        write_jsonl(rows, paths[split])
    return paths


def search_extra(question: dict[str, Any]) -> dict[str, Any]:
    """The search fields a verl row's ``extra_info`` carries for a question record."""
    return {"id": question["id"], "hops": question["hops"], "support_ids": list(question["support_ids"]),
            "hop_queries": list(question["hop_queries"])}  # fmt: skip


def rows_to_parquet(rows: Sequence[dict[str, Any]], out_path: str | Path) -> Path:
    """Write verl rows to ``out_path`` (parent folders created)."""
    import pandas as pd

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(out, index=False)
    return out
