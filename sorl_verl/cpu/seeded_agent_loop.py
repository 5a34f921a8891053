"""verl's TransferQueue agent-loop manager whose episodes sample with seeds derived from the run seed.

Selected by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class=
sorl_verl.cpu.seeded_agent_loop.SeededAgentLoopManager`` (``platform/cpu.yaml`` sets it). Each
agent-loop worker adds ``seed = episode_seed(rollout.seed, prompt identity, session id)``
(:mod:`sorl_verl.trainer.reproducible`) to the sampling params of every sampled episode, so an
episode's random stream depends on the run seed and on which prompt and sample it is, never on
which worker runs it, in what order episodes start, or which requests share a decode batch.
The ``hf`` server turns it into one seed per turn (:func:`~sorl_verl.trainer.reproducible.turn_seed`).
Greedy episodes (validation) and params that already carry a seed are left as they are.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from sorl_verl.trainer.reproducible import episode_seed, prompt_identity

#: temperatures below this are greedy (vLLM's threshold); they need no seed
GREEDY_TEMPERATURE_EPS = 1e-5


def seeded_sampling_params(
    sampling_params: dict[str, Any], run_seed: int, trajectory: dict[str, Any], prompt: dict[str, Any]
) -> dict[str, Any]:
    """``sampling_params`` plus the episode's seed (unchanged when greedy or already seeded)."""
    if (
        sampling_params.get("seed") is not None
        or float(sampling_params.get("temperature", 1.0)) < GREEDY_TEMPERATURE_EPS
    ):
        return sampling_params
    identity = prompt_identity(prompt.get("uid", ""), trajectory.get("sample_index"), trajectory.get("step"))
    return {**sampling_params, "seed": episode_seed(run_seed, identity, int(prompt.get("session_id", 0)))}


class SeededAgentLoopWorker(AgentLoopWorkerTQ.__ray_actor_class__):  # type: ignore[name-defined,misc]
    """verl's ``AgentLoopWorkerTQ`` that seeds each sampled episode (module docstring)."""

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs: Any):
        run_seed = int(self.config.actor_rollout_ref.rollout.seed)
        params = seeded_sampling_params(sampling_params, run_seed, trajectory, kwargs)
        return await super()._run_agent_loop(params, trajectory, **kwargs)


class SeededAgentLoopManager(AgentLoopManagerTQ):
    """verl's ``AgentLoopManagerTQ`` with :class:`SeededAgentLoopWorker` workers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(SeededAgentLoopWorker)
