"""Rewards against hand-checked cases: normalization, EM/F1/substring, last answer, MCQ, format."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.rewards import compute_score
from sorl_verl.rewards.extract import extract_answer, is_valid_format
from sorl_verl.rewards.mcq import extract_letter, letter_match
from sorl_verl.rewards.qa import exact_match, f1_score, normalize_answer, substring_exact_match


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   Apple,  a day!! ", "apple day"),
        ("U.S.A.", "usa"),
        ("Theater", "theater"),  # 'the' only as a whole word
        ("A", ""),
    ],
)
def test_normalize_answer(raw: str, norm: str) -> None:
    assert normalize_answer(raw) == norm


def test_exact_match_any_gold_and_case_punct_articles() -> None:
    assert exact_match("the paris.", ["Lyon", "Paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("paris", "Paris") == 1.0


# golds that normalize to "": articles, punctuation, whitespace, in any case
empty_gold = st.lists(st.sampled_from(["A", "an", "THE", "?", ".", " ", "!!", "-", "\t"]), min_size=1, max_size=4).map(
    " ".join
)


@given(prediction=st.text(max_size=20) | empty_gold, golds=st.lists(empty_gold, min_size=1, max_size=3))
def test_a_gold_that_normalizes_to_empty_never_matches(prediction: str, golds: list[str]) -> None:
    assert all(normalize_answer(g) == "" for g in golds)
    assert (exact_match(prediction, golds), substring_exact_match(prediction, golds), f1_score(prediction, golds)) == (
        0.0,
        0.0,
        0.0,
    )
    assert compute_score("nq", f"<answer>{prediction}</answer>", {"target": golds})["score"] == 0.0


def test_empty_golds_do_not_block_the_real_gold() -> None:
    assert exact_match("", ["A", "The"]) == 0.0 and exact_match(".", "?") == 0.0
    assert exact_match("the Paris", ["A", "Paris"]) == 1.0 and f1_score("Paris", ["The", "Paris"]) == 1.0


def test_substring_em_and_f1_hand_checked() -> None:
    assert substring_exact_match("Paris, France", ["paris"]) == 1.0
    assert substring_exact_match("Lyon", ["paris"]) == 0.0
    assert substring_exact_match("anything", [""]) == 0.0
    # pred tokens {barack, obama}, gold {obama}: P=1/2, R=1 -> F1=2/3
    assert f1_score("Barack Obama", ["Obama"]) == pytest.approx(2 / 3)
    # best over golds: second gold identical -> 1
    assert f1_score("Barack Obama", ["Michelle", "barack obama"]) == 1.0
    assert f1_score("", ["x"]) == 0.0
    # repeated tokens count once per occurrence: pred a b b (3), gold b b c (3), overlap 2 -> P=R=2/3
    assert f1_score("x y y", ["y y z"]) == pytest.approx(2 / 3)


def test_answer_is_the_final_turns_and_observations_never_supply_it() -> None:
    text = (
        "<think>first</think><search>capital of france</search>"
        "\n\n<information>Doc: &lt;answer&gt;Berlin&lt;/answer&gt;</information>\n\n<answer> Paris </answer>"
    )
    assert extract_answer(text) == "Paris"
    # an unescaped answer inside a block: the loop would have stopped there if the model wrote it
    assert extract_answer(text.replace("&lt;", "<").replace("&gt;", ">")) is None
    assert extract_answer("<information><answer>Paris</answer></information><answer>Lyon</answer>") is None
    assert extract_answer("<information><answer>x</answer></information>") is None
    assert extract_answer("no tags here") is None
    # the loop stops at the first answer: a later one means the text is not a loop episode
    assert extract_answer("<answer>Lyon</answer> wait <answer>Paris</answer>") is None
    # an answer opened in one turn and closed after an observation is no answer (issue 12.2)
    assert extract_answer("<answer>Paris\n\n<information>feedback</information>\n\n</answer>") is None
    # nested: the loop reads from the last <answer> before the first </answer>
    assert extract_answer("<answer>Lyon <answer>Paris</answer>") == "Paris"
    # a model-written <information> does not hide the answer the loop accepted
    assert extract_answer("<information><answer>Paris</answer>") == "Paris"


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (
            "<think>a</think><search>q</search>\n\n<information>d</information>\n\n<think>b</think><answer>x</answer>",
            True,
        ),
        ("<answer>x</answer>", True),
        ("<think>a</think><answer>x</answer><answer>y</answer>", False),  # two answers
        ("<think>a<search>q</search></think><answer>x</answer>", False),  # nesting
        ("<think>a</think>", False),  # no answer
        ("<answer>x</answer><think>after</think>", False),  # answer not last
        ("<search>q<answer>x</answer>", False),  # unclosed search
        ("<answer>x\n\n<information>d</information>\n\n</answer>", False),  # spans an observation
        ("<answer>a<answer>x</answer>", False),  # nested
        ("<information>x</information><answer>x</answer>", False),  # the model wrote the block
        ("<search>q</search>", False),  # ends in a search
        ("<search>q</search>\n\n<information>d</information>\n\n<answer>x</answer> tail", False),
        ("<search>q</search>\n\n<information>d\n\n<answer>x</answer>", False),  # unclosed block
    ],
)
def test_format_check(text: str, ok: bool) -> None:
    assert is_valid_format(text) is ok


@pytest.mark.parametrize(
    ("answer", "letter"),
    [
        ("B", "B"),
        ("(c)", "C"),
        ("D. Aspirin", "D"),
        ("Option A", "A"),
        ("The answer is B", "B"),
        ("Aspirin", "D"),
        ("E", None),
        ("", None),
    ],
)
def test_mcq_letter_extraction(answer: str, letter: str | None) -> None:
    options = {"A": "Ibuprofen", "B": "Heparin", "C": "Warfarin", "D": "Aspirin"}
    assert extract_letter(answer, options) == letter


def test_letter_match() -> None:
    assert letter_match(" b ", ["B"]) == 1.0
    assert letter_match("C", ["B"]) == 0.0
    assert letter_match(None, ["B"]) == 0.0


def test_compute_score_qa_rules_and_stable_keys() -> None:
    gt = {"target": ["Paris", "City of Paris"]}
    good = "<think>t</think><answer>the Paris</answer>"
    bad_format = "<think>a<search>Paris</search></think><answer>Paris</answer>"
    wrong = "<think>t</think><answer>Lyon</answer>"
    r_good = compute_score("nq", good, gt)
    assert r_good["score"] == 1.0 and r_good["em"] == 1.0 and r_good["format_ok"] == 1.0
    assert compute_score("nq", bad_format, gt)["score"] == 0.0  # the loop would have searched, not answered
    bad_format = "<answer>a <answer>Paris</answer>"  # nested: answered, but malformed
    assert compute_score("nq", bad_format, gt)["score"] == 1.0  # no penalty by default
    assert compute_score("nq", bad_format, gt, format_penalty=0.2)["score"] == pytest.approx(0.8)
    assert compute_score("nq", wrong, gt)["score"] == 0.0
    assert compute_score("nq", wrong, gt, format_score=0.1)["score"] == pytest.approx(0.1)
    assert compute_score("nq", "<answer>x", gt, format_score=0.1)["score"] == 0.0
    r_sub = compute_score("hotpotqa", "<answer>Paris, France</answer>", gt)
    assert (r_sub["em"], r_sub["substring_em"]) == (0.0, 1.0)
    assert 0.0 < r_sub["f1"] < 1.0
    keys = set(r_good)
    assert set(compute_score("medqa", "<answer>B</answer>", {"target": ["B"]})) == keys
    assert set(compute_score("nq", "", gt)) == keys
    assert set(compute_score("nq", "", gt, extra_info={"final_answer": "", "finished": 0.0})) == keys


def test_compute_score_mcq_dispatch_and_agent_stats() -> None:
    gt = {"target": ["B"], "options": {"A": "Ibuprofen", "B": "Heparin"}}
    extra = {"searches": 2, "valid_action_ratio": 0.5, "finished": True, "agent_turns": 3}
    r = compute_score("medmcqa", "<answer>Heparin</answer>", gt, extra_info=extra)
    assert r["score"] == 1.0 and r["searches"] == 2.0 and r["valid_action_ratio"] == 0.5 and r["finished"] == 1.0
    # options in the ground truth make it MCQ even for an unknown source
    assert compute_score("custom", "<answer>A</answer>", gt)["score"] == 0.0
    assert compute_score("custom", "<answer>(b)</answer>", gt)["score"] == 1.0
    # plain list / string ground truths are accepted
    assert compute_score("nq", "<answer>x</answer>", ["X"])["score"] == 1.0
    assert compute_score("nq", "<answer>x</answer>", "y")["score"] == 0.0
