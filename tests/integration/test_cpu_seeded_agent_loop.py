"""The seeded agent loop: every sampled episode gets the seed of its (run seed, prompt, sample),
installed on a live Ray actor exactly as ``SeededAgentLoopManager`` installs it on verl's workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
from omegaconf import OmegaConf

from sorl_verl.cpu.seeded_agent_loop import install_episode_seeds, seeded_sampling_params
from sorl_verl.trainer.reproducible import episode_seed, prompt_identity, prompt_uid

SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
TRAJ = {"step": 3, "sample_index": 17, "rollout_n": 0, "validate": False}


def test_sampled_episodes_get_the_seed_of_their_identity():
    uid = prompt_uid(3, 5)
    params = seeded_sampling_params(SAMPLED, 42, TRAJ, {"uid": uid, "session_id": 1})
    assert params["seed"] == episode_seed(42, prompt_identity(uid), 1)
    assert "seed" not in SAMPLED  # the shared dict verl reuses for every session is not touched
    # the same prompt in another run of the same seed: another nonce, same identity, same seed
    again = seeded_sampling_params(SAMPLED, 42, {**TRAJ, "rollout_n": 1}, {"uid": prompt_uid(3, 5), "session_id": 1})
    assert again["seed"] == params["seed"]
    other = seeded_sampling_params(SAMPLED, 42, TRAJ, {"uid": uid, "session_id": 0})
    assert other["seed"] != params["seed"]


def test_greedy_and_explicitly_seeded_requests_are_left_alone():
    greedy = {**SAMPLED, "temperature": 0}
    assert seeded_sampling_params(greedy, 42, TRAJ, {"uid": prompt_uid(1, 0), "session_id": 0}) is greedy
    fixed = {**SAMPLED, "seed": 5}
    assert seeded_sampling_params(fixed, 42, TRAJ, {"uid": prompt_uid(1, 0), "session_id": 0})["seed"] == 5


@ray.remote
class StandInAgentLoopWorker:
    """Stand-in for verl's AgentLoopWorkerTQ (which needs TransferQueue and a rollout server): the same
    ``_run_agent_loop(sampling_params, trajectory, **prompt)`` entry point, called from another method."""

    def __init__(self) -> None:
        self.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"seed": 7}}})

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs: Any):
        return sampling_params.get("seed")

    async def run_prompt(self, uid: str, n: int) -> list[int | None]:
        return list(
            await asyncio.gather(
                *(self._run_agent_loop(dict(SAMPLED), trajectory=TRAJ, uid=uid, session_id=i) for i in range(n))
            )
        )


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


def test_install_on_a_live_actor_seeds_each_session_once(ray_local):
    worker = StandInAgentLoopWorker.remote()
    uid = prompt_uid(3, 0)
    assert ray.get(worker.run_prompt.remote(uid, 2)) == [None, None]
    assert ray.get(worker.__ray_call__.remote(install_episode_seeds)) is True
    assert ray.get(worker.__ray_call__.remote(install_episode_seeds)) is False  # idempotent
    seeds = ray.get(worker.run_prompt.remote(uid, 3))
    assert seeds == [episode_seed(7, prompt_identity(uid), i) for i in range(3)]
