"""The ``hf`` rollout replica in a real Ray cluster, driven by verl's own client and router.

A Ray actor stands in for a hybrid trainer rank: it owns a copy of the model, builds the
``HFServerAdapter`` the way verl's worker does (``RANK`` set, server found by name), and pushes
weights after a (simulated) update. Requests go through verl's ``LLMServerClient`` and global load
balancer exactly as the agent loop's ``server_manager.generate`` sends them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import pytest
import ray
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import get_router_handle

from sorl_verl.cpu.hf_rollout import HFReplica, HFServerAdapter, server_actor_name
from sorl_verl.embedded.tiny_model import write_random_model

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33], [40, 41], [50, 51, 52], [60], [70, 71]]
MAX_TOKENS = 10


class TrainerRank:
    """Plays one hybrid trainer worker: holds the trained model and the in-worker rollout adapter."""

    def __init__(self, model_dir: str, rollout_config: RolloutConfig, model_config: HFModelConfig) -> None:
        from transformers import Qwen2ForCausalLM

        os.environ["RANK"] = "0"
        torch.set_num_threads(1)
        self.model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
        self.adapter = HFServerAdapter(config=rollout_config, model_config=model_config, device_mesh=None)

    async def train_step_and_sync(self, seed: int, global_steps: int) -> int:
        """Perturb the weights (a stand-in optimizer step) and push them through the adapter."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        await self.adapter.update_weights(iter(self.model.state_dict().items()), global_steps=global_steps)
        return len(self.model.state_dict())

    @torch.no_grad()
    def greedy_reference(self, prompt: list[int], n: int) -> tuple[list[int], list[float], float]:
        """Greedy decoding by full forward passes (no cache, no batching); also the largest |logit| seen."""
        ids, lps, scale = list(prompt), [], 0.0
        for _ in range(n):
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits, -1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp.max()))
            scale = max(scale, float(logits.abs().max()))
        return ids[len(prompt) :], lps, scale


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test module is not importable in workers
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    model_dir = write_random_model(tmp_path_factory.mktemp("tiny_qwen2"))
    rollout = RolloutConfig(
        name="hf",
        tensor_model_parallel_size=1,
        prompt_length=32,
        response_length=16,
        dtype="float32",
        load_format="auto",
        engine_kwargs={"hf": {"num_threads": 1, "batch_wait_s": 0.05}},
    )
    return str(model_dir), rollout, HFModelConfig(path=str(model_dir))


@pytest.mark.slow  # ~35 s on 2 cores: Ray start + two actors importing verl and transformers
def test_replica_serves_verl_client_and_takes_weight_updates(ray_cluster, configs, fp32):
    model_dir, rollout_config, model_config = configs
    tiny_config = AutoConfig.from_pretrained(model_dir)
    trainer = ray.remote(num_cpus=0)(TrainerRank).remote(model_dir, rollout_config, model_config)
    replica = HFReplica(replica_rank=0, config=rollout_config, model_config=model_config, gpus_per_node=1)
    asyncio.run(replica.init_hybrid(SimpleNamespace(workers=[trainer])))
    assert ray.get_actor(server_actor_name(0))._actor_id == replica.server_handle._actor_id  # adapter finds it by name
    router = get_router_handle(servers={replica.server_address: replica.server_handle})
    client = LLMServerClient(
        config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "hf", "full_determinism": False}}}),
        load_balancer_handle=router,
    )
    # the agent-loop worker's sampling params, greedy as in validation
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def generate_all() -> list[TokenOutput]:
        return await asyncio.gather(
            *[
                client.generate(
                    f"req-{i}", prompt_ids=p, sampling_params={**params, "max_tokens": MAX_TOKENS, "ignore_eos": True}
                )
                for i, p in enumerate(PROMPTS)
            ]
        )

    before = asyncio.run(generate_all())
    for prompt, out in zip(PROMPTS, before, strict=True):
        tokens, lps, scale = ray.get(trainer.greedy_reference.remote(prompt, MAX_TOKENS))
        assert out.token_ids == tokens and out.stop_reason == "completed"
        # batched KV-cached decode vs full forward: two float32 evaluations of the same log-probs
        atol = fp32.logprob(tiny_config, len(prompt) + MAX_TOKENS, scale)
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(lps), atol=atol, rtol=0)
        assert out.extra_fields["global_steps"] is None
    stats = ray.get(replica.server_handle.get_stats.remote())
    assert sum(stats["batch_sizes"]) == len(PROMPTS) and max(stats["batch_sizes"]) >= 2

    # a "trained" model reaches the server through the adapter; outputs follow it
    assert ray.get(trainer.train_step_and_sync.remote(seed=5, global_steps=3)) > 0
    after = asyncio.run(generate_all())
    assert [a.token_ids for a in after] != [b.token_ids for b in before]
    for prompt, out in zip(PROMPTS, after, strict=True):
        tokens, lps, scale = ray.get(trainer.greedy_reference.remote(prompt, MAX_TOKENS))
        assert out.token_ids == tokens and out.extra_fields["global_steps"] == 3
        atol = fp32.logprob(tiny_config, len(prompt) + MAX_TOKENS, scale)  # as above, the trained weights' logits
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(lps), atol=atol, rtol=0)

    # sampled requests without logprobs, default budget from prompt/response lengths
    out = asyncio.run(
        client.generate("s", prompt_ids=PROMPTS[0], sampling_params={"temperature": 1.0, "logprobs": False})
    )
    assert out.log_probs is None and 1 <= len(out.token_ids) <= rollout_config.response_length

    # verl's control calls on the replica
    asyncio.run(replica.wake_up())
    asyncio.run(replica.sleep())
    asyncio.run(replica.abort_all_requests())
    asyncio.run(replica.resume_generation())
    assert asyncio.run(client.generate("r", prompt_ids=PROMPTS[1], sampling_params={**params, "max_tokens": 2}))
