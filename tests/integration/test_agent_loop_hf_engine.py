"""The ``search_r1`` loop driven by the project's REAL CPU generation engine (a tiny random
Qwen2), checked the way the trainer will use its output: recomputing the log-probs of the whole
sequence with the same model must give back ``response_logprobs`` on every mask-1 position.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.workers.rollout.replica import TokenOutput

from sorl_verl.agent.search_r1_loop import SearchR1AgentLoop
from sorl_verl.algorithms.turns import segment_turns
from sorl_verl.cpu.hf_engine import HFGenerationEngine, SamplingOptions
from sorl_verl.embedded.tiny_model import write_random_model


class EngineServer:
    """verl's server-manager ``generate`` over an in-process :class:`HFGenerationEngine`."""

    def __init__(self, engine: HFGenerationEngine) -> None:
        self.engine = engine
        self.calls = 0

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kw: Any):
        self.calls += 1
        params = dict(sampling_params)
        budget = self.engine.max_new_tokens(len(prompt_ids), params.pop("max_tokens"))
        params.pop("logprobs", None)
        out = await self.engine.generate(prompt_ids, SamplingOptions.from_vllm_params(params, max_tokens=budget))
        return TokenOutput(token_ids=out.token_ids, log_probs=out.log_probs, stop_reason="completed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_random_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok


async def test_real_engine_logprobs_realign_with_recomputation(tiny: Any, fp32: Any) -> None:
    model, tok = tiny
    # a few frequent ids end a turn (as EOS would), so the episode has several turns + observations
    eos = {tok.eos_token_id, *tok.encode(" the", add_special_tokens=False), *tok.encode(" a", add_special_tokens=False)}
    engine = EngineServer(HFGenerationEngine(model, tok, eos_token_ids=eos, max_model_len=1024, seed=3))
    cfg = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"prompt_length": 256, "response_length": 200, "name": "hf"}}}
    )
    loop = SearchR1AgentLoop(
        trainer_config=DictConfigWrap(cfg),
        server_manager=engine,
        tokenizer=tok,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(OmegaConf.create({})),
        retrieval_url="http://127.0.0.1:9/retrieve",  # nothing listens: every search returns an error observation
        retrieval_preflight=False,
        max_turns=4,
        max_obs_tokens=40,
    )
    out = await loop.run(
        {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
        raw_prompt=[{"role": "user", "content": "who wrote the book?"}],
    )
    await engine.engine.close()

    n = len(out.response_ids)
    assert n == len(out.response_mask) == len(out.response_logprobs) <= 200
    turns = segment_turns(torch.tensor([out.response_mask]))
    assert int(turns.num_turns[0]) == out.extra_fields["agent_turns"] == engine.calls >= 2
    assert out.num_turns == 1 + engine.calls + (engine.calls - 1)

    ids = torch.tensor([out.prompt_ids + out.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(out.prompt_ids) - 1 : -1].float()
    recomputed = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(out.response_ids)[:, None])[:, 0]
    mask = torch.tensor(out.response_mask, dtype=torch.bool)
    got = torch.tensor(out.response_logprobs)
    # the loop's cached multi-turn decode vs one full forward: two float32 evaluations of the same log-probs
    atol = fp32.logprob(model.config, ids.shape[1], float(logits.abs().max()))
    torch.testing.assert_close(got[mask], recomputed[mask], atol=atol, rtol=0)
    assert torch.all(got[~mask] == 0)
    # every observation is a whole information block
    text = tok.decode(out.response_ids)
    assert text.count("<information>") == engine.calls - 1
