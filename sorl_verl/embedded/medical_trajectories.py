"""Warm-start expert trajectories for the medical world, in the search agent's tag format.

After the chat-templated multiple-choice prompt (:func:`sorl_verl.agent.prompts.mcq_prompt`, the
prompt the parquet rows carry), a question over the chain ``R0 .. R(k-1)`` gets (``inline`` style)::

    <think> I need to search E0. </think>\\n<search> E0 </search>       + information_block(top-k of E0)
    <think> R0 fact of E0 and E1. </think>\\n<search> E1 </search>       + information_block(top-k of E1)
    <think> R(k-1) fact of E(k-1) and the answer A. A. text no. B. text no. L. A yes. </think>\\n<answer> L </answer><|im_end|>

where ``Ei`` are the question's ``hop_queries``, ``L`` is the gold option letter (the options are
checked in letter order up to the gold one, :func:`option_checks`) and the observations come from
the real retriever. The final turn names the answer in one of six styles (:data:`CHECK_STYLES`):

- ``inline``: ``...answer A. A. text no. L. A yes.``;
- ``lines``: each check on its own line, ``...answer A.\\nA. text no.\\nL. A yes.``, so its
  ``L. text`` tokens are the prompt's option line token for token;
- ``block``: the prompt's option block copied verbatim up to the gold option, then ``yes``:
  ``...answer A.\\nOptions:\\nA. text\\nL. A yes.`` (:func:`option_block`), one contiguous run of the
  prompt's tokens;
- ``tag``: no checks, the fact names the answer and its letter, ``...answer A (L).`` (:func:`tagged_fact`):
  the letter follows the name it belongs to, as the marker precedes it in the prompt's option line, so
  it is one reverse lookup (find the name just written among the option lines, read their marker);
- ``gold_line``: the fact, then the prompt's option line of the answer, ``...answer A.\\nL. A``
  (:func:`gold_line`): the same reverse lookup, whose output is the line's marker itself (one token
  of the prompt with ``letter_tokens``), then a copy of the name just written;
- ``text``: no checks and no letter, ``...answer A. </think>\\n<answer> A </answer>``: the answer is the
  option's text, which the MCQ reward reads as that option (:mod:`sorl_verl.rewards.mcq`, rule 3),
  though the instruction asks for the letter. No option lookup at all. The default
  (:data:`DEFAULT_CHECKS`): the only style whose warm-start is above chance.

Every letter style leaves the warm-start at chance (docs/embedded-default.md, "Medical: measured"): the
tiny model does not learn to find the answer's name among the option lines and read its letter, in
either direction, with or without the markers as whole tokens (:data:`OPTION_MARKERS`,
``MedicalEmbeddedConfig.letter_tokens``). Policy segments have loss mask 1, prompt and
observations 0 (:func:`sorl_verl.embedded.warmstart.tokenize_trajectory`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from sorl_verl.agent.prompts import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, mcq_prompt, option_lines
from sorl_verl.embedded.medical_world import RELATIONS, MedicalWorld
from sorl_verl.embedded.warmstart import (
    Observer,
    build_sft_examples,
    early_stop_search_segments,
    expert_search_segments,
    stops_early,
    tokenize_trajectory,
)


def user_message(question: dict[str, Any]) -> str:
    """The user message of a question record: exactly the prompt of its parquet row."""
    return mcq_prompt(question["question"], question["options"])


def _fact(rel: str, subject: str, value: str) -> str:
    text = RELATIONS[rel].fact.format(x=subject, y=value)
    return text[0].upper() + text[1:]


#: the starts of the prompt's option lines (``mcq_prompt``: ``"...\\nA. text\\nB. text"``); with
#: ``MedicalEmbeddedConfig.letter_tokens`` each is one token, so the first token of an option text
#: follows a token that is unique in the prompt (a one-token lookup) instead of ``L`` ``.``
OPTION_MARKERS = tuple(f"\n{letter}." for letter in "ABCDE")

#: how the final turn names the answer (module docstring)
CHECK_STYLES = ("inline", "lines", "block", "tag", "gold_line", "text")
#: the default: the option's text as the answer, the only style whose warm-start is above chance
#: (docs/embedded-default.md, "Medical: measured")
DEFAULT_CHECKS = "text"


def check_style(checks: str, name: str = "checks") -> str:
    """``checks`` itself if it is one of :data:`CHECK_STYLES`, else ``ValueError`` naming ``name``."""
    if checks not in CHECK_STYLES:
        raise ValueError(f"{name} must be one of {CHECK_STYLES}, got {checks!r}")
    return checks


def expert_segments(question: dict[str, Any], observe: Observer, checks: str = DEFAULT_CHECKS) -> list[tuple[str, bool]]:
    """The scripted response as ``(text, is_policy)`` segments (EOS not included); ``checks`` in :data:`CHECK_STYLES`."""
    check_style(checks)
    hops, chain, letter = question["hop_queries"], question["chain"], question["answer_idx"]
    fact = _fact(chain[-1], hops[-1], question["answer"])
    answer = letter
    if checks == "block":
        final = f"{fact}\n{option_block(question['options'], letter)}"
    elif checks == "tag":
        final = tagged_fact(fact, question["answer"], letter)
    elif checks == "gold_line":
        final = f"{fact}\n{gold_line(question['options'], letter)}"
    elif checks == "text":
        final, answer = fact, question["answer"]
    else:
        final = ("\n" if checks == "lines" else " ").join([fact, *option_checks(question["options"], letter)])
    return expert_search_segments(question, _fact, observe, final, answer)


def early_stop_segments(question: dict[str, Any], observe: Observer) -> list[tuple[str, bool]]:
    """One search, then the fact it found and the bridge entity's name as answer (a two-hop question only).

    The bridge (the diagnosis of a finding, the first-line drug of a condition) is of another kind than
    the options, so the MCQ reward scores this answer 0: the demonstration of an agent that stops a
    search too early, which RL can learn to correct (the QA early-stop warm-start's medical analogue).
    """
    return early_stop_search_segments(question, _fact, observe)


def options_through(options: dict[str, str], letter: str) -> dict[str, str]:
    """The options in letter order up to and including the gold ``letter`` (``ValueError`` if it is not one)."""
    if letter not in options:
        raise ValueError(f"gold letter {letter!r} is not among the options {sorted(options)}")
    return {key: options[key] for key in sorted(options) if key <= letter}


def option_checks(options: dict[str, str], letter: str) -> list[str]:
    """``"A. text no."`` for each option before the gold one, then ``"L. text yes."`` (options in letter order).

    The answer letter is then the last letter written, and each line is a copy of a prompt line:
    a lookup a small model learns, unlike mapping the answer's text to its letter in one step.
    """
    return [f"{key}. {text} {'yes' if key == letter else 'no'}." for key, text in options_through(options, letter).items()]


def tagged_fact(fact: str, answer: str, letter: str) -> str:
    """``fact`` (which ends with ``"<answer>."``) with the answer's option letter after its name: ``"... answer (L)."``.

    The one decision is the letter, written right after the name it belongs to: the token before
    ``L`` is the name's last token, and in the prompt the name's line starts with marker ``L``.
    """
    if not fact.endswith(f" {answer}."):
        raise ValueError(f"the fact {fact!r} does not end with the answer {answer!r}")
    return f"{fact[:-1]} ({letter})."


def gold_line(options: dict[str, str], letter: str) -> str:
    """``"L. text"``: the prompt's option line of the gold ``letter`` (``ValueError`` if it is not an option).

    Written after the fact that ends with the answer's name, its marker ``\\nL.`` is the token that
    precedes that name in the prompt: the decision is copying it, and the letter is then the last
    letter written.
    """
    return option_lines({letter: options_through(options, letter)[letter]})


def option_block(options: dict[str, str], letter: str) -> str:
    """``"Options:\\nA. text\\n...\\nL. text yes."``: the prompt's option block (``mcq_prompt``) up to the gold line.

    Everything before ``" yes."`` is a contiguous piece of the prompt; where to stop is the one
    decision (the line whose text is the answer just read), and the answer letter is then the last
    letter written.
    """
    return "Options:\n" + option_lines(options_through(options, letter)) + " yes."


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
    checks: str = DEFAULT_CHECKS,
    early_stop_rate: float = 0.0,
    seed: int = 0,
) -> list[tuple[list[int], list[int]]]:
    """Demonstrations of ``questions``, tokenized as ``(input_ids, loss_mask)``: the expert's (``checks``),
    or with probability ``early_stop_rate`` per two-hop question the early-stopping one."""

    def segments(q: dict[str, Any]) -> list[tuple[str, bool]]:
        return early_stop_segments(q, observe) if stops_early(q, early_stop_rate, seed) else expert_segments(q, observe, checks)

    return build_sft_examples(tokenizer, questions, segments, user_message, progress)


def drill_prompt(question: dict[str, Any]) -> str:
    """The user message of an option drill: ``"Find <answer> among the options.\\nOptions:\\n<lines>\\n"``.

    Its first words differ from the multiple-choice instruction (:func:`user_message`), so a drill
    never answers an agent prompt; its option block is the prompt's, token for token.
    """
    return f"Find {question['answer']} among the options.\nOptions:\n{option_lines(question['options'])}\n"


def drill_style(checks: str) -> str:
    """The drill form that exercises the lookup of the agent's ``checks`` style: ``gold_line`` for
    ``gold_line``, else ``block`` (the only other form drills have)."""
    return "gold_line" if check_style(checks) == "gold_line" else "block"


def drill_segments(question: dict[str, Any], checks: str = "block") -> list[tuple[str, bool]]:
    """The drill's response: the agent's last turn with the answer in place of the fact (one policy segment).

    ``<think> The answer is X.\\nOptions:\\nA. text\\n...\\nL. X yes. </think>\\n<answer> L </answer>``
    (EOS not included): the copy of the option block up to the gold line (:func:`option_block`) that
    ``checks="block"`` trajectories end with, after the same ``.`` and newline, as a dense exercise of
    that copy and of where it stops; with ``checks="gold_line"`` the answer's own line instead,
    ``The answer is X.\\nL. X`` (:func:`gold_line`), the same reverse lookup as the agent's last thought.
    """
    if checks not in ("block", "gold_line"):
        raise ValueError(f"option drills exist for checks 'block' and 'gold_line', got {checks!r}")
    letter = question["answer_idx"]
    lookup = option_block if checks == "block" else gold_line
    thought = f"The answer is {question['answer']}.\n{lookup(question['options'], letter)}"
    return [(f"{THINK_OPEN} {thought} {THINK_CLOSE}\n{ANSWER_OPEN} {letter} {ANSWER_CLOSE}", True)]


def option_drills(
    tokenizer, world: MedicalWorld, questions: Sequence[dict[str, Any]], n: int, seed: int = 0, checks: str = "block"
) -> list[tuple[list[int], list[int]]]:
    """``n`` option drills as ``(input_ids, loss_mask)``: questions drawn from ``questions`` with fresh options.

    Each drill is :func:`drill_prompt` then :func:`drill_segments` (``checks``) of a question re-drawn with
    :meth:`MedicalWorld.with_options` (``n`` draws with replacement, ``seed`` fixes them). No
    retrieval: the drill is the option lookup alone.
    """
    if n < 0:
        raise ValueError(f"the number of option drills must be >= 0, got {n}")
    if n and not questions:
        raise ValueError("option drills need at least one question to draw options for")
    rng = random.Random(seed)
    drills = [world.with_options(rng.choice(questions), rng, suffix=f"~drill{i}") for i in range(n)]
    return [tokenize_trajectory(tokenizer, q["question"], drill_segments(q, checks), prompt=drill_prompt(q)) for q in drills]
