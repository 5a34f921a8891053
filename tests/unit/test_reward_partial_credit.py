"""``compute_score(partial_credit=..., search_cost=..., answer_match=...)``: the opt-in shortcut
rewards (sorl_verl/rewards/score.py).

At the default 0 every output is bit for bit the rule without the knobs (a frozen copy of it below,
against a few thousand random episodes); above 0 a wrong answered QA episode scores
``max(F, partial_credit * f1 * m)``, multiple choice is unchanged, a search cost subtracts
``search_cost * searches`` from every episode's score, ``answer_match="substring_em"`` pays an answer
containing a gold in full, and ``acc`` carries the correctness score
that verl's validation then reports as its core metric.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_verl.rewards import compute_score
from sorl_verl.rewards.extract import loop_verdict, text_verdict
from sorl_verl.rewards.mcq import letter_match
from sorl_verl.rewards.qa import exact_match, f1_score, substring_exact_match
from sorl_verl.rewards.score import (
    AGENT_STATS,
    ANSWER_MATCH_KEY,
    MCQ_SOURCES,
    PARTIAL_CREDIT_KEY,
    SEARCH_COST_KEY,
    WRONG_PENALTY_KEY,
)

#: the keys compute_score returned before partial_credit existed (and still returns at 0)
KEYS_WITHOUT_ACC = ("score", "em", "f1", "substring_em", "has_answer", "format_ok", "loop_record", *AGENT_STATS)


def score_before_partial_credit(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    format_score: float = 0.0,
    format_penalty: float = 0.0,
) -> dict[str, float]:
    """A frozen copy of compute_score's rule as it was before ``partial_credit`` (commit ed1d55e)."""
    if isinstance(ground_truth, Mapping):
        target, options = ground_truth.get("target", []), ground_truth.get("options")
        options = {str(k): str(v) for k, v in options.items() if v is not None} if options else None
    else:
        target, options = ground_truth, None
    golds = [target] if isinstance(target, str) else [str(t) for t in list(target)]
    recorded = loop_verdict(extra_info)
    verdict = recorded if recorded is not None else text_verdict(solution_str)
    answer, well_formed = verdict.answer, verdict.well_formed
    if options is not None or str(data_source).lower().split("/")[0] in MCQ_SOURCES:
        em = letter_match(answer, golds, options)
        f1 = sub_em = em
    elif answer is None:
        em = f1 = sub_em = 0.0
    else:
        em, f1, sub_em = exact_match(answer, golds), f1_score(answer, golds), substring_exact_match(answer, golds)
    correct_score = 1.0 if well_formed else 1.0 - float(format_penalty)
    result = {
        "score": correct_score if em else (float(format_score) if well_formed else 0.0),
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
    return result


# ------------------------------------------------------------------ random episodes

WORDS = ["Paris", "Lyon", "France", "the", "city", "of", "Marie", "Curie", "Pierre", "B", "A", "Heparin", "1867", ","]
OPTIONS = {"A": "Ibuprofen", "B": "Heparin", "C": "Warfarin", "D": "Aspirin"}
phrase = st.lists(st.sampled_from(WORDS), min_size=0, max_size=5).map(" ".join)
#: hedges and near misses share tokens with the golds below (QA: the partial-credit branch; MCQ: none)
near_miss = st.sampled_from(
    ["Paris or Lyon", "Paris, France", "Marie Curie or Pierre Curie", "Curie", "the city", "C or B", "Heparin or Aspirin"]
)
answer_text = phrase | near_miss | st.text(max_size=12)
wrappers = st.sampled_from(
    [
        "<think>t</think><answer>{}</answer>",  # well formed
        "<answer>{}</answer>",  # well formed
        "<answer>x <answer>{}</answer>",  # answered, malformed (nested)
        "<think>a</think><search>q</search>\n\n<information>d</information>\n\n<answer>{}</answer>",
        "<answer>{}",  # no answer
        "{}",  # no tags
        "<answer>{}</answer><think>after</think>",  # answer not last: no answer
    ]
)
qa_truth = st.lists(phrase | st.sampled_from(["Paris", "Marie Curie", "City of Paris"]), min_size=1, max_size=3).map(
    lambda golds: {"target": golds}
) | st.sampled_from(["Paris", ["Lyon", "Paris"]])
mcq_truth = st.sampled_from(sorted(OPTIONS)).map(lambda letter: {"target": [letter], "options": OPTIONS})
record = st.none() | st.fixed_dictionaries(
    {
        "final_answer": answer_text,
        "finished": st.sampled_from([0.0, 1.0, True]),
        "well_formed": st.sampled_from([0.0, 1.0]),
        "searches": st.integers(0, 4),
        "agent_turns": st.integers(1, 5),
    }
)
knob = st.sampled_from([0.0, 0.1, 0.25, -0.5, 1.0]) | st.floats(-2, 2, allow_nan=False)


@st.composite
def episodes(draw: st.DrawFn) -> dict[str, Any]:
    """One compute_score call: a QA or MCQ source, a response, a ground truth, maybe a loop record."""
    source = draw(st.sampled_from(["nq", "hotpotqa", "synthetic_2hop", "custom", "medqa", "medmcqa"]))
    mcq = source in MCQ_SOURCES or draw(st.booleans()) and source == "custom"
    truth = draw(mcq_truth if mcq else qa_truth)
    return {
        "data_source": source,
        "solution_str": draw(wrappers).format(draw(answer_text)),
        "ground_truth": truth,
        "extra_info": draw(record),
        "format_score": draw(knob),
        "format_penalty": draw(knob),
    }


@settings(max_examples=3000)
@given(call=episodes(), zero=st.sampled_from([0.0, 0, None]))
def test_default_zero_is_bit_for_bit_the_rule_without_the_knob(call: dict[str, Any], zero: float | None) -> None:
    expected = score_before_partial_credit(**call)
    got = compute_score(**call) if zero is None else compute_score(**call, partial_credit=zero, search_cost=zero)
    assert tuple(got) == KEYS_WITHOUT_ACC and tuple(expected) == KEYS_WITHOUT_ACC  # same keys, same order
    for key in KEYS_WITHOUT_ACC:  # same values and types (0.0 and -0.0 told apart through copysign)
        assert type(got[key]) is type(expected[key]), key
        assert got[key] == expected[key] and math.copysign(1, got[key]) == math.copysign(1, expected[key]), key


@settings(max_examples=1500)
@given(call=episodes(), partial=st.floats(0.0, 1.0, exclude_min=True))
def test_positive_partial_credit_follows_the_formula(call: dict[str, Any], partial: float) -> None:
    base = score_before_partial_credit(**call)
    got = compute_score(**call, partial_credit=partial)
    assert tuple(got) == (*KEYS_WITHOUT_ACC, "acc")
    assert got["acc"] == base["score"]  # correctness: the score at partial_credit 0
    assert {k: v for k, v in got.items() if k not in ("score", "acc")} == {
        k: v for k, v in base.items() if k != "score"
    }
    mcq = "options" in call["ground_truth"] if isinstance(call["ground_truth"], Mapping) else False
    mcq = mcq or call["data_source"] in MCQ_SOURCES
    if mcq or base["em"] or not base["has_answer"] or base["f1"] == 0.0:
        assert got["score"] == base["score"]
    else:
        m = 1.0 if base["format_ok"] else 1.0 - call["format_penalty"]
        assert got["score"] == max(base["score"], partial * base["f1"] * m)


GT = {"target": ["Marie Curie"]}
HEDGE = "<think>t</think><answer>Marie Curie or Pierre Curie</answer>"
HEDGE_F1 = 4 / 7  # 5 answer tokens, 2 shared with the gold (curie once): P = 2/5, R = 1, 2PR/(P+R) = 4/7


def test_hand_checked_cases() -> None:
    assert f1_score("Marie Curie or Pierre Curie", GT["target"]) == pytest.approx(HEDGE_F1)
    r = compute_score("nq", HEDGE, GT, partial_credit=1.0)
    assert r["score"] == pytest.approx(HEDGE_F1) and r["acc"] == 0.0 and r["em"] == 0.0
    assert compute_score("nq", HEDGE, GT, partial_credit=0.5)["score"] == pytest.approx(0.5 * HEDGE_F1)
    # format_score wins when it pays more than the partial credit
    assert compute_score("nq", HEDGE, GT, partial_credit=0.5, format_score=0.4)["score"] == pytest.approx(0.4)
    # a correct answer scores as without the knob; acc agrees
    right = compute_score("nq", "<answer>marie curie</answer>", GT, partial_credit=1.0)
    assert (right["score"], right["acc"]) == (1.0, 1.0)
    # malformed (nested answer): the partial credit takes format_penalty's factor 1 - format_penalty
    nested = "<answer>x <answer>Marie Curie or Pierre Curie</answer>"
    r = compute_score("nq", nested, GT, partial_credit=1.0, format_penalty=0.2)
    assert r["format_ok"] == 0.0 and r["score"] == pytest.approx(0.8 * HEDGE_F1) and r["acc"] == 0.0
    assert compute_score("nq", nested, GT, partial_credit=1.0)["score"] == pytest.approx(HEDGE_F1)
    # no overlap, no answer, empty answer: no partial credit
    assert compute_score("nq", "<answer>Lyon</answer>", GT, partial_credit=1.0)["score"] == 0.0
    assert compute_score("nq", "<answer>Marie Curie", GT, partial_credit=1.0)["score"] == 0.0
    assert compute_score("nq", "<answer></answer>", GT, partial_credit=1.0, format_score=-0.5)["score"] == -0.5
    # the loop's record decides the answer, as without the knob
    rec = {"final_answer": "Marie Curie or Pierre Curie", "finished": 1.0, "well_formed": 1.0}
    assert compute_score("nq", "", GT, extra_info=rec, partial_credit=1.0)["score"] == pytest.approx(HEDGE_F1)


def test_multiple_choice_gets_no_partial_credit() -> None:
    gt = {"target": ["B"], "options": OPTIONS}
    # a hedge over letters / option texts overlaps the gold in tokens (F1 0.5 against "B") but is no choice
    assert f1_score("A or B", ["B"]) > 0 and f1_score("Heparin or Aspirin", [OPTIONS["B"]]) > 0
    for answer in ("A or B", "Heparin or Aspirin", "A B", "Heparin, Aspirin", "C"):
        for source in ("medqa", "custom"):
            r = compute_score(source, f"<answer>{answer}</answer>", gt, partial_credit=1.0)
            assert (r["score"], r["acc"], r["em"]) == (0.0, 0.0, 0.0), (source, answer)
    r = compute_score("medmcqa", "<answer>B</answer>", {"target": ["B"]}, partial_credit=1.0)
    assert (r["score"], r["acc"]) == (1.0, 1.0)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf, -math.inf, "0.5", None, True, [1.0]])
def test_invalid_partial_credit_is_refused_naming_the_setting(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"partial_credit=.* is invalid: it must be a finite number in \[0, 1\]") as e:
        compute_score("nq", "<answer>x</answer>", GT, partial_credit=bad)
    assert PARTIAL_CREDIT_KEY in str(e.value)


@pytest.mark.parametrize("ok", [0, 1, 0.0, 1.0, 0.5])
def test_boundaries_are_accepted(ok: float) -> None:
    r = compute_score("nq", HEDGE, GT, partial_credit=ok)
    assert ("acc" in r) is (ok > 0)


@settings(max_examples=1500)
@given(call=episodes(), partial=st.sampled_from([0.0, 0.5, 1.0]), cost=st.floats(0.0, 1.0, exclude_min=True))
def test_search_cost_subtracts_cost_times_searches(call: dict[str, Any], partial: float, cost: float) -> None:
    without = compute_score(**call, partial_credit=partial)
    got = compute_score(**call, partial_credit=partial, search_cost=cost)
    assert tuple(got) == (*KEYS_WITHOUT_ACC, "acc")
    assert got["score"] == without["score"] - cost * without["searches"]
    assert got["acc"] == score_before_partial_credit(**call)["score"]  # correctness: neither knob
    assert {k: v for k, v in got.items() if k not in ("score", "acc")} == {
        k: v for k, v in without.items() if k not in ("score", "acc")
    }


def test_search_cost_hand_checked() -> None:
    rec = {"final_answer": "Marie Curie", "finished": 1.0, "well_formed": 1.0, "searches": 2}
    right = compute_score("synthetic_2hop", "", GT, extra_info=rec, search_cost=0.1)
    assert right["score"] == pytest.approx(0.8) and (right["acc"], right["searches"]) == (1.0, 2.0)
    wrong = compute_score("synthetic_2hop", "", GT, extra_info={**rec, "final_answer": "Lyon"}, search_cost=0.1)
    assert wrong["score"] == pytest.approx(-0.2) and wrong["acc"] == 0.0
    no_search = compute_score("nq", "", GT, extra_info={**rec, "final_answer": "Lyon", "searches": 0}, search_cost=0.1)
    assert (no_search["score"], no_search["acc"]) == (0.0, 0.0)
    # with partial credit the cost comes after it: a hedge with one search
    hedge = compute_score("nq", HEDGE, GT, extra_info=None, partial_credit=1.0, search_cost=0.25)
    assert hedge["searches"] == 0.0 and hedge["score"] == pytest.approx(HEDGE_F1)  # no loop record: no count
    hedged = {**rec, "final_answer": "Marie Curie or Pierre Curie", "searches": 1}
    r = compute_score("nq", "", GT, extra_info=hedged, partial_credit=1.0, search_cost=0.25)
    assert r["score"] == pytest.approx(HEDGE_F1 - 0.25) and r["acc"] == 0.0


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf, "0.1", None, True])
def test_invalid_search_cost_is_refused_naming_the_setting(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"search_cost=.* is invalid: it must be a finite number in \[0, 1\]") as e:
        compute_score("nq", "<answer>x</answer>", GT, search_cost=bad)
    assert SEARCH_COST_KEY in str(e.value)


@settings(max_examples=1500)
@given(call=episodes(), partial=st.sampled_from([0.0, 0.5, 1.0]), cost=st.sampled_from([0.0, 0.1]))
def test_substring_match_pays_an_answer_containing_a_gold(call: dict[str, Any], partial: float, cost: float) -> None:
    knobs = {"partial_credit": partial, "search_cost": cost}
    strict = compute_score(**call, **knobs)
    got = compute_score(**call, **knobs, answer_match="substring_em")
    assert tuple(got) == (*KEYS_WITHOUT_ACC, "acc")
    assert got["acc"] == score_before_partial_credit(**call)["score"]  # correctness by exact match
    assert {k: v for k, v in got.items() if k not in ("score", "acc")} == {
        k: v for k, v in strict.items() if k not in ("score", "acc")
    }
    if got["substring_em"] and not got["em"]:  # a QA answer containing a gold: paid as a correct one
        m = 1.0 if got["format_ok"] else 1.0 - call["format_penalty"]
        assert got["score"] == m - cost * got["searches"]
    else:  # exact, multiple choice (substring_em is em there) or no gold inside: as under "em"
        assert got["score"] == strict["score"]


def test_substring_match_hand_checked() -> None:
    for answer in ("Marie Curie or Pierre Curie", "Marie Curie was born in Warsaw", "marie curie"):
        r = compute_score("nq", f"<answer>{answer}</answer>", GT, answer_match="substring_em")
        assert (r["score"], r["acc"]) == (1.0, float(answer == "marie curie")), answer
    assert compute_score("nq", "<answer>Curie</answer>", GT, answer_match="substring_em")["score"] == 0.0
    # partial credit still pays a wrong answer that overlaps the gold without containing it
    r = compute_score("nq", "<answer>Pierre Curie</answer>", GT, answer_match="substring_em", partial_credit=1.0)
    assert r["score"] == pytest.approx(f1_score("Pierre Curie", GT["target"])) and r["acc"] == 0.0
    # multiple choice: a hedge over letters chooses nothing, under either match
    gt = {"target": ["B"], "options": OPTIONS}
    assert compute_score("medqa", "<answer>A or B</answer>", gt, answer_match="substring_em")["score"] == 0.0


@pytest.mark.parametrize("bad", ["EM", "subem", "substring", "", None, 1])
def test_invalid_answer_match_is_refused_naming_the_setting(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"answer_match=.* is invalid: it must be one of em, substring_em") as e:
        compute_score("nq", "<answer>x</answer>", GT, answer_match=bad)
    assert ANSWER_MATCH_KEY in str(e.value)


@settings(max_examples=1500)
@given(
    call=episodes(),
    knobs=st.fixed_dictionaries(
        {
            "partial_credit": st.sampled_from([0.0, 0.5, 1.0]),
            "search_cost": st.sampled_from([0.0, 0.1]),
            "answer_match": st.sampled_from(["em", "substring_em"]),
        }
    ),
    penalty=st.floats(0.0, 1.0, exclude_min=True),
)
def test_wrong_penalty_charges_answered_episodes_not_paid_as_correct(
    call: dict[str, Any], knobs: dict[str, Any], penalty: float
) -> None:
    without = compute_score(**call, **knobs)
    got = compute_score(**call, **knobs, wrong_penalty=penalty)
    assert tuple(got) == (*KEYS_WITHOUT_ACC, "acc")
    assert got["acc"] == score_before_partial_credit(**call)["score"]  # correctness: no knob
    paid = got["substring_em"] if knobs["answer_match"] == "substring_em" else got["em"]
    charged = got["has_answer"] == 1.0 and not paid
    assert got["score"] == pytest.approx(without["score"] - penalty * charged, abs=1e-12)
    assert {k: v for k, v in got.items() if k not in ("score", "acc")} == {
        k: v for k, v in without.items() if k not in ("score", "acc")
    }


def test_wrong_penalty_hand_checked() -> None:
    """At 1 (format_score 0) the ternary reward: +1 correct, 0 without an accepted answer, -1 wrong."""
    ternary = {"wrong_penalty": 1.0}
    assert compute_score("nq", "<answer>Marie Curie</answer>", GT, **ternary)["score"] == 1.0
    assert compute_score("nq", "<answer>Lyon</answer>", GT, **ternary)["score"] == -1.0
    assert compute_score("nq", "<answer>I don't know</answer>", GT, **ternary)["score"] == -1.0  # an answer
    for unanswered in ("<answer>Marie Curie", "<search>Marie Curie</search>", "Marie Curie"):
        r = compute_score("nq", unanswered, GT, **ternary)
        assert (r["score"], r["has_answer"], r["acc"]) == (0.0, 0.0, 0.0), unanswered
    # after partial credit: a hedge keeps its F1 less the penalty
    r = compute_score("nq", HEDGE, GT, partial_credit=1.0, wrong_penalty=0.5)
    assert r["score"] == pytest.approx(HEDGE_F1 - 0.5) and r["acc"] == 0.0
    # multiple choice: a wrong letter is charged, the right one is not
    gt = {"target": ["B"], "options": OPTIONS}
    assert compute_score("medqa", "<answer>C</answer>", gt, **ternary)["score"] == -1.0
    assert compute_score("medqa", "<answer>B</answer>", gt, **ternary)["score"] == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf, "1", None, True])
def test_invalid_wrong_penalty_is_refused_naming_the_setting(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"wrong_penalty=.* is invalid: it must be a finite number in \[0, 1\]") as e:
        compute_score("nq", "<answer>x</answer>", GT, wrong_penalty=bad)
    assert WRONG_PENALTY_KEY in str(e.value)
