"""The ``hf`` rollout server's request contract (the body of the Ray actor, called in-process)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode

from sorl_verl.cpu.hf_rollout import HFServer, server_actor_name
from sorl_verl.embedded.tiny_model import write_random_model

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny_qwen2"))


def rollout_config(**overrides) -> RolloutConfig:
    kwargs = dict(
        name="hf",
        tensor_model_parallel_size=1,
        prompt_length=16,
        response_length=8,
        dtype="float32",
        load_format="auto",
        ignore_eos=True,
    )
    kwargs.update(overrides)
    return RolloutConfig(**kwargs)


async def started(model_dir, **overrides) -> HFServer:
    server = HFServer(rollout_config(**overrides), HFModelConfig(path=str(model_dir)), RolloutMode.HYBRID)
    await server.launch_server()
    return server


@torch.no_grad()
def greedy_reference(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_default_budget_follows_prompt_and_response_lengths(model_dir):
    server = await started(model_dir)
    short = await server.generate(list(range(5, 10)), dict(GREEDY), request_id="a")
    assert len(short.token_ids) == 8 and len(short.log_probs) == 8  # response_length
    long = await server.generate(list(range(5, 25)), dict(GREEDY), request_id="b")
    assert len(long.token_ids) == 16 + 8 - 20  # what is left of prompt_length + response_length
    assert long.stop_reason == "completed" and long.extra_fields["finish_reason"] == "length"


async def test_max_tokens_is_clamped_by_max_model_len_and_logprobs_are_optional(model_dir):
    server = await started(model_dir, max_model_len=30)
    out = await server.generate(list(range(5, 33)), {**GREEDY, "max_tokens": 10, "logprobs": False}, request_id="c")
    assert len(out.token_ids) == 2 and out.log_probs is None
    with pytest.raises(ValueError, match="no room"):
        await server.generate(list(range(5, 35)), dict(GREEDY), request_id="d")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        HFServer(rollout_config(max_model_len=10_000), HFModelConfig(path=str(model_dir)), RolloutMode.HYBRID)


async def test_agent_loop_params_are_honoured_and_unsupported_ones_rejected(model_dir):
    server = await started(model_dir)
    out = await server.generate(
        [5, 6, 7], {**GREEDY, "max_tokens": 6, "stop": ["</search>"], "include_stop_str_in_output": True}, "e"
    )
    assert 1 <= len(out.token_ids) <= 6
    with pytest.raises(ValueError, match="n must be 1"):
        await server.generate([5, 6, 7], {**GREEDY, "n": 2}, request_id="f")
    with pytest.raises(NotImplementedError, match="text-only"):
        await server.generate([5, 6, 7], dict(GREEDY), request_id="g", image_data=[object()])


async def test_dummy_load_starts_random_and_the_first_sync_restores_the_model(model_dir):
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    prompt = [9, 10, 11, 12]
    expected = greedy_reference(model, prompt, 8)
    server = await started(model_dir, load_format="dummy")
    random_out = await server.generate(prompt, dict(GREEDY), request_id="h")
    assert random_out.token_ids != expected
    assert await server.update_weights(list(model.state_dict().items())) == len(model.state_dict())
    await server.set_global_steps(4)
    synced = await server.generate(prompt, dict(GREEDY), request_id="i")
    assert synced.token_ids == expected and synced.extra_fields["global_steps"] == 4
    stats = await server.get_stats()
    assert stats["global_steps"] == 4 and stats["num_threads"] == 1 and sum(stats["batch_sizes"]) == 2


async def test_abort_all_then_resume(model_dir):
    server = await started(model_dir)
    assert (await server.abort_all_requests())["aborted_count"] == 0
    await server.resume_generation()
    out = await server.generate([5, 6], {**GREEDY, "max_tokens": 3}, request_id="j")
    assert len(out.token_ids) == 3


def test_server_actor_names_follow_verl_conventions():
    assert server_actor_name(0) == "hf_server_0_0"
    assert server_actor_name(2, 0, "reward", "_x") == "hf_server_reward_2_0_x"


def test_verl_resolves_the_hf_rollout_to_these_classes():
    import verl  # noqa: F401 - loads the sorl_verl plugin
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from sorl_verl.cpu.hf_rollout import HFReplica, HFServerAdapter

    assert get_rollout_replica_class("hf") is HFReplica
    assert get_rollout_class("hf", "async") is HFServerAdapter
