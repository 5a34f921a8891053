"""Warm-start expert trajectories of the QA world and their exact-match evaluation.

A k-hop question gets :func:`sorl_verl.embedded.warmstart.expert_search_segments` with the
thoughts ``The R(i) of E(i) is E(i+1).`` and the answer string in ``<answer>``::

    <think> I need to search E0. </think>\\n<search> E0 </search>   + information_block(top-3 of E0)
    <think> The R0 of E0 is E1. </think>\\n<search> E1 </search>     + information_block(top-3 of E1)
    <think> The R1 of E1 is A. </think>\\n<answer> A </answer><|im_end|>
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sorl_verl.embedded.qa_world import RELATIONS
from sorl_verl.embedded.warmstart import (
    Observer,
    demonstration_examples,
    early_stop_search_segments,
    expert_search_segments,
    greedy_rollouts,
    grouped_rates,
)


def _fact(rel: str, subject: str, value: str) -> str:
    phrase = RELATIONS[rel].phrase.format(x=subject)
    return f"{phrase[0].upper()}{phrase[1:]} is {value}."


def expert_segments(question: dict[str, Any], observe: Observer) -> list[tuple[str, bool]]:
    """The scripted response as ``(text, is_policy)`` segments (EOS not included)."""
    hops, chain, answer = question["hop_queries"], question["chain"], question["golden_answers"][0]
    return expert_search_segments(question, _fact, observe, _fact(chain[-1], hops[-1], answer), answer)


def early_stop_segments(question: dict[str, Any], observe: Observer) -> list[tuple[str, bool]]:
    """One search, then the fact it found as conclusion and its value (the bridge entity) as answer."""
    return early_stop_search_segments(question, _fact, observe)


def build_qa_sft_examples(
    tokenizer,
    questions: Sequence[dict[str, Any]],
    observe: Observer,
    progress: bool = True,
    early_stop_rate: float = 0.0,
    seed: int = 0,
) -> list[tuple[list[int], list[int]]]:
    """Demonstrations of ``questions``, tokenized as ``(input_ids, loss_mask)``: the expert's, or with
    probability ``early_stop_rate`` per multi-hop question the early-stopping one."""
    return demonstration_examples(
        tokenizer, questions, observe, expert_segments, early_stop_segments, early_stop_rate, seed, progress=progress
    )


def evaluate_em(
    model, tokenizer, questions: Sequence[dict[str, Any]], observe: Observer, **rollout_kwargs: Any
) -> dict[str, Any]:
    """Greedy success rate: ``em`` overall and ``em_{k}hop`` per hop count, plus timing and samples."""
    from sorl_verl.rewards.score import compute_score

    t0 = time.perf_counter()
    responses = greedy_rollouts(model, tokenizer, questions, observe, **rollout_kwargs)
    scores = [
        compute_score(f"synthetic_{q['hops']}hop", r, {"target": q["golden_answers"]})["em"]
        for q, r in zip(questions, responses, strict=True)
    ]
    result: dict[str, Any] = {
        "em": sum(scores) / max(1, len(scores)),
        "n": len(scores),
        "seconds": time.perf_counter() - t0,
    }
    result |= grouped_rates(questions, scores, "hops", "em", "{}hop")
    result["samples"] = [
        {"question": q["question"], "gold": q["golden_answers"], "response": r}
        for q, r in list(zip(questions, responses, strict=True))[:3]
    ]
    return result
