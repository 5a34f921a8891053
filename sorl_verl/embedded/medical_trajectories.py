"""Warm-start expert trajectories for the medical world, in the search agent's tag format.

After the chat-templated multiple-choice prompt (:func:`sorl_verl.agent.prompts.mcq_prompt`, the
prompt the parquet rows carry), a question over the chain ``R0 .. R(k-1)`` gets::

    <think> I need to search E0. </think>\n<search> E0 </search>       + information_block(top-k of E0)
    <think> R0 fact of E0 and E1. </think>\n<search> E1 </search>       + information_block(top-k of E1)
    <think> R(k-1) fact of E(k-1) and the answer A. </think>\n<answer> A </answer><|im_end|>

where ``Ei`` are the question's ``hop_queries`` and the observations come from the real retriever.
The answer is the gold option's text, which the MCQ reward reads as that option
(:mod:`sorl_verl.rewards.mcq`, rule 3), though the instruction asks for the letter: every way of
writing the letter that was tried (option checks inline, on lines or as the copied option block,
the letter after the answer's name, the answer's option line, with or without the option markers
as whole tokens, with option drills or twin worlds in the SFT data) left the tiny model's
warm-start at chance (docs/notes/2026-11-25-medical-experiments.md). Policy segments have loss
mask 1, prompt and observations 0 (:func:`sorl_verl.embedded.warmstart.tokenize_trajectory`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from sorl_verl.agent.prompts import mcq_prompt
from sorl_verl.embedded.medical_world import RELATIONS, MedicalWorld
from sorl_verl.embedded.warmstart import (
    Observer,
    demonstration_examples,
    early_stop_search_segments,
    expert_search_segments,
)


def user_message(question: dict[str, Any]) -> str:
    """The user message of a question record: exactly the prompt of its parquet row."""
    return mcq_prompt(question["question"], question["options"])


def _fact(rel: str, subject: str, value: str) -> str:
    text = RELATIONS[rel].fact.format(x=subject, y=value)
    return text[0].upper() + text[1:]


def expert_segments(question: dict[str, Any], observe: Observer) -> list[tuple[str, bool]]:
    """The scripted response as ``(text, is_policy)`` segments (EOS not included)."""
    hops, chain = question["hop_queries"], question["chain"]
    fact = _fact(chain[-1], hops[-1], question["answer"])
    return expert_search_segments(question, _fact, observe, fact, question["answer"])


def early_stop_segments(question: dict[str, Any], observe: Observer) -> list[tuple[str, bool]]:
    """One search, then the fact it found and the bridge entity's name as answer (a two-hop question only).

    The bridge (the diagnosis of a finding, the first-line drug of a condition) is of another kind than
    the options, so the MCQ reward scores this answer 0: the demonstration of an agent that stops a
    search too early, which RL can learn to correct (the QA early-stop warm-start's medical analogue).
    """
    return early_stop_search_segments(question, _fact, observe)


def sft_questions(
    world: MedicalWorld, questions: Sequence[dict[str, Any]], per_type: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Training questions with extra option draws, about ``per_type`` of each type.

    Each question keeps its own options once and gets ``ceil(per_type / n_type) - 1`` fresh draws
    (ids suffixed ``~1``, ``~2``, ...), so small types are not drowned by large ones and the model
    sees each answer at several letters.
    """
    rng = random.Random(seed)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for q in questions:
        by_type.setdefault(q["type"], []).append(q)
    out: list[dict[str, Any]] = []
    for qtype in sorted(by_type):
        qs = by_type[qtype]
        draws = max(1, -(-per_type // len(qs)))
        for q in qs:
            out.append(q)
            out += [world.with_options(q, rng, suffix=f"~{d}") for d in range(1, draws)]
    return out


def build_medical_sft_examples(
    tokenizer,
    questions: Sequence[dict[str, Any]],
    observe: Observer,
    progress: bool = True,
    early_stop_rate: float = 0.0,
    seed: int = 0,
) -> list[tuple[list[int], list[int]]]:
    """Demonstrations of ``questions`` after their own prompts (:func:`user_message`): the expert's, or with
    probability ``early_stop_rate`` per two-hop question the early-stopping one."""
    return demonstration_examples(
        tokenizer,
        questions,
        observe,
        expert_segments,
        early_stop_segments,
        early_stop_rate,
        seed,
        user_message,
        progress,
    )
