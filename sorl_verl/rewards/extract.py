"""The agent's final answer and format verdict: from the loop's record, or read back from text.

The ``search_r1`` loop records, per episode, the answer it accepted and its verdict in
``extra_fields`` (``final_answer``, ``finished``, ``well_formed``); verl hands them to the reward
function inside ``extra_info``. :func:`loop_verdict` reads that record; the reward scores exactly
it, so it can never pay for an answer the loop rejected.

Text-only reading (:func:`extract_answer`, :func:`is_valid_format`) is for callers without the
record. It replays the loop's own parser (:func:`sorl_verl.agent.actions.parse_action`) and never
lets a tag pair span an observation block:

- the text is cut into pieces at every ``<information>`` / ``</information>`` tag and at every
  copy of the loop's corrective feedback sentence; the answer is the action of the LAST piece,
  when that action is an answer followed by nothing but whitespace; an answer action in any earlier
  piece means the loop would have stopped there, and the text is not an episode the loop produced:
  no answer. Cutting at a string the model wrote itself only ever shortens the final turn from the
  left, which leaves the loop's answer (the last ``<answer>`` before the first stop tag) unchanged.
- well formed: observation blocks alternate ``<information>`` ... ``</information>``, every model
  segment between them is a well-formed search turn and the last one a well-formed answer turn
  (:func:`sorl_verl.agent.actions.turn_well_formed`). A segment ending in its only stop tag is a
  complete loop turn (the loop cuts at the first stop tag), so this never accepts an episode whose
  turns the loop judged malformed.

One limit of text-only reading: verl decodes the response with ``skip_special_tokens=True``; a
special token the model generated inside a tag is invisible in that text but not to the loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sorl_verl.agent.actions import INVALID_ACTION_FEEDBACK, first_stop, parse_action, turn_well_formed
from sorl_verl.agent.prompts import INFO_CLOSE, INFO_OPEN

#: extra_fields keys of the loop's record
RECORD_ANSWER, RECORD_FINISHED, RECORD_WELL_FORMED = "final_answer", "finished", "well_formed"

_INFO_TAG = re.compile(re.escape(INFO_OPEN) + "|" + re.escape(INFO_CLOSE))
_PIECE_BOUNDARY = re.compile("|".join(re.escape(s) for s in (INFO_OPEN, INFO_CLOSE, INVALID_ACTION_FEEDBACK)))


@dataclass(frozen=True)
class Verdict:
    """The episode's accepted answer (None when the loop accepted none) and whether it was well formed."""

    answer: str | None
    well_formed: bool


def loop_verdict(extra_info: Mapping[str, Any] | None) -> Verdict | None:
    """The loop's record from ``extra_info``; None when the row carries none (another agent loop,
    or verl computed the reward outside the agent-loop workers)."""
    if not extra_info or not isinstance(extra_info.get(RECORD_ANSWER), str):
        return None
    finished = bool(extra_info.get(RECORD_FINISHED))
    answer = str(extra_info[RECORD_ANSWER]) if finished else None
    return Verdict(answer, finished and bool(extra_info.get(RECORD_WELL_FORMED)))


def extract_answer(text: str) -> str | None:
    """The answer the loop would have accepted from ``text`` (module docstring), stripped; else None."""
    pieces = _PIECE_BOUNDARY.split(text)
    if any(parse_action(piece).kind == "answer" for piece in pieces[:-1]):
        return None
    last = pieces[-1]
    action = parse_action(last)
    if action.kind != "answer":
        return None
    stop = first_stop(last)
    assert stop is not None
    return action.content if not last[stop[0] :].strip() else None


def model_segments(text: str) -> list[str] | None:
    """Text outside observation blocks, in order; None when the blocks do not alternate
    ``<information>`` ... ``</information>`` (a stray, nested or unclosed tag)."""
    segments: list[str] = []
    pos, inside = 0, False
    for tag in _INFO_TAG.finditer(text):
        opening = tag.group(0) == INFO_OPEN
        if opening == inside:
            return None
        if opening:
            segments.append(text[pos : tag.start()])
        pos, inside = tag.end(), opening
    if inside:
        return None
    segments.append(text[pos:])
    return segments


def is_valid_format(text: str) -> bool:
    """Searches then one answer, every model turn well formed, blocks intact (module docstring)."""
    segments = model_segments(text)
    if segments is None:
        return False
    *searches, final = segments
    return all(turn_well_formed(s) and parse_action(s).kind == "search" for s in searches) and (
        turn_well_formed(final) and parse_action(final).kind == "answer"
    )


def text_verdict(text: str) -> Verdict:
    """:class:`Verdict` read from text alone (no loop record)."""
    return Verdict(extract_answer(text), is_valid_format(text))
