"""Multiple-choice scoring: the one option the answer clearly chooses, compared with the gold letter.

Reading rule (``extract_letter``), applied to the content of the accepted ``<answer>``:

1. markdown emphasis (``*``, ``_``, backticks) is dropped, whitespace collapsed, and one lead-in
   phrase removed: ``the answer is``, ``answer:``, ``the correct option is``, ``final answer:``,
   ``option``, ``choice`` (any case); then trailing ``.`` / ``!`` and spaces;
2. what remains chooses letter ``X`` when it is exactly ``X``, ``(X)`` or ``[X]`` (any case), or
   ``X.`` / ``X)`` / ``X:`` / ``X -`` / ``(X)`` / ``[X]`` followed by the exact text of option X;
3. otherwise it chooses the option whose text it equals (after QA normalization, with or without
   the lead-in), when exactly one option has that text; an answer shaped like step 2 with the
   wrong text (``A. warfarin`` where warfarin is B) must equal an option's text literally
   (``A. fumigatus``), since QA normalization would drop its leading ``a``;
4. anything else chooses nothing and scores 0: hedges (``A B C D``, ``A and B``, ``A or B``,
   ``A/B``), a letter followed by another option's text, a letter that is not an option, prose.
"""

from __future__ import annotations

import re

from sorl_verl.rewards.qa import normalize_answer

_MARKDOWN = re.compile(r"[*_`]+")
_LEAD_IN = re.compile(
    r"^(?:(?:so|thus|therefore|hence)\s*,?\s+)?(?:the\s+)?(?:(?:final|correct|right|best)\s+)?"
    r"(?:answer|option|choice)(?:\s+is)?\s*[:\-]?\s*",
    re.IGNORECASE,
)
_BARE_LETTER = re.compile(r"^(?:\(([a-z])\)|\[([a-z])\]|([a-z]))$", re.IGNORECASE)
_LETTER_THEN_TEXT = re.compile(r"^(?:\(([a-z])\)|\[([a-z])\]|([a-z])\s*(?:[.):]|\s-))\s*(.+)$", re.IGNORECASE)


def _letter(match: re.Match[str]) -> str:
    return next(g for g in match.groups()[:3] if g).upper()


def _clean(answer: str) -> tuple[str, str]:
    """(the answer without markdown and extra spaces, the same without its lead-in phrase and end mark)."""
    plain = " ".join(_MARKDOWN.sub("", answer).split())
    return plain, _LEAD_IN.sub("", plain, count=1).rstrip(" .!")


def extract_letter(answer: str | None, options: dict[str, str] | None = None) -> str | None:
    """The option letter ``answer`` clearly chooses (module docstring), or None.

    Without ``options`` only the bare-letter forms are read; with them the letter must be one of
    the options' letters.
    """
    if answer is None:
        return None
    letters = {k.strip().upper(): v for k, v in (options or {}).items() if v is not None}
    plain, text = _clean(answer)
    bare = _BARE_LETTER.match(text)
    if bare and (not options or _letter(bare) in letters):
        return _letter(bare)
    if not options:
        return None
    with_text = _LETTER_THEN_TEXT.match(text)
    if with_text:
        letter, rest = _letter(with_text), normalize_answer(with_text.group(4))
        if rest and letter in letters and rest == normalize_answer(letters[letter]):
            return letter
        # "A. warfarin" names letter A and option B's text: no choice, unless the whole answer is
        # literally one option's text ("A. fumigatus"); QA normalization would drop the "a"
        exact = [k for k, v in letters.items() if " ".join(v.split()).rstrip(" .!").casefold() == text.casefold()]
        return exact[0] if len(exact) == 1 else None
    said = {normalize_answer(plain), normalize_answer(text)} - {""}
    hits = [k for k, v in letters.items() if normalize_answer(v) in said]
    return hits[0] if len(hits) == 1 else None


def letter_match(answer: str | None, gold_letters: list[str], options: dict[str, str] | None = None) -> float:
    """1.0 if the letter ``answer`` clearly chooses is one of ``gold_letters``."""
    letter = extract_letter(answer, options)
    return float(letter is not None and letter in {g.strip().upper() for g in gold_letters})
