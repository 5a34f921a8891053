"""One verl parquet row per question, the format every converter and generator writes.

Columns (what verl's RLHFDataset, reward loop and agent loop read):
``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": {"target": [...]}}``), ``extra_info`` and ``agent_name``.
"""

from __future__ import annotations

from typing import Any

from sorl_verl.agent.prompts import mcq_prompt, qa_prompt

AGENT_NAME = "search_r1"


def _row(
    data_source: str,
    prompt: str,
    ability: str,
    ground_truth: dict[str, Any],
    split: str,
    index: int,
    question: str,
    extra: dict[str, Any] | None,
    agent_name: str,
) -> dict[str, Any]:
    """The verl row both record kinds share: one user message, a rule reward on ``ground_truth``."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "question": question.strip(), **(extra or {})},
        "agent_name": agent_name,
    }


def qa_record(
    question: str,
    answers: list[str],
    data_source: str,
    split: str,
    index: int,
    extra: dict[str, Any] | None = None,
    agent_name: str = AGENT_NAME,
) -> dict[str, Any]:
    """Row for an open-domain question; ``answers`` are all accepted gold strings."""
    if not question.strip():
        raise ValueError(f"{data_source}/{split}#{index}: empty question")
    golds = [a for a in (str(x).strip() for x in answers) if a]
    if not golds:
        raise ValueError(f"{data_source}/{split}#{index}: no gold answer")
    ground_truth = {"target": golds}
    prompt = qa_prompt(question)
    return _row(data_source, prompt, "fact-reasoning", ground_truth, split, index, question, extra, agent_name)


def mcq_record(
    question: str,
    options: dict[str, str],
    answer_letter: str,
    data_source: str,
    split: str,
    index: int,
    extra: dict[str, Any] | None = None,
    agent_name: str = AGENT_NAME,
) -> dict[str, Any]:
    """Row for a multiple-choice question; the gold is the option letter."""
    letter = answer_letter.strip().upper()
    if letter not in options:
        raise ValueError(f"{data_source}/{split}#{index}: answer {letter!r} not among options {sorted(options)}")
    ground_truth = {"target": [letter], "options": dict(options)}
    prompt = mcq_prompt(question, options)
    return _row(data_source, prompt, "medical-mcq", ground_truth, split, index, question, extra, agent_name)
