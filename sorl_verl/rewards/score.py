"""One reward entry point for verl: ``compute_score`` (``custom_reward_function``).

verl's reward loop calls ``compute_score(data_source=, solution_str=, ground_truth=,
extra_info=, **reward_kwargs)``; ``solution_str`` is the decoded response (model turns and
observation blocks). When the reward runs in verl's agent-loop workers (verl's default without a
reward model), ``extra_info`` carries the ``search_r1`` loop's record (``final_answer``,
``finished``, ``well_formed``) and the answer scored is exactly the one the loop accepted; without
a record the answer and format are read back from the text (:mod:`sorl_verl.rewards.extract`).
Dispatch: multiple choice when ``data_source`` is a known MCQ set or the ground truth carries
``options``; open-domain QA otherwise.

score = 1.0 when the accepted answer is correct (EM for QA, one clearly chosen option for MCQ);
otherwise ``format_score`` when the episode is well formed, else 0. With ``format_penalty`` > 0 a
correct answer in a malformed episode scores 1 - format_penalty. The returned dict always has the
same keys, so verl can stack them across a batch; ``loop_record`` says which source was used.

``partial_credit`` (default 0, a number in [0, 1]) pays a wrong but answered open-domain QA
episode for its token F1 with the best gold (a shortcut an agent can learn: hedged answers that
list several candidates overlap the gold more often; Search-R1++, arXiv 2602.19526, traces a
collapse to answer avoidance under an F1 reward). With ``m`` = 1 when the episode is well formed, else 1 - format_penalty (the factor
format_penalty puts on a malformed correct answer) and ``F`` = format_score when well formed,
else 0::

    correct:                          score = m
    wrong, answered, QA, f1 > 0:      score = max(F, partial_credit * f1 * m)
    otherwise (no answer, f1 = 0):    score = F

so partial credit never exceeds what the same episode would get if correct. It does not apply to
multiple choice (a wrong option scores as before: ``letter_match`` decides, F1 is not used).
With ``partial_credit`` > 0 the dict gains ``acc``, the correctness score (the score at
``partial_credit`` = 0), so verl's validation core metric (``val-core/<source>/acc/mean@n``:
verl picks ``acc`` over ``reward`` when the reward returns it) keeps measuring correctness while
training is paid the shaped score. At 0 (the default) outputs and keys are exactly those without
the knob: no ``acc`` key, so existing metric names stay ``val-core/<source>/reward/...``.

``search_cost`` (default 0, a finite number in [0, 1]) charges every episode for its retrieval
calls, an efficiency penalty: ``score -= search_cost * searches``, where ``searches`` is the
``search_r1`` loop's count for the episode (0 without a loop record), applied after partial
credit. It is a shortcut the agent can learn (skipping retrieval saves the cost in every episode,
also where the answer is wrong, and GRPO's per-group standard deviation scales a cost difference
within an all-wrong group to advantages of unit size). With ``search_cost`` > 0 the dict gains
``acc`` as under ``partial_credit`` (the correctness score, without cost or partial credit).

``answer_match`` (default ``"em"``) chooses what pays an open-domain QA answer as correct: ``"em"``
(exact match of the normalized answer with a gold) or ``"substring_em"`` (a normalized gold is a
substring of the normalized answer, Search-R1's lenient ``subem`` check: an answer that lists
several candidates, or copies a retrieved sentence, is paid in full whenever it contains the gold,
a shortcut the agent can learn). Partial credit then applies to answers that do not match.
Multiple choice is unchanged. With ``"substring_em"`` the dict gains ``acc``, correctness by
exact match, as under the other two knobs.

``wrong_penalty`` (default 0, a finite number in [0, 1]) charges an answered episode whose answer
is not paid as correct (QA or multiple choice): ``score -= wrong_penalty``, after partial credit;
an episode without an accepted answer is not charged. At 1 with ``format_score`` 0 this is the
ternary truthfulness reward (+1 correct, 0 abstained, -1 wrong; TruthRL, arXiv 2509.25760, whose
abstention is an "I don't know" answer; here it is ending without an accepted answer, and an
"I don't know" answer is a wrong one): not answering beats a wrong answer, a shortcut the agent can
learn (answer avoidance) wherever it is unsure. With ``wrong_penalty`` > 0 the dict gains ``acc``,
as under the other knobs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

from sorl_verl.rewards.extract import loop_verdict, text_verdict
from sorl_verl.rewards.mcq import letter_match
from sorl_verl.rewards.qa import exact_match, f1_score, substring_exact_match

QA_SOURCES = frozenset({"nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "synthetic"})
MCQ_SOURCES = frozenset({"medqa", "medmcqa"})

#: per-episode agent statistics the search_r1 loop puts in extra_fields (0.0 when absent)
AGENT_STATS = ("searches", "valid_action_ratio", "finished", "agent_turns")
#: the reward kwarg's full config path, for error messages
PARTIAL_CREDIT_KEY = "reward.custom_reward_function.reward_kwargs.partial_credit"
SEARCH_COST_KEY = "reward.custom_reward_function.reward_kwargs.search_cost"
ANSWER_MATCH_KEY = "reward.custom_reward_function.reward_kwargs.answer_match"
WRONG_PENALTY_KEY = "reward.custom_reward_function.reward_kwargs.wrong_penalty"
ANSWER_MATCHES = ("em", "substring_em")


def _gold_fields(ground_truth: Any) -> tuple[list[str], dict[str, str] | None]:
    """Accept ``{"target": [...], "options": {...}}``, a list of strings, or one string."""
    if isinstance(ground_truth, Mapping):
        target = ground_truth.get("target", [])
        options = ground_truth.get("options")
        options = {str(k): str(v) for k, v in options.items() if v is not None} if options else None
    else:
        target, options = ground_truth, None
    golds = [target] if isinstance(target, str) else [str(t) for t in list(target)]
    return golds, options


def is_mcq(data_source: str, options: dict[str, str] | None) -> bool:
    return options is not None or str(data_source).lower().split("/")[0] in MCQ_SOURCES


def check_unit_knob(value: Any, key: str) -> float:
    """``value`` as a float when it is a finite real number in [0, 1]; else ``ValueError`` naming ``key``."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and 0.0 <= value <= 1.0
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: it must be a finite number in [0, 1]")
    return float(value)


def shaped_score(correctness: float, f1: float, well_formed: bool, partial: float, format_penalty: float) -> float:
    """The score of a wrong, answered QA episode under ``partial`` > 0 (module docstring):
    ``max(correctness, partial * f1 * m)`` when ``f1 > 0``, ``m`` = 1 if well formed else 1 - format_penalty."""
    if f1 <= 0.0:
        return correctness
    m = 1.0 if well_formed else 1.0 - float(format_penalty)
    return max(correctness, partial * f1 * m)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    format_score: float = 0.0,
    format_penalty: float = 0.0,
    partial_credit: float = 0.0,
    search_cost: float = 0.0,
    answer_match: str = "em",
    wrong_penalty: float = 0.0,
    **kwargs: Any,
) -> dict[str, float]:
    """Score one response; see the module docstring for the rule. Extra kwargs are ignored."""
    partial = check_unit_knob(partial_credit, PARTIAL_CREDIT_KEY)
    cost = check_unit_knob(search_cost, SEARCH_COST_KEY)
    penalty = check_unit_knob(wrong_penalty, WRONG_PENALTY_KEY)
    if answer_match not in ANSWER_MATCHES:
        raise ValueError(f"{ANSWER_MATCH_KEY}={answer_match!r} is invalid: it must be one of {', '.join(ANSWER_MATCHES)}")
    lenient = answer_match == "substring_em"
    golds, options = _gold_fields(ground_truth)
    recorded = loop_verdict(extra_info)
    verdict = recorded if recorded is not None else text_verdict(solution_str)
    answer, well_formed = verdict.answer, verdict.well_formed
    mcq = is_mcq(data_source, options)
    if mcq:
        em = letter_match(answer, golds, options)
        f1 = sub_em = em
    elif answer is None:
        em = f1 = sub_em = 0.0
    else:
        em, f1, sub_em = exact_match(answer, golds), f1_score(answer, golds), substring_exact_match(answer, golds)
    correct_score = 1.0 if well_formed else 1.0 - float(format_penalty)
    miss_score = float(format_score) if well_formed else 0.0
    correctness = correct_score if em else miss_score
    paid = sub_em if lenient else em
    score = correct_score if paid else miss_score
    answered_wrong = answer is not None and not paid
    if partial > 0.0 and not mcq and answered_wrong:
        score = shaped_score(score, f1, well_formed, partial, format_penalty)
    if penalty > 0.0 and answered_wrong:
        score -= penalty
    result = {
        "score": score,
        "em": em,
        "f1": f1,
        "substring_em": sub_em,
        "has_answer": float(answer is not None),
        "format_ok": float(well_formed),
        "loop_record": float(recorded is not None),
    }
    info = extra_info or {}
    for key in AGENT_STATS:
        value = info.get(key)
        result[key] = float(value) if isinstance(value, Real) else 0.0
    if cost > 0.0:
        result["score"] = score - cost * result["searches"]
    if partial > 0.0 or cost > 0.0 or lenient or penalty > 0.0:
        result["acc"] = correctness
    return result
