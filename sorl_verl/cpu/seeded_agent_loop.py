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

import asyncio
from typing import Any

from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

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


def install_episode_seeds(worker: Any) -> bool:
    """Run inside a verl ``AgentLoopWorkerTQ`` actor (``__ray_call__``): seed its sampled episodes.

    Wraps the instance's ``_run_agent_loop`` (verl's per-episode entry point, called with the
    trajectory info and the prompt's fields) so the sampling params gain the episode's seed.
    The worker is verl's own actor: subclassing it is not possible, because ``ray.remote`` rebinds
    the class name and the zero-argument ``super()`` in its ``__init__`` then fails in a subclass.
    """
    if getattr(worker, "_sorl_episode_seeds", False):
        return False
    run_agent_loop = worker._run_agent_loop
    run_seed = int(worker.config.actor_rollout_ref.rollout.seed)

    async def seeded_run_agent_loop(sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs: Any):
        params = seeded_sampling_params(sampling_params, run_seed, trajectory, kwargs)
        return await run_agent_loop(params, trajectory, **kwargs)

    worker._run_agent_loop = seeded_run_agent_loop
    worker._sorl_episode_seeds = True
    return True


class SeededAgentLoopManager(AgentLoopManagerTQ):
    """verl's ``AgentLoopManagerTQ`` whose workers seed every sampled episode (module docstring)."""

    async def _init_agent_loop_workers(self) -> None:
        await super()._init_agent_loop_workers()
        await asyncio.gather(*(worker.__ray_call__.remote(install_episode_seeds) for worker in self.agent_loop_workers))
