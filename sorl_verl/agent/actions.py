"""Parsing one model turn into an action, and making observation text safe to append.

A turn is the text the model generated since the last observation. Its action is decided by
the FIRST stop tag in it: ``</search>`` -> search with the text after the last ``<search>``
before it; ``</answer>`` -> final answer; no stop tag (EOS or length) -> invalid. A stop tag
without its opening tag, or an empty query, is malformed (invalid) too.

A turn is *well formed* (``turn_well_formed``) when, in addition, its tags (exact spelling) never
nest or overlap, each opened tag is closed by its own closing tag, it holds no ``<information>``
tag (only the environment writes those), exactly one action block (``<search>`` or ``<answer>``)
closes it and only whitespace follows that block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from sorl_verl.agent.prompts import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    INFO_CLOSE,
    INFO_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    STOP_SEQUENCES,
)

ActionKind = Literal["search", "answer", "invalid"]

INVALID_ACTION_FEEDBACK = (
    "My previous action is invalid. If I want to search, I should put the query between "
    f"{SEARCH_OPEN} and {SEARCH_CLOSE}. If I want to give the final answer, I should put the "
    f"answer between {ANSWER_OPEN} and {ANSWER_CLOSE}. Let me try again."
)
TURN_LIMIT_FEEDBACK = "The search budget is used up. I should now give the final answer."

# Any spelling of an agent tag a document could carry: <answer>, </ Information >, <SEARCH ...>
_AGENT_TAG = re.compile(r"<\s*/?\s*(?:think|search|answer|information)\b[^<>]*>", re.IGNORECASE)


# the exact tags the agent format uses, for the well-formedness check
_EXACT_TAG = re.compile(r"<(/?)(think|search|answer|information)>")
_ACTION_TAGS = frozenset({"search", "answer"})

# chat-template special tokens of the <|name|> family (<|im_end|>, <|eot_id|>, <|endoftext|>, ...)
_CHAT_SPECIAL = re.compile(r"<\|[^\s<>|]{1,64}\|>")


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    content: str = ""
    reason: str = ""


def first_stop(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> tuple[int, str] | None:
    """(end offset, tag) of the earliest stop tag in ``text``; None when there is none."""
    hits = [(pos + len(tag), tag) for tag in stops if (pos := text.find(tag)) >= 0]
    return min(hits) if hits else None


def parse_action(turn_text: str) -> Action:
    """Action of one model turn (see the module docstring)."""
    stop = first_stop(turn_text)
    if stop is None:
        return Action("invalid", reason="no </search> or </answer>")
    end, tag = stop
    body_end = end - len(tag)
    opening = SEARCH_OPEN if tag == SEARCH_CLOSE else ANSWER_OPEN
    start = turn_text.rfind(opening, 0, body_end)
    if start < 0:
        return Action("invalid", reason=f"{tag} without {opening}")
    content = turn_text[start + len(opening) : body_end].strip()
    if tag == SEARCH_CLOSE:
        if not content:
            return Action("invalid", reason="empty query")
        return Action("search", content)
    return Action("answer", content)


def turn_well_formed(turn_text: str) -> bool:
    """True when the turn is a valid action in the agent's tag structure (module docstring)."""
    if parse_action(turn_text).kind == "invalid":
        return False
    tags = list(_EXACT_TAG.finditer(turn_text))
    open_tag: str | None = None
    actions = 0
    for tag in tags:
        closing, name = tag.group(1), tag.group(2)
        if name == "information" or (not closing and open_tag is not None) or (closing and open_tag != name):
            return False
        open_tag = None if closing else name
        actions += bool(closing) and name in _ACTION_TAGS
    last = tags[-1]  # parse_action found a stop tag, so there is one
    return open_tag is None and actions == 1 and last.group(2) in _ACTION_TAGS and not turn_text[last.end() :].strip()


def escape_observation(text: str) -> str:
    """Neutralize agent tags inside retrieved text: ``<answer>`` -> ``&lt;answer&gt;``.

    After escaping, the text cannot close the information block, open an answer or a search,
    in any letter case or spacing of the tag, and ``<|...|>`` chat special tokens become plain
    text (``&lt;|im_end|>``), so a document cannot end the turn or open a new role.
    """
    escaped = _AGENT_TAG.sub(lambda m: m.group(0).replace("<", "&lt;").replace(">", "&gt;"), text)
    escaped = _CHAT_SPECIAL.sub(lambda m: "&lt;" + m.group(0)[1:], escaped)
    # belt and braces: the exact delimiters must never survive
    for tag in (INFO_OPEN, INFO_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, SEARCH_OPEN, SEARCH_CLOSE):
        escaped = escaped.replace(tag, tag.replace("<", "&lt;").replace(">", "&gt;"))
    return escaped
