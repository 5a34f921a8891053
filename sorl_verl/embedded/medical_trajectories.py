"""Warm-start expert trajectories for the medical world, in the search agent's tag format.

After the chat-templated multiple-choice prompt (:func:`sorl_verl.agent.prompts.mcq_prompt`, the
prompt the parquet rows carry), a question over the chain ``R0 .. R(k-1)`` gets::

    <think> I need to search E0. </think>\\n<search> E0 </search>       + information_block(top-k of E0)
    <think> R0 fact of E0 and E1. </think>\\n<search> E1 </search>       + information_block(top-k of E1)
    <think> R(k-1) fact of E(k-1) and the answer A. A. text no. B. text no. L. A yes. </think>\\n<answer> L </answer><|im_end|>

where ``Ei`` are the question's ``hop_queries``, ``L`` is the gold option letter (the options are
checked in letter order up to the gold one, :func:`option_checks`) and the
observations come from the real retriever. Policy segments have loss mask 1, prompt and
observations 0 (:func:`sorl_verl.data.warmstart.tokenize_trajectory`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from sorl_verl.agent.prompts import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    information_block,
    mcq_prompt,
)
from sorl_verl.data.warmstart import Observer, tokenize_trajectory
from sorl_verl.embedded.medical_world import RELATIONS, MedicalWorld


def user_message(question: dict[str, Any]) -> str:
    """The user message of a question record: exactly the prompt of its parquet row."""
    return mcq_prompt(question["question"], question["options"])


def _fact(rel: str, subject: str, value: str) -> str:
    text = RELATIONS[rel].fact.format(x=subject, y=value)
    return text[0].upper() + text[1:]


def expert_segments(question: dict[str, Any], observe: Observer) -> list[tuple[str, bool]]:
    """The scripted response as ``(text, is_policy)`` segments (EOS not included)."""
    hops, chain = question["hop_queries"], question["chain"]
    answer, letter = question["answer"], question["answer_idx"]
    observations = observe(list(hops))
    segs: list[tuple[str, bool]] = []
    for i, query in enumerate(hops):
        thought = f"I need to search {query}." if i == 0 else _fact(chain[i - 1], hops[i - 1], query)
        segs.append((f"{THINK_OPEN} {thought} {THINK_CLOSE}\n{SEARCH_OPEN} {query} {SEARCH_CLOSE}", True))
        segs.append((information_block(observations[i]), False))
    final = " ".join([_fact(chain[-1], hops[-1], answer), *option_checks(question["options"], letter)])
    segs.append((f"{THINK_OPEN} {final} {THINK_CLOSE}\n{ANSWER_OPEN} {letter} {ANSWER_CLOSE}", True))
    return segs


def option_checks(options: dict[str, str], letter: str) -> list[str]:
    """``"A. text no."`` for each option before the gold one, then ``"L. text yes."`` (options in letter order).

    The answer letter is then the last letter written, and each line is a copy of a prompt line:
    a lookup a small model learns, unlike mapping the answer's text to its letter in one step.
    """
    checks = []
    for key, text in sorted(options.items()):
        checks.append(f"{key}. {text} {'yes' if key == letter else 'no'}.")
        if key == letter:
            return checks
    raise ValueError(f"gold letter {letter!r} is not among the options {sorted(options)}")


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
    tokenizer, questions: Sequence[dict[str, Any]], observe: Observer, progress: bool = True
) -> list[tuple[list[int], list[int]]]:
    """Expert trajectories of ``questions``, tokenized as ``(input_ids, loss_mask)``."""
    from tqdm.auto import tqdm

    return [
        tokenize_trajectory(tokenizer, q["question"], expert_segments(q, observe), prompt=user_message(q))
        for q in tqdm(questions, desc="expert trajectories", disable=not progress, mininterval=2)
    ]
