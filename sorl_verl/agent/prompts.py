"""Prompt and tag conventions of the search agent (think -> search -> information -> answer).

One home for the tag strings so that the agent loop, the reward, the SFT warm-start
trajectories and the dataset converters agree byte for byte. The shipped instructions are the
project's own wording; :class:`InstructionTemplate` lets a user supply another one (for example
the instruction of a paper being reproduced) from a text file.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

#: generation stops after any of these (the agent then acts on the completed tag)
STOP_SEQUENCES: tuple[str, ...] = (SEARCH_CLOSE, ANSWER_CLOSE)

QA_INSTRUCTION = (
    "Answer the question below. Think step by step inside <think> and </think> each time new "
    "information arrives. When you need knowledge you do not have, write a query as "
    "<search> query </search>; the top results come back between <information> and "
    "</information>. Search as often as you need. When you know the answer, give only the "
    "answer inside <answer> and </answer>, for example <answer> Paris </answer>."
)

MCQ_INSTRUCTION = (
    "Answer the multiple-choice question below. Think step by step inside <think> and </think> "
    "each time new information arrives. When you need knowledge you do not have, write a query "
    "as <search> query </search>; the top results come back between <information> and "
    "</information>. When you are sure, give only the letter of the correct option inside "
    "<answer> and </answer>, for example <answer> B </answer>."
)


def qa_prompt(question: str) -> str:
    """User message for an open-domain (possibly multi-hop) question."""
    return f"{QA_INSTRUCTION}\nQuestion: {question.strip()}\n"


def option_lines(options: dict[str, str]) -> str:
    """``A. text`` lines, one per option, in letter order (options whose text is None are left out)."""
    return "\n".join(f"{letter}. {text}" for letter, text in sorted(options.items()) if text is not None)


def mcq_prompt(question: str, options: dict[str, str]) -> str:
    """User message for a multiple-choice question; ``options`` maps letter -> text."""
    return f"{MCQ_INSTRUCTION}\nQuestion: {question.strip()}\nOptions:\n{option_lines(options)}\n"


TEMPLATE_FIELDS = frozenset({"question", "options"})


@dataclass(frozen=True)
class InstructionTemplate:
    """A user message template read from a text file: ``{question}`` is required, ``{options}``
    (the ``A. text`` lines) is needed for multiple-choice rows; literal braces are written ``{{``
    and ``}}`` (Python ``str.format`` syntax)."""

    path: str
    text: str
    fields: frozenset[str]

    def render(self, question: str, options: dict[str, str] | None = None) -> str:
        """The user message for one row; a multiple-choice row needs an ``{options}`` placeholder."""
        if options and "options" not in self.fields:
            raise ValueError(
                f"instruction template {self.path} has no {{options}} placeholder, but the row is multiple choice"
            )
        return self.text.format(question=question.strip(), options=option_lines(options or {}))


@lru_cache(maxsize=8)
def load_instruction_template(path: str) -> InstructionTemplate:
    """Read and check a template file; ValueError naming the file on a missing ``{question}``, an
    unknown placeholder or malformed braces."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"instruction template {path}: cannot read it ({e})") from None
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:
        raise ValueError(f"instruction template {path}: {e} (write literal braces as {{{{ and }}}})") from None
    unknown = sorted(names - TEMPLATE_FIELDS)
    if unknown or "question" not in names:
        raise ValueError(
            f"instruction template {path}: placeholders must be {{question}} (required) and {{options}}; "
            f"found {sorted(names)}"
        )
    return InstructionTemplate(str(file), text, frozenset(names))


def information_block(text: str) -> str:
    """Observation appended after a search (its tokens get response_mask 0)."""
    return f"\n\n{INFO_OPEN}{text}{INFO_CLOSE}\n\n"
