"""verl agent loop ``search_r1``: think -> search -> information -> ... -> answer.

The turn logic (stop tags, observations, feedback, limits) is :mod:`sorl_verl.agent.episode`;
this module binds it to verl: the server manager's ``generate`` (with the stop tags passed to
engines that support them, ``server_stop``), the retrieval client (one per event loop and
settings) with the failure-rate guard, a preflight search before the first episode of a worker
process (:mod:`sorl_verl.agent.retrieval_guard`), the row's messages (``instruction_template``)
and verl's ``AgentLoopOutput``.

So the policy's turns are exactly the maximal runs of response_mask == 1 (SORL-SPEC.md; with
``mask_observations=false`` the mask is 1 throughout and the rollout log-probs are dropped), and
response_ids / response_mask / response_logprobs always have the same length (capped at
``rollout.response_length``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.utils.profiler import simple_timer

from sorl_verl.agent.episode import TRUNCATION_MARK, Episode, EpisodeFormat, EpisodeLimits, run_episode
from sorl_verl.agent.prompts import STOP_SEQUENCES, InstructionTemplate, load_instruction_template
from sorl_verl.agent.retrieval_guard import RetrievalGuard, shared_guard
from sorl_verl.agent.settings import SearchAgentSettings, check_observation_masking, trainer_section

__all__ = ["TRUNCATION_MARK", "SearchR1AgentLoop", "shared_client"]
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
        per_loop[key] = settings.retrieval_client()
    return per_loop[key]


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
        self.settings = SearchAgentSettings.resolve(knobs, trainer_section(self.config))
        check_observation_masking(self.settings.mask_observations, self.config)
        self.response_length: int = self.rollout_config.response_length
        self.searcher = searcher
        self.limits = EpisodeLimits(
            max_turns=self.settings.max_turns,
            response_length=self.response_length,
            max_tokens_per_turn=self.settings.max_tokens_per_turn,
            max_obs_tokens=self.settings.max_obs_tokens,
            feedback_format=self.settings.feedback_format,
        )
        self.format = EpisodeFormat(self.tokenizer, self.limits)
        self.server_stop = self.settings.server_stop == "on" or (
            self.settings.server_stop == "auto" and self.rollout_config.name in ("vllm", "sglang", "hf")
        )
        path = self.settings.instruction_template
        self.template: InstructionTemplate | None = load_instruction_template(path) if path else None

    def _sampling_params(self, sampling_params: dict[str, Any], budget: int) -> dict[str, Any]:
        params = {**sampling_params, "max_tokens": budget}
        if self.server_stop:
            params["stop"] = list(STOP_SEQUENCES)
            if self.rollout_config.name == "sglang":
                params["no_stop_trim"] = True
            else:
                params["include_stop_str_in_output"] = True
        return params

    def _searcher(self) -> Searcher:
        if self.searcher is None:
            self.searcher = shared_client(self.settings, self.loop)
        return self.searcher

    def _guard(self) -> RetrievalGuard:
        s = self.settings
        return shared_guard(s.retrieval_url, s.search_failure_window, s.max_search_failure_rate, self.loop)

    async def _search(self, query: str) -> str:
        """The observation text of ``query``; a client's failed search (``Observation.failed``) is
        counted by the failure-rate guard (a searcher with only ``search`` is taken at its word)."""
        searcher = self._searcher()
        if callable(getattr(searcher, "observe", None)):
            result = await searcher.observe(query, self.settings.topk)
            self._guard().record(result.failed, result.text)
            return result.text
        text = await searcher.search(query, self.settings.topk)
        self._guard().record(False, text)
        return text

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

        async def generate(context: list[int], budget: int) -> tuple[Sequence[int], Sequence[float] | None]:
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(
                    request_id=request_id,
                    prompt_ids=context,
                    sampling_params=self._sampling_params(sampling_params, budget),
                )
            preempted = out.num_preempted if out.num_preempted is not None else 0
            metrics["num_preempted"] = metrics.get("num_preempted", 0) + preempted
            if not extra:
                extra.update(out.extra_fields)
            elif out.extra_fields.get("max_global_steps") is not None:
                extra["max_global_steps"] = out.extra_fields["max_global_steps"]
            return out.token_ids, out.log_probs

        async def search(query: str) -> str:
            with simple_timer("tool_calls", metrics):
                return await self._search(query)

        episode = await run_episode(Episode(self.format, prompt_ids), generate, search)
        response_ids, response_mask, response_logprobs = episode.capped()
        if not self.settings.mask_observations:
            response_mask, response_logprobs = [1] * len(response_ids), None
        extra.update({**episode.counters(), "turn_scores": [], "tool_rewards": []})
        metrics.setdefault("num_preempted", -1)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=response_mask,
            response_logprobs=response_logprobs,
            num_turns=1 + episode.turns + episode.observations,
            metrics=metrics,
            extra_fields=extra,
        )
