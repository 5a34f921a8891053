"""Open-domain QA scoring in the Search-R1 / SQuAD convention.

``normalize_answer``: lowercase, drop punctuation, drop the articles a/an/the, collapse
whitespace. Exact match (EM) is 1 when the normalized prediction equals any normalized gold;
substring EM is 1 when any normalized gold occurs inside the normalized prediction; F1 is the
token-overlap F1 against the best-matching gold. A gold that normalizes to the empty string
("A", "The", "?") never matches anything: it would otherwise pay an empty or punctuation-only answer.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation, remove articles, collapse whitespace."""
    text = str(text).lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalized_golds(golds: str | Iterable[str]) -> list[str]:
    """The golds that can be matched: normalized, empty ones dropped."""
    items = [golds] if isinstance(golds, str) else [str(g) for g in golds]
    return [norm for norm in (normalize_answer(g) for g in items) if norm]


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 if the normalized prediction equals any non-empty normalized gold, else 0.0."""
    pred = normalize_answer(prediction)
    return float(pred in normalized_golds(golds))


def substring_exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 if any non-empty normalized gold is a substring of the normalized prediction."""
    pred = normalize_answer(prediction)
    return float(any(gold in pred for gold in normalized_golds(golds)))


def f1_score(prediction: str, golds: str | Iterable[str]) -> float:
    """Max over non-empty golds of token-level F1 = 2PR/(P+R) between normalized token bags."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in normalized_golds(golds):
        gold_tokens = gold.split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best
