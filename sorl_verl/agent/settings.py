"""Knobs of the ``search_r1`` agent loop and where they come from.

Precedence per knob: the kwargs of the agent-loop YAML entry (``agent_loop_config_path``) >
``sorl.agent.<knob>`` in the trainer config (``+sorl.agent.topk=5`` on the command line) >
for the URL only, the ``SORL_RETRIEVAL_URL`` environment variable > the chosen ``preset`` > the
default below. ``preset=search_r1`` sets the knobs Search-R1's NQ/HotpotQA scripts use
(:data:`PRESETS`); any knob set explicitly still wins over it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sorl_verl.retrieval.client import RetrievalClient

DEFAULT_RETRIEVAL_URL = "http://127.0.0.1:8000/retrieve"
URL_ENV = "SORL_RETRIEVAL_URL"

#: named sets of knob values; ``search_r1``: Search-R1's NQ + HotpotQA training scripts (4 search
#: rounds plus a final answer turn = 5 model turns, 500 generated tokens per turn, top-3 passages,
#: observations cut at 500 tokens, the corrective feedback as plain text between newlines)
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "search_r1": {
        "max_turns": 5,
        "max_tokens_per_turn": 500,
        "topk": 3,
        "max_obs_tokens": 500,
        "feedback_format": "plain",
    },
}
_TRUE, _FALSE = frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off"})


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ValueError(f"search_r1 agent: {name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class SearchAgentSettings:
    """``max_turns``: most model turns (generate calls) per episode; a search asked for on the last
    turn is not run. ``max_tokens_per_turn``: cap on the tokens of one model turn (0: only the
    episode's response budget). ``max_obs_tokens``: cap on the tokens of one ``<information>``
    block. ``feedback_format``: the corrective observation after an invalid action inside an
    ``<information>`` block (``information``) or as plain text between newlines (``plain``,
    Search-R1's). ``instruction_template``: a text file whose ``{question}`` (and, for multiple
    choice, ``{options}``) placeholders build the user message at run time instead of the row's
    prompt ("" keeps the row's prompt). ``server_stop``: pass the stop tags to the inference server
    (``auto``: vllm, sglang, hf; generation is always also cut at the first stop tag on our side).
    ``retrieval_preflight``: one real search when a worker process runs its first episode; a failure
    stops the run naming the URL. ``search_failure_window`` / ``max_search_failure_rate``: the run
    stops when more than that fraction of the last ``window`` searches of a worker process failed.
    ``mask_observations``: the environment's tokens (observations, feedback) get ``response_mask`` 0,
    so the loss sees only the policy's turns (Search-R1's ``state_masking``, on by default); false
    puts them in the loss too (``response_mask`` 1 throughout, so SORL sees one turn per episode) and
    reports no rollout log-probs, since no engine computed any for those tokens: verl then recomputes
    the old log-probs, and ``rollout.calculate_log_probs`` and rollout correction (``bypass_mode``,
    ``rollout_is``, ``rollout_rs``) are refused (:func:`check_observation_masking`)."""

    retrieval_url: str = DEFAULT_RETRIEVAL_URL
    preset: str = "default"
    topk: int = 3
    max_turns: int = 4
    max_tokens_per_turn: int = 0
    max_obs_tokens: int = 512
    feedback_format: str = "information"
    instruction_template: str = ""
    search_timeout: float = 10.0
    search_retries: int = 3
    search_backoff: float = 0.5
    max_concurrency: int = 64
    server_stop: str = "auto"
    retrieval_preflight: bool = True
    search_failure_window: int = 50
    max_search_failure_rate: float = 0.5
    mask_observations: bool = True

    def __post_init__(self) -> None:
        checks = {
            "preset": self.preset in PRESETS,
            "topk": self.topk >= 1,
            "max_turns": self.max_turns >= 1,
            "max_tokens_per_turn": self.max_tokens_per_turn >= 0,
            "max_obs_tokens": self.max_obs_tokens >= 16,
            "feedback_format": self.feedback_format in ("information", "plain"),
            "search_timeout": self.search_timeout > 0,
            "search_retries": self.search_retries >= 0,
            "search_backoff": self.search_backoff >= 0,
            "max_concurrency": self.max_concurrency >= 1,
            "server_stop": self.server_stop in ("auto", "on", "off"),
            "retrieval_url": self.retrieval_url.startswith(("http://", "https://")),
            "search_failure_window": self.search_failure_window >= 1,
            "max_search_failure_rate": 0.0 <= self.max_search_failure_rate <= 1.0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"search_r1 agent: invalid value for {', '.join(bad)}: {self}")

    def retrieval_client(self, topk: int | None = None) -> RetrievalClient:
        """A client of ``retrieval_url`` with these search knobs (``topk`` overrides the setting)."""
        return RetrievalClient(
            self.retrieval_url,
            topk=self.topk if topk is None else topk,
            timeout=self.search_timeout,
            max_retries=self.search_retries,
            backoff=self.search_backoff,
            max_concurrency=self.max_concurrency,
        )

    @classmethod
    def resolve(cls, loop_kwargs: Mapping[str, Any], trainer_section: Mapping[str, Any] | None) -> SearchAgentSettings:
        """Merge the sources (see module docstring); unknown knob names fail with their name."""
        known = {f.name for f in fields(cls)}
        section = dict(trainer_section or {})
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"sorl.agent: unknown setting(s) {unknown}; known: {sorted(known)}")
        explicit: dict[str, Any] = {}
        env_url = os.environ.get(URL_ENV)
        if env_url:
            explicit["retrieval_url"] = env_url
        explicit.update({k: v for k, v in section.items() if v is not None})
        explicit.update({k: v for k, v in loop_kwargs.items() if k in known and v is not None})
        preset = str(explicit.get("preset", cls.preset))
        if preset not in PRESETS:
            raise ValueError(f"search_r1 agent: unknown preset {preset!r}; known: {sorted(PRESETS)}")
        values = {**PRESETS[preset], **explicit}
        for name, value in list(values.items()):
            default = getattr(cls, name)
            values[name] = _as_bool(name, value) if isinstance(default, bool) else type(default)(value)
        return cls(**values)


#: ``algorithm.rollout_correction`` keys that need the rollout engine's log-probs of every trained token
ROLLOUT_LOGPROB_KEYS = ("bypass_mode", "rollout_is", "rollout_rs")


def check_observation_masking(mask_observations: bool, config: Any) -> None:
    """Refuse ``mask_observations=false`` where the trainer would need rollout log-probs: the
    observation tokens then in the loss were not generated, so no engine has their log-probs.
    verl asks for them with ``rollout.calculate_log_probs`` (its rollout-vs-actor diagnostics) and
    with rollout correction (``algorithm.rollout_correction``)."""
    if mask_observations or config is None:
        return
    from omegaconf import OmegaConf

    used = {}
    if OmegaConf.select(config, "actor_rollout_ref.rollout.calculate_log_probs", default=None):
        used["actor_rollout_ref.rollout.calculate_log_probs"] = True
    for key in ROLLOUT_LOGPROB_KEYS:
        value = OmegaConf.select(config, f"algorithm.rollout_correction.{key}", default=None)
        if value:
            used[f"algorithm.rollout_correction.{key}"] = value
    if used:
        settings = ", ".join(f"{key}={value}" for key, value in used.items())
        raise ValueError(
            "sorl.agent.mask_observations=false trains on observation tokens that no rollout engine "
            f"generated, so they have no rollout log-probs, but {settings} needs them. Set "
            f"{' and '.join(f'{key}={False if value is True else None}' for key, value in used.items())} "
            "or keep mask_observations=true."
        )


def trainer_section(config: Any) -> dict[str, Any] | None:
    """The trainer config's ``sorl.agent`` section as a plain dict (None when absent)."""
    from omegaconf import DictConfig, OmegaConf

    section = config.get("sorl", None) if isinstance(config, DictConfig | dict) else None
    section = section.get("agent", None) if section is not None else None
    if isinstance(section, DictConfig):
        return OmegaConf.to_container(section, resolve=True)
    return dict(section) if section else None


def search_agent_settings(config: Any) -> SearchAgentSettings | None:
    """The ``search_r1`` settings a run with trainer ``config`` would use: the agent-loop YAML entry
    (``rollout.agent.agent_loop_config_path``), ``sorl.agent`` and the environment, as the loop
    resolves them; None when the run does not use the ``search_r1`` loop by default."""
    from omegaconf import OmegaConf

    from sorl_verl.agent import AGENT_LOOP_NAME

    agent = OmegaConf.select(config, "actor_rollout_ref.rollout.agent") or {}
    if agent.get("default_agent_loop") != AGENT_LOOP_NAME:
        return None
    loop_kwargs: dict[str, Any] = {}
    path = agent.get("agent_loop_config_path")
    if path:
        for entry in OmegaConf.load(path):
            if entry.get("name") == AGENT_LOOP_NAME:
                loop_kwargs = {k: v for k, v in OmegaConf.to_container(entry).items() if k not in ("name", "_target_")}
    return SearchAgentSettings.resolve(loop_kwargs, trainer_section(config))
