"""Multiple choice (issue 12.4): one clearly chosen option is read, hedges score 0."""

from __future__ import annotations

import string

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sorl_verl.rewards import compute_score
from sorl_verl.rewards.mcq import extract_letter
from sorl_verl.rewards.qa import normalize_answer

WORDS = ["heparin", "warfarin", "aspirin", "vitamin K", "protamine sulfate", "iron", "no treatment", "12 mg"]


@st.composite
def option_sets(draw: st.DrawFn) -> dict[str, str]:
    n = draw(st.integers(2, 6))
    texts = draw(st.lists(st.sampled_from(WORDS), min_size=n, max_size=n, unique=True))
    return dict(zip(string.ascii_uppercase[:n], texts, strict=True))


def chosen_forms(letter: str, text: str) -> list[str]:
    return [
        letter,
        letter.lower(),
        f"({letter})",
        f"[{letter}]",
        f"{letter}.",
        f"**{letter}**",
        f"The answer is ({letter}).",
        f"the correct answer is {letter}",
        f"Answer: {letter}",
        f"Option {letter}",
        f"Final answer: **{letter}**",
        f"{letter}. {text}",
        f"{letter}) {text}",
        f"({letter}) {text}",
        f"**{letter}. {text}**",
        text,
        text.upper(),
        f"The answer is {text}.",
    ]


@given(options=option_sets(), data=st.data())
def test_every_clear_form_of_a_choice_is_read(options: dict[str, str], data: st.DataObject) -> None:
    letter = data.draw(st.sampled_from(sorted(options)))
    for form in chosen_forms(letter, options[letter]):
        assert extract_letter(form, options) == letter, form
        assert (
            compute_score("medqa", f"<answer>{form}</answer>", {"target": [letter], "options": options})["score"] == 1
        )


@given(
    options=option_sets(),
    data=st.data(),
    joiner=st.sampled_from([" ", ", ", " and ", " or ", "/", " & ", ",", "; "]),
    wrap=st.sampled_from(["{}", "**{}**", "The answer is {}.", "({})", "Answer: {}"]),
)
def test_hedges_choose_nothing(options: dict[str, str], data: st.DataObject, joiner: str, wrap: str) -> None:
    letters = data.draw(st.lists(st.sampled_from(sorted(options)), min_size=2, max_size=len(options), unique=True))
    hedge = wrap.format(joiner.join(letters))
    assert extract_letter(hedge, options) is None, hedge
    hedge_texts = wrap.format(joiner.join(options[k] for k in letters))
    assert extract_letter(hedge_texts, options) is None, hedge_texts
    for gold in letters:
        assert compute_score("medqa", f"<answer>{hedge}</answer>", {"target": [gold], "options": options})["score"] == 0


@given(options=option_sets(), data=st.data())
def test_a_letter_with_another_options_text_is_no_choice(options: dict[str, str], data: st.DataObject) -> None:
    letter, other = data.draw(st.lists(st.sampled_from(sorted(options)), min_size=2, max_size=2, unique=True))
    assume(normalize_answer(options[letter]) != normalize_answer(options[other]))
    assert extract_letter(f"{letter}. {options[other]}", options) is None


@given(options=option_sets(), answer=st.text(max_size=30))
def test_only_option_letters_are_ever_read(options: dict[str, str], answer: str) -> None:
    assert extract_letter(answer, options) in {None, *options}


@pytest.mark.parametrize(
    ("answer", "letter"),
    [
        ("The answer is (B).", "B"),
        ("**B**", "B"),
        ("A B C D", None),
        ("A and B", None),
        ("B because heparin works", None),  # prose after the letter is not read
        ("E", None),  # not an option
        ("A. fumigatus", "C"),  # an option's exact text that starts like a letter
    ],
)
def test_hand_checked_readings(answer: str, letter: str | None) -> None:
    options = {"A": "Ibuprofen", "B": "Heparin", "C": "A. fumigatus", "D": "Aspirin"}
    assert extract_letter(answer, options) == letter
