"""verl agent loop ``search_r1``: think -> search -> information -> ... -> answer.

The whole episode is one assistant message (Search-R1 style). Before the first turn of a worker
process, one preflight search (:mod:`sorl_verl.agent.retrieval_guard`). Per model turn:

1. generate from ``prompt + response so far`` with ``max_tokens`` = remaining response budget,
   at most ``max_tokens_per_turn`` when that is set;
2. cut the generated tokens right after the first token that completes ``</search>`` or
   ``</answer>`` (tokens and their log-probs are cut together), append them with mask 1;
3. act: ``</answer>`` ends the episode; a search query goes to the retrieval server and its
   (escaped, length-capped) result is appended as ``information_block(...)`` tokens with
   mask 0 and log-prob 0 (and counted by the failure-rate guard); anything else gets a
   corrective observation (mask 0), inside an information block or as plain text
   (``feedback_format``).

So the policy's turns are exactly the maximal runs of response_mask == 1 (SORL-SPEC.md), and
response_ids / response_mask / response_logprobs always have the same length (capped at
``rollout.response_length``).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol
from uuid import uuid4

from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.utils.profiler import simple_timer

from sorl_verl.agent.actions import (
    INVALID_ACTION_FEEDBACK,
    escape_observation,
    first_stop,
    parse_action,
    turn_well_formed,
)
from sorl_verl.agent.prompts import (
    INFO_CLOSE,
    INFO_OPEN,
    STOP_SEQUENCES,
    InstructionTemplate,
    information_block,
    load_instruction_template,
)
from sorl_verl.agent.retrieval_guard import RetrievalGuard, search_failed, shared_guard
from sorl_verl.agent.settings import SearchAgentSettings

TRUNCATION_MARK = " ...(truncated)"
#: kwargs verl passes that this loop drops (the YAML entry's name, the tool list)
_VERL_KWARGS = frozenset({"name", "tools"})
#: kwargs AgentLoopBase takes
_BASE_KWARGS = frozenset(
    {"trainer_config", "server_manager", "tokenizer", "processor", "dataset_cls", "data_config", "hf_model_type"}
)


class Searcher(Protocol):
    async def search(self, query: str, topk: int | None = None) -> str: ...


_CLIENTS: weakref.WeakKeyDictionary[Any, dict[tuple, Searcher]] = weakref.WeakKeyDictionary()


def shared_client(settings: SearchAgentSettings, loop: Any) -> Searcher:
    """One RetrievalClient per (event loop, settings): verl builds an agent-loop object per
    trajectory, but the HTTP session and the concurrency cap must be shared by all of them."""
    from sorl_verl.retrieval.client import RetrievalClient

    key = (
        settings.retrieval_url,
        settings.topk,
        settings.search_timeout,
        settings.search_retries,
        settings.search_backoff,
        settings.max_concurrency,
    )
    per_loop = _CLIENTS.setdefault(loop, {})
    if key not in per_loop:
        per_loop[key] = RetrievalClient(
            settings.retrieval_url,
            topk=settings.topk,
            timeout=settings.search_timeout,
            max_retries=settings.search_retries,
            backoff=settings.search_backoff,
            max_concurrency=settings.max_concurrency,
        )
    return per_loop[key]


def _trainer_section(config: Any) -> dict[str, Any] | None:
    section = config.get("sorl", None) if isinstance(config, DictConfig | dict) else None
    section = section.get("agent", None) if section is not None else None
    if isinstance(section, DictConfig):
        return OmegaConf.to_container(section, resolve=True)
    return dict(section) if section else None


class SearchR1AgentLoop(AgentLoopBase):
    """Search-R1 agent loop; knobs in :class:`~sorl_verl.agent.settings.SearchAgentSettings`."""

    def __init__(self, *args: Any, searcher: Searcher | None = None, **kwargs: Any) -> None:
        knob_names = set(SearchAgentSettings.__dataclass_fields__)
        knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in knob_names}
        unknown = sorted(set(kwargs) - _VERL_KWARGS - _BASE_KWARGS)
        if unknown:
            raise ValueError(f"search_r1 agent loop: unknown setting(s) {unknown}; known: {sorted(knob_names)}")
        for name in _VERL_KWARGS:
            kwargs.pop(name, None)
        super().__init__(*args, **kwargs)
        self.settings = SearchAgentSettings.resolve(knobs, _trainer_section(self.config))
        self.response_length: int = self.rollout_config.response_length
        self.searcher = searcher
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        specials = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        specials |= {str(t) for t in added.values() if getattr(t, "special", False)}
        self._special_strings = sorted((t for t in specials if len(t) > 1), key=len, reverse=True)
        head, tail = information_block("\x00").split("\x00")
        assert head.endswith(INFO_OPEN) and tail.startswith(INFO_CLOSE)
        self._block_parts = (self._encode(head), self._encode(tail), self._encode(TRUNCATION_MARK))
        smallest = sum(len(part) for part in self._block_parts) + 1
        if self.settings.max_obs_tokens < smallest:
            raise ValueError(f"search_r1 agent: max_obs_tokens must be >= {smallest} for this tokenizer")
        self.server_stop = self.settings.server_stop == "on" or (
            self.settings.server_stop == "auto" and self.rollout_config.name in ("vllm", "sglang", "hf")
        )
        path = self.settings.instruction_template
        self.template: InstructionTemplate | None = load_instruction_template(path) if path else None
        if self.settings.feedback_format == "plain":
            self._feedback_ids = self._encode(f"\n{INVALID_ACTION_FEEDBACK}\n")[: self.settings.max_obs_tokens]
        else:
            self._feedback_ids = self.observation_ids(INVALID_ACTION_FEEDBACK, escape=False)

    # --- token helpers ------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def cut_at_stop(self, token_ids: list[int]) -> tuple[int, str]:
        """(number of tokens to keep, their text): everything up to and including the token that
        completes the first stop tag; all tokens when no stop tag was generated."""
        text = self._decode(token_ids)
        if first_stop(text) is None:
            return len(token_ids), text
        lo, hi = 1, len(token_ids)  # invariant: prefix of length hi contains a stop tag
        while lo < hi:
            mid = (lo + hi) // 2
            if first_stop(self._decode(token_ids[:mid])) is None:
                lo = mid + 1
            else:
                hi = mid
        return hi, self._decode(token_ids[:hi])

    def observation_ids(self, text: str, escape: bool = True) -> list[int]:
        """Tokens of ``information_block(escape(text))``, at most ``max_obs_tokens`` of them;
        when cut, the inner text is shortened and the closing tag is always kept. Only our own
        corrective feedback is appended unescaped (it names the tags on purpose)."""
        safe = self.neutralize_special_tokens(escape_observation(text) if escape else text)
        ids = self._encode(information_block(safe))
        cap = self.settings.max_obs_tokens
        if len(ids) <= cap:
            return ids
        head_ids, tail_ids, mark_ids = self._block_parts
        room = cap - len(head_ids) - len(tail_ids) - len(mark_ids)
        return head_ids + self._encode(safe)[:room] + mark_ids + tail_ids

    def neutralize_special_tokens(self, text: str) -> str:
        """Make special-token strings in observation text (``<|im_end|>``, ``<|im_start|>``, ...)
        plain text: their ``<`` becomes ``&lt;`` (or a space follows their first character), so a
        document cannot end the assistant turn or open a new role when tokenized."""
        for special in self._special_strings:
            if special in text:
                safe = special.replace("<", "&lt;", 1) if "<" in special else f"{special[0]} {special[1:]}"
                text = text.replace(special, safe)
        return text

    def _sampling_params(self, sampling_params: dict[str, Any], budget: int) -> dict[str, Any]:
        params = {**sampling_params, "max_tokens": budget}
        if self.server_stop:
            params["stop"] = list(STOP_SEQUENCES)
            if self.rollout_config.name == "sglang":
                params["no_stop_trim"] = True
            else:
                params["include_stop_str_in_output"] = True
        return params

    def _budget_left(self, response_ids: list[int]) -> bool:
        return len(response_ids) < self.response_length

    def _searcher(self) -> Searcher:
        if self.searcher is None:
            self.searcher = shared_client(self.settings, self.loop)
        return self.searcher

    def _guard(self) -> RetrievalGuard:
        s = self.settings
        return shared_guard(s.retrieval_url, s.search_failure_window, s.max_search_failure_rate, self.loop)

    async def _search(self, query: str) -> str:
        observation = await self._searcher().search(query, self.settings.topk)
        self._guard().record(search_failed(observation), observation)
        return observation

    def _messages(self, kwargs: dict[str, Any]) -> list[Any]:
        """The row's chat messages; with ``instruction_template`` the last user message is rebuilt
        from the template, the row's ``extra_info.question`` and its options (multiple choice)."""
        messages = list(kwargs["raw_prompt"])
        if self.template is None:
            return messages
        question = (kwargs.get("extra_info") or {}).get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"instruction_template {self.template.path}: the row has no extra_info.question "
                "(rows written by sorl_verl.data.convert and the synthetic world have it)"
            )
        ground_truth = (kwargs.get("reward_model") or {}).get("ground_truth")
        options = ground_truth.get("options") if isinstance(ground_truth, dict) else None
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise ValueError("instruction_template: the row's prompt has no user message to replace")
        messages[users[-1]] = {**messages[users[-1]], "content": self.template.render(question, options)}
        return messages

    # --- the loop -----------------------------------------------------------------------

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = self._messages(kwargs)
        if self.settings.retrieval_preflight:
            await self._guard().preflight(self._searcher())
        prompt_ids = await self.ct_build_initial_tokens(messages)
        request_id = uuid4().hex
        metrics: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] | None = []
        turns = searches = valid = observations = 0
        finished = False
        all_turns_well_formed = True
        final_answer = ""

        for turn in range(self.settings.max_turns):
            budget = self.response_length - len(response_ids)
            if budget <= 0:
                break
            if self.settings.max_tokens_per_turn:
                budget = min(budget, self.settings.max_tokens_per_turn)
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(
                    request_id=request_id,
                    prompt_ids=prompt_ids + response_ids,
                    sampling_params=self._sampling_params(sampling_params, budget),
                )
            preempted = out.num_preempted if out.num_preempted is not None else 0
            metrics["num_preempted"] = metrics.get("num_preempted", 0) + preempted
            if not extra:
                extra.update(out.extra_fields)
            elif out.extra_fields.get("max_global_steps") is not None:
                extra["max_global_steps"] = out.extra_fields["max_global_steps"]

            keep, text = self.cut_at_stop(list(out.token_ids))
            turn_ids = list(out.token_ids[:keep])
            response_ids += turn_ids
            mask += [1] * len(turn_ids)
            if logprobs is not None and out.log_probs is not None:
                logprobs += [float(x) for x in out.log_probs[:keep]]
            else:
                logprobs = None
            turns += 1

            action = parse_action(text)
            all_turns_well_formed &= turn_well_formed(text)
            if action.kind == "answer":
                valid += 1
                finished = True
                final_answer = action.content
                break
            if turn == self.settings.max_turns - 1 or not self._budget_left(response_ids):
                valid += action.kind == "search"  # a well-formed search that cannot be served
                break
            if action.kind == "search":
                valid += 1
                with simple_timer("tool_calls", metrics):
                    observation = await self._search(action.content)
                searches += 1
                obs_ids = self.observation_ids(observation)
            else:
                obs_ids = list(self._feedback_ids)
            response_ids += obs_ids
            mask += [0] * len(obs_ids)
            if logprobs is not None:
                logprobs += [0.0] * len(obs_ids)
            observations += 1

        cap = self.response_length
        truncated = not finished and len(response_ids) >= cap
        extra.update(
            {
                "searches": searches,
                "valid_action_ratio": valid / turns if turns else 0.0,
                "finished": float(finished),
                "agent_turns": turns,
                "truncated": float(truncated),
                # the loop's verdict, which the reward scores (sorl_verl.rewards.extract.loop_verdict)
                "final_answer": final_answer,
                "well_formed": float(finished and all_turns_well_formed),
                "turn_scores": [],
                "tool_rewards": [],
            }
        )
        metrics.setdefault("num_preempted", -1)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:cap],
            response_mask=mask[:cap],
            response_logprobs=logprobs[:cap] if logprobs is not None else None,
            num_turns=1 + turns + observations,
            metrics=metrics,
            extra_fields=extra,
        )
