"""Agent settings of issue 11: per-turn generation cap, Search-R1 preset, plain feedback, a user
instruction template, and fail-fast retrieval (preflight + failure-rate guard).

Real parts: verl's agent-loop base, the BM25 retrieval server on loopback and its client. Fakes,
named as such: ``ScriptedLLM`` (the inference server) and ``CountingSearcher`` (to count probes).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.workers.rollout.replica import TokenOutput

from sorl_verl.agent.actions import INVALID_ACTION_FEEDBACK
from sorl_verl.agent.prompts import QA_INSTRUCTION, load_instruction_template, qa_prompt
from sorl_verl.agent.retrieval_guard import RetrievalGuard, RetrievalUnavailableError
from sorl_verl.agent.search_r1_loop import SearchR1AgentLoop
from sorl_verl.agent.settings import PRESETS, SearchAgentSettings
from sorl_verl.retrieval.build import build_index
from sorl_verl.retrieval.client import failure_text
from sorl_verl.retrieval.server import serve_in_background

CORPUS = [
    {"id": "d1", "contents": '"Zorbia"\nThe capital of Zorbia is Quellport.'},
    {"id": "d2", "contents": '"Quellport"\nQuellport is a harbour city.'},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([QA_INSTRUCTION, INVALID_ACTION_FEEDBACK, *(d["contents"] for d in CORPUS)] * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retrieval")
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    return build_index(root / "corpus.jsonl", root / "index", show_progress=False)


class ScriptedLLM:
    """Fake inference server: scripted turns cut at max_tokens; records each call's sampling params."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kw: Any):
        self.calls.append({"prompt_ids": list(prompt_ids), **sampling_params})
        text = self.turns.pop(0) if self.turns else "<answer>x</answer>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling_params["max_tokens"]]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


class CountingSearcher:
    """Fake retrieval with a ``retrieve`` that counts calls (the preflight path of real clients)."""

    def __init__(self) -> None:
        self.probes = 0

    async def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict[str, Any]]]:
        self.probes += 1
        await asyncio.sleep(0.05)  # concurrent episodes arrive while the probe is in flight
        return [[] for _ in queries]

    async def search(self, query: str, topk: int | None = None) -> str:
        return "Doc 1(Title: Zorbia) The capital of Zorbia is Quellport."


def make_loop(tokenizer: Any, llm: Any, response_length: int = 512, **knobs: Any) -> SearchR1AgentLoop:
    cfg = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"prompt_length": 512, "response_length": response_length, "name": "vllm"}}}
    )
    return SearchR1AgentLoop(
        trainer_config=DictConfigWrap(cfg),
        server_manager=llm,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(OmegaConf.create({})),
        **knobs,
    )


def row(question: str = "What is the capital of Zorbia?", options: dict[str, str] | None = None) -> dict[str, Any]:
    ground_truth: dict[str, Any] = {"target": ["Quellport"], **({"options": options} if options else {})}
    return {
        "raw_prompt": [{"role": "user", "content": qa_prompt(question)}],
        "extra_info": {"question": question},
        "reward_model": {"ground_truth": ground_truth},
    }


async def episode(loop: SearchR1AgentLoop, **row_kwargs: Any) -> Any:
    return await loop.run({"temperature": 1.0, "logprobs": True}, **row(**row_kwargs))


# --- settings ----------------------------------------------------------------------------------


def test_search_r1_preset_sets_its_knobs_and_explicit_knobs_win() -> None:
    s = SearchAgentSettings.resolve({}, {"preset": "search_r1"})
    assert (s.max_turns, s.max_tokens_per_turn, s.topk, s.max_obs_tokens, s.feedback_format) == (
        5,
        500,
        3,
        500,
        "plain",
    )
    assert {k: getattr(s, k) for k in PRESETS["search_r1"]} == PRESETS["search_r1"]
    assert SearchAgentSettings.resolve({"max_turns": 3}, {"preset": "search_r1"}).max_turns == 3
    assert SearchAgentSettings.resolve({}, None).max_tokens_per_turn == 0  # default: no per-turn cap
    with pytest.raises(ValueError, match="unknown preset 'search-r1'"):
        SearchAgentSettings.resolve({}, {"preset": "search-r1"})
    assert SearchAgentSettings.resolve({"retrieval_preflight": "false"}, None).retrieval_preflight is False
    with pytest.raises(ValueError, match="retrieval_preflight must be true or false"):
        SearchAgentSettings.resolve({"retrieval_preflight": "maybe"}, None)
    for bad in ({"max_tokens_per_turn": -1}, {"max_search_failure_rate": 1.5}, {"feedback_format": "xml"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SearchAgentSettings.resolve(bad, None)


async def test_per_turn_cap_bounds_every_generate_call(tokenizer: Any) -> None:
    long_turn = "<think>" + "capital harbour city " * 20 + "</think><search>Zorbia</search>"
    llm = ScriptedLLM(tokenizer, [long_turn, "<answer>Quellport</answer>"])
    loop = make_loop(tokenizer, llm, max_tokens_per_turn=12, searcher=CountingSearcher())
    out = await episode(loop)
    assert [c["max_tokens"] for c in llm.calls] == [12, 12]
    first_turn = [m for m in out.response_mask[:12]]
    assert first_turn == [1] * 12 and out.response_mask[12] == 0  # cut at 12 tokens, then feedback
    assert out.extra_fields["valid_action_ratio"] == 0.5 and out.extra_fields["finished"] == 1.0
    # the episode budget still applies when it is the smaller one
    llm = ScriptedLLM(tokenizer, [long_turn])
    await episode(make_loop(tokenizer, llm, response_length=8, max_tokens_per_turn=12, searcher=CountingSearcher()))
    assert llm.calls[0]["max_tokens"] == 8


async def test_plain_feedback_is_masked_text_between_newlines(tokenizer: Any) -> None:
    llm = ScriptedLLM(tokenizer, ["no tags at all", "<answer>Quellport</answer>"])
    out = await episode(make_loop(tokenizer, llm, feedback_format="plain", searcher=CountingSearcher()))
    observed = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 0])
    assert observed == f"\n{INVALID_ACTION_FEEDBACK}\n" and "<information>" not in tokenizer.decode(out.response_ids)


# --- instruction template ----------------------------------------------------------------------


async def test_instruction_template_rebuilds_the_user_message(tokenizer: Any, tmp_path: Path) -> None:
    template = tmp_path / "instruction.txt"
    template.write_text("Use <search> when needed. {{literal braces}}\nQuestion: {question}\n")
    llm = ScriptedLLM(tokenizer, ["<answer>Quellport</answer>"])
    out = await episode(make_loop(tokenizer, llm, instruction_template=str(template), searcher=CountingSearcher()))
    message = "Use <search> when needed. {literal braces}\nQuestion: What is the capital of Zorbia?\n"
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(out.prompt_ids) == expected and out.prompt_ids == llm.calls[0]["prompt_ids"]

    mcq = tmp_path / "mcq.txt"
    mcq.write_text("{question}\n{options}\nAnswer with a letter.")
    llm = ScriptedLLM(tokenizer, ["<answer>B</answer>"])
    out = await episode(
        make_loop(tokenizer, llm, instruction_template=str(mcq), searcher=CountingSearcher()),
        question="Which drug?",
        options={"A": "aspirin", "B": "heparin", "C": None},
    )
    assert "Which drug?\nA. aspirin\nB. heparin\nAnswer with a letter." in tokenizer.decode(out.prompt_ids)
    with pytest.raises(ValueError, match=r"no \{options\} placeholder"):
        await episode(
            make_loop(tokenizer, ScriptedLLM(tokenizer, []), instruction_template=str(template)),
            options={"A": "x", "B": "y"},
        )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("No placeholder at all", "found \\[\\]"),
        ("{question} {answer}", "found \\['answer', 'question'\\]"),
        ("{question", "brace"),
    ],
)
def test_bad_instruction_templates_name_the_file(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / f"bad{abs(hash(text))}.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=error) as info:
        load_instruction_template(str(path))
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_instruction_template(str(tmp_path / "missing.txt"))


# --- fail fast on retrieval --------------------------------------------------------------------


async def test_preflight_stops_the_first_episode_naming_the_url(tokenizer: Any) -> None:
    llm = ScriptedLLM(tokenizer, ["<answer>x</answer>"])
    loop = make_loop(tokenizer, llm, retrieval_url="http://127.0.0.1:9/retrieve", search_retries=1, search_backoff=0.0)
    start = time.monotonic()
    with pytest.raises(RetrievalUnavailableError, match=r"preflight failed.*http://127\.0\.0\.1:9/retrieve"):
        await episode(loop)
    assert time.monotonic() - start < 10 and llm.calls == []  # nothing generated
    with pytest.raises(RetrievalUnavailableError):  # the next episode of this process fails at once
        await episode(make_loop(tokenizer, llm, retrieval_url="http://127.0.0.1:9/retrieve", search_retries=1))
    assert llm.calls == []


async def test_preflight_runs_once_per_process_for_concurrent_episodes(tokenizer: Any) -> None:
    searcher = CountingSearcher()
    loops = [make_loop(tokenizer, ScriptedLLM(tokenizer, ["<answer>x</answer>"]), searcher=searcher) for _ in range(6)]
    outs = await asyncio.gather(*(episode(loop) for loop in loops))
    assert searcher.probes == 1 and all(o.extra_fields["finished"] == 1.0 for o in outs)


async def test_failure_rate_guard_stops_the_run_when_the_server_dies(tokenizer: Any, index_dir: Path) -> None:
    server = serve_in_background(index_dir)
    knobs = {
        "retrieval_url": server.retrieve_url,
        "search_retries": 0,
        "search_timeout": 2.0,
        "search_failure_window": 4,
        "max_search_failure_rate": 0.5,
    }
    two_searches = ["<search>Zorbia</search>", "<search>capital</search>", "<answer>Quellport</answer>"]
    try:
        out = await episode(make_loop(tokenizer, ScriptedLLM(tokenizer, two_searches), max_turns=3, **knobs))
        assert "Quellport" in tokenizer.decode(out.response_ids) and out.extra_fields["searches"] == 2
    finally:
        server.stop()
    # 2 ok + 2 failed = 50 % of the window: allowed; the next failure makes it 3 of 4
    out = await episode(make_loop(tokenizer, ScriptedLLM(tokenizer, two_searches), max_turns=3, **knobs))
    assert tokenizer.decode(out.response_ids).count("Search failed") == 2
    with pytest.raises(RetrievalUnavailableError, match=r"3 of the last 4 searches .* failed"):
        await episode(make_loop(tokenizer, ScriptedLLM(tokenizer, two_searches), max_turns=3, **knobs))


def test_guard_window_arithmetic() -> None:
    guard = RetrievalGuard("http://h/retrieve", window=10, max_failure_rate=0.3)
    for _ in range(3):
        guard.record(True)  # 3 failures but fewer than 10 searches: no verdict yet
    for failed in [False] * 10 + [True] * 3:
        guard.record(failed)  # the window slides: 3 of the last 10 is not more than 30 %
    with pytest.raises(RetrievalUnavailableError, match="4 of the last 10"):
        guard.record(True, failure_text("the search service is unavailable"))
    never = RetrievalGuard("http://h/retrieve", window=3, max_failure_rate=1.0)
    for _ in range(10):
        never.record(True)  # rate 1.0 disables the guard


def test_trainer_start_preflight_uses_the_runs_settings(index_dir: Path) -> None:
    from sorl_verl.agent import AGENT_LOOPS_YAML
    from sorl_verl.agent.retrieval_guard import preflight_from_config, search_agent_settings

    def config(url: str, loop: str = "search_r1", **agent: Any) -> Any:
        rollout = {"agent": {"default_agent_loop": loop, "agent_loop_config_path": AGENT_LOOPS_YAML}}
        knobs = {"retrieval_url": url, "search_retries": 0, **agent}
        return OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}, "sorl": {"agent": knobs}})

    dead = "http://127.0.0.1:9/retrieve"
    assert search_agent_settings(config(dead)).max_obs_tokens == 512  # from the YAML entry
    start = time.monotonic()
    with pytest.raises(RetrievalUnavailableError, match=r"preflight failed.*http://127\.0\.0\.1:9/retrieve"):
        preflight_from_config(config(dead))
    assert time.monotonic() - start < 10
    preflight_from_config(config(dead, loop="tool_agent"))  # another agent loop: nothing to check
    preflight_from_config(config(dead, retrieval_preflight=False))
    server = serve_in_background(index_dir)
    try:
        preflight_from_config(config(server.retrieve_url))
    finally:
        server.stop()
