"""One search-agent episode in token space: the turn logic of training, evaluation and warm-start.

The whole episode is one assistant message (Search-R1 style): ``prompt + response``, where the
response is the model's turns (mask 1) and the environment's observations (mask 0). Per turn:

1. generate from ``prompt + response`` with ``budget`` tokens: the response tokens left
   (``response_length - len(response)``), at most ``max_tokens_per_turn`` when that is set;
2. keep the generated tokens up to and including the token that completes the first stop tag
   (``</search>`` / ``</answer>``; all of them when there is none), log-probs cut alike;
3. act on the kept text (:func:`~sorl_verl.agent.actions.parse_action`): an answer ends the
   episode; on the last turn (``max_turns``) or with no response budget left the episode ends
   (a search asked for then is not run); a search appends ``information_block`` of its result,
   escaped, special-token strings neutralised and cut to ``max_obs_tokens`` tokens (closing tag
   kept); anything else appends the corrective feedback (inside an information block, or plain
   text between newlines).

The token stream is never re-tokenized: each turn's generated ids and each observation's own
encoding are appended, so the model sees exactly what training sees. ``generate`` and ``search``
are injected: :func:`run_episode` drives one episode with async callables (the verl agent loop,
``sorl-verl eval``), :func:`run_episodes` a batch with synchronous ones (warm-start rollouts).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sorl_verl.agent.actions import (
    INVALID_ACTION_FEEDBACK,
    escape_observation,
    first_stop,
    parse_action,
    turn_well_formed,
)
from sorl_verl.agent.prompts import INFO_CLOSE, INFO_OPEN, information_block

TRUNCATION_MARK = " ...(truncated)"
FEEDBACK_FORMATS = ("information", "plain")

#: (context ids, token budget) -> (generated ids, their log-probs or None)
GenerateTurn = Callable[[list[int], int], Awaitable[tuple[Sequence[int], Sequence[float] | None]]]
#: query -> observation text
Search = Callable[[str], Awaitable[str]]
#: (context ids per episode, token budget per episode) -> generated ids per episode
GenerateBatch = Callable[[list[list[int]], list[int]], list[list[int]]]
#: queries -> observation text per query
SearchBatch = Callable[[list[str]], list[str]]


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns``: most model turns; ``response_length``: most response tokens (None: no cap,
    then ``max_tokens_per_turn`` must bound each turn); ``max_tokens_per_turn``: most tokens of one
    turn (0: only the response budget); ``max_obs_tokens``: most tokens of one observation block;
    ``feedback_format``: where the corrective feedback after an invalid action goes."""

    max_turns: int
    response_length: int | None
    max_tokens_per_turn: int = 0
    max_obs_tokens: int = 512
    feedback_format: str = "information"

    def __post_init__(self) -> None:
        bad = {
            "max_turns": self.max_turns >= 1,
            "response_length": self.response_length is None or self.response_length >= 1,
            "max_tokens_per_turn": self.max_tokens_per_turn >= 0,
            "feedback_format": self.feedback_format in FEEDBACK_FORMATS,
        }
        if self.response_length is None and not self.max_tokens_per_turn:
            bad["max_tokens_per_turn (needed without response_length)"] = False
        names = [name for name, ok in bad.items() if not ok]
        if names:
            raise ValueError(f"search agent episode: invalid {', '.join(names)}: {self}")


class EpisodeFormat:
    """The tokenizer-bound half of the turn logic: cutting a turn at its stop tag, and the token
    ids of observations and of the corrective feedback."""

    def __init__(self, tokenizer: Any, limits: EpisodeLimits) -> None:
        self.tokenizer, self.limits = tokenizer, limits
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        specials |= {str(t) for t in added.values() if getattr(t, "special", False)}
        self.special_strings = sorted((t for t in specials if len(t) > 1), key=len, reverse=True)
        head, tail = information_block("\x00").split("\x00")
        assert head.endswith(INFO_OPEN) and tail.startswith(INFO_CLOSE)
        self.block_parts = (self.encode(head), self.encode(tail), self.encode(TRUNCATION_MARK))
        smallest = sum(len(part) for part in self.block_parts) + 1
        if limits.max_obs_tokens < smallest:
            raise ValueError(f"search agent: max_obs_tokens must be >= {smallest} for this tokenizer")
        if limits.feedback_format == "plain":
            self.feedback_ids = self.encode(f"\n{INVALID_ACTION_FEEDBACK}\n")[: limits.max_obs_tokens]
        else:
            self.feedback_ids = self.observation_ids(INVALID_ACTION_FEEDBACK, escape=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def cut_at_stop(self, token_ids: Sequence[int]) -> tuple[int, str]:
        """(number of tokens to keep, their text): everything up to and including the token that
        completes the first stop tag; all tokens when no stop tag was generated."""
        token_ids = list(token_ids)
        text = self.decode(token_ids)
        if first_stop(text) is None:
            return len(token_ids), text
        lo, hi = 1, len(token_ids)  # invariant: the prefix of length hi holds a stop tag
        while lo < hi:
            mid = (lo + hi) // 2
            if first_stop(self.decode(token_ids[:mid])) is None:
                lo = mid + 1
            else:
                hi = mid
        return hi, self.decode(token_ids[:hi])

    def neutralize_special_tokens(self, text: str) -> str:
        """Make special-token strings in observation text (``<|im_end|>``, ``<|im_start|>``, ...)
        plain text: their ``<`` becomes ``&lt;`` (or a space follows their first character), so a
        document cannot end the assistant turn or open a new role when tokenized."""
        for special in self.special_strings:
            if special in text:
                safe = special.replace("<", "&lt;", 1) if "<" in special else f"{special[0]} {special[1:]}"
                text = text.replace(special, safe)
        return text

    def observation_ids(self, text: str, escape: bool = True) -> list[int]:
        """Tokens of ``information_block(escape(text))``, at most ``max_obs_tokens`` of them;
        when cut, the inner text is shortened and the closing tag is always kept. Only our own
        corrective feedback is appended unescaped (it names the tags on purpose)."""
        safe = self.neutralize_special_tokens(escape_observation(text) if escape else text)
        ids = self.encode(information_block(safe))
        cap = self.limits.max_obs_tokens
        if len(ids) <= cap:
            return ids
        head_ids, tail_ids, mark_ids = self.block_parts
        room = cap - len(head_ids) - len(tail_ids) - len(mark_ids)
        return head_ids + self.encode(safe)[:room] + mark_ids + tail_ids


@dataclass
class Episode:
    """State of one episode; :meth:`budget`, :meth:`add_turn` and :meth:`add_observation` are the
    whole turn logic (module docstring). ``logprobs`` becomes None once a turn comes without them."""

    fmt: EpisodeFormat
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    turns: int = 0
    searches: int = 0
    valid: int = 0
    observations: int = 0
    finished: bool = False
    well_formed: bool = True
    final_answer: str = ""
    done: bool = False

    @property
    def limits(self) -> EpisodeLimits:
        return self.fmt.limits

    def context(self) -> list[int]:
        """What the next turn is generated from: prompt + response so far."""
        return self.prompt_ids + self.response_ids

    def budget(self) -> int:
        """Tokens the next turn may generate; 0 when the episode is over."""
        lim = self.limits
        if self.done or self.turns >= lim.max_turns:
            return 0
        if lim.response_length is None:
            return lim.max_tokens_per_turn
        left = lim.response_length - len(self.response_ids)
        if left <= 0:
            return 0
        return min(left, lim.max_tokens_per_turn) if lim.max_tokens_per_turn else left

    def _append(self, ids: Sequence[int], policy: bool, logprobs: Sequence[float] | None = None) -> None:
        self.response_ids += ids
        self.mask += [int(policy)] * len(ids)
        if self.logprobs is None:
            return
        if not policy:
            self.logprobs += [0.0] * len(ids)
        elif logprobs is None:
            self.logprobs = None
        else:
            self.logprobs += [float(x) for x in logprobs[: len(ids)]]

    def add_turn(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> str | None:
        """Append one generated turn (cut at its stop tag) and act on it: returns the query when
        the turn searches (the caller runs it and calls :meth:`add_observation`), else None."""
        keep, text = self.fmt.cut_at_stop(token_ids)
        self._append(list(token_ids[:keep]), True, logprobs)
        self.turns += 1
        action = parse_action(text)
        self.well_formed &= turn_well_formed(text)
        if action.kind == "answer":
            self.valid += 1
            self.finished, self.done, self.final_answer = True, True, action.content
            return None
        if self.turns >= self.limits.max_turns or (
            self.limits.response_length is not None and len(self.response_ids) >= self.limits.response_length
        ):
            self.valid += action.kind == "search"  # a well-formed search that cannot be served
            self.done = True
            return None
        if action.kind == "search":
            self.valid += 1
            return action.content
        self._append(self.fmt.feedback_ids, False)
        self.observations += 1
        return None

    def add_observation(self, text: str) -> None:
        """Append the result of the search the last turn asked for."""
        self._append(self.fmt.observation_ids(text), False)
        self.searches += 1
        self.observations += 1

    @property
    def truncated(self) -> bool:
        cap = self.limits.response_length
        return not self.finished and cap is not None and len(self.response_ids) >= cap

    def capped(self) -> tuple[list[int], list[int], list[float] | None]:
        """(response ids, mask, log-probs) cut to ``response_length``."""
        cap = self.limits.response_length
        lp = self.logprobs[:cap] if self.logprobs is not None else None
        return self.response_ids[:cap], self.mask[:cap], lp

    def counters(self) -> dict[str, Any]:
        """The episode's counters as the agent loop reports them (``extra_fields``)."""
        return {
            "searches": self.searches,
            "valid_action_ratio": self.valid / self.turns if self.turns else 0.0,
            "finished": float(self.finished),
            "agent_turns": self.turns,
            "truncated": float(self.truncated),
            # the loop's verdict, which the reward scores (sorl_verl.rewards.extract.loop_verdict)
            "final_answer": self.final_answer,
            "well_formed": float(self.finished and self.well_formed),
        }


async def run_episode(episode: Episode, generate: GenerateTurn, search: Search) -> Episode:
    """Drive one episode to its end with async ``generate`` and ``search``."""
    while budget := episode.budget():
        ids, logprobs = await generate(episode.context(), budget)
        query = episode.add_turn(list(ids), logprobs)
        if query is not None:
            episode.add_observation(await search(query))
    return episode


def run_episodes(episodes: Sequence[Episode], generate: GenerateBatch, search: SearchBatch) -> Sequence[Episode]:
    """Drive a batch of episodes turn by turn: one ``generate`` call for every episode still
    running, then one ``search`` call for every query of that turn. Without log-probs."""
    while active := [e for e in episodes if e.budget()]:
        outputs = generate([e.context() for e in active], [e.budget() for e in active])
        asked = [(e, e.add_turn(ids)) for e, ids in zip(active, outputs, strict=True)]
        asked = [(e, q) for e, q in asked if q is not None]
        for (e, _), text in zip(asked, search([q for _, q in asked]) if asked else [], strict=True):
            e.add_observation(text)
    return episodes
