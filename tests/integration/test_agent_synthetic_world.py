"""World -> BM25 index -> real retrieval server -> ``search_r1`` loop -> reward, end to end.

An oracle policy (scripted, the stand-in for vLLM) searches each hop entity of a synthetic
k-hop question and answers with the gold; every episode runs concurrently through one shared
retrieval client. The retrieved observations must contain the next hop and the answer, and the
reward of every response must be 1.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.workers.rollout.replica import TokenOutput

from sorl_verl.agent.search_r1_loop import SearchR1AgentLoop
from sorl_verl.algorithms.turns import segment_turns
from sorl_verl.embedded.qa_world import generate_world, questions_to_parquet
from sorl_verl.embedded.tokenizer import smoke_tokenizer
from sorl_verl.embedded.world import write_world
from sorl_verl.retrieval.build import build_index
from sorl_verl.retrieval.server import serve_in_background
from sorl_verl.rewards import compute_score


class OracleServer:
    """Per request id, returns the next scripted turn of that episode."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]]) -> None:
        self.tokenizer, self.scripts = tokenizer, scripts

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kw: Any):
        text = self.tokenizer.decode(prompt_ids)
        question, script = next((q, s) for q, s in self.scripts.items() if q in text)
        turn = script[text.split(question, 1)[1].count("<information>")]  # observations so far
        ids = self.tokenizer.encode(turn, add_special_tokens=False)[: sampling_params["max_tokens"]]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


@pytest.fixture(scope="module")
def world_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("world")
    world = generate_world(seed=11, num_entities=80, num_val_per_hop=4, num_test_per_hop=4)
    paths = write_world(world, root)
    handle = serve_in_background(build_index(paths["corpus"], root / "index", show_progress=False))
    yield world, root, handle
    handle.stop()


async def test_oracle_episodes_on_synthetic_world(world_server: Any) -> None:
    world, root, server = world_server
    rows = pd.read_parquet(questions_to_parquet(world.questions["test"], root / "test.parquet", "test"))
    assert set(rows["data_source"]) == {"synthetic_1hop", "synthetic_2hop", "synthetic_3hop"}
    tok = smoke_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}\nassistant:"
    scripts = {}
    for _, row in rows.iterrows():
        hops = list(row["extra_info"]["hop_queries"])
        answer = row["reward_model"]["ground_truth"]["target"][0]
        scripts[row["extra_info"]["question"]] = [
            f"<think>hop {i}</think><search> {q} </search>" for i, q in enumerate(hops)
        ] + [f"<think>so</think><answer> {answer} </answer>"]
    cfg = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"prompt_length": 2048, "response_length": 3000, "name": "vllm"}}}
    )
    llm = OracleServer(tok, scripts)

    async def episode(row: Any):
        loop = SearchR1AgentLoop(
            trainer_config=DictConfigWrap(cfg),
            server_manager=llm,
            tokenizer=tok,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(OmegaConf.create({})),
            retrieval_url=server.retrieve_url,
            max_turns=4,
            max_obs_tokens=2000,
        )
        return await loop.run({"logprobs": True}, raw_prompt=list(row["prompt"]))

    outs = await asyncio.gather(*(episode(row) for _, row in rows.iterrows()))
    for (_, row), out in zip(rows.iterrows(), outs, strict=True):
        hops = list(row["extra_info"]["hop_queries"])
        answer = row["reward_model"]["ground_truth"]["target"][0]
        text = tok.decode(out.response_ids)
        observations = [block.split("</information>")[0] for block in text.split("<information>")[1:]]
        assert len(observations) == len(hops) == out.extra_fields["searches"]
        for i, obs in enumerate(observations):  # hop i's top-3 documents lead to hop i+1 / the answer
            assert (hops[i + 1] if i + 1 < len(hops) else answer) in obs
        turns = segment_turns(torch.tensor([out.response_mask]))
        assert int(turns.num_turns[0]) == len(hops) + 1
        score = compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], out.extra_fields)
        assert score["score"] == 1.0 and score["format_ok"] == 1.0 and score["searches"] == len(hops)
