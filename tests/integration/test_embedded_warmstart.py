"""Embedded default on a tiny budget: real world, real BM25 index, real tokenizer, real SFT."""

from __future__ import annotations

import json

import pytest

from sorl_verl.agent.prompts import ANSWER_CLOSE, INFO_CLOSE, INFO_OPEN, SEARCH_CLOSE
from sorl_verl.embedded.qa_build import EmbeddedConfig, ensure_embedded_default
from sorl_verl.embedded.qa_trajectories import (
    build_qa_sft_examples,
    early_stop_segments,
    evaluate_em,
    expert_segments,
)
from sorl_verl.embedded.tiny_model import TinyModelSpec
from sorl_verl.embedded.warmstart import (
    SFTConfig,
    greedy_rollouts,
    make_observer,
    prompt_ids,
    stops_early,
    tokenize_trajectory,
)
from sorl_verl.embedded.world import read_jsonl

SMALL = EmbeddedConfig(
    seed=7,
    num_entities=24,
    num_val_per_hop=6,
    num_test_per_hop=6,
    vocab_size=800,
    model=TinyModelSpec(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=1024,
    ),
    sft=SFTConfig(steps=30, batch_size=8, lr=5e-3, warmup_steps=3),
    eval_per_hop=3,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded")
    return ensure_embedded_default(root, config=SMALL, progress=False)


def test_every_artefact_is_built_and_stamped(built) -> None:
    import pandas as pd

    for p in (built.corpus, *built.questions.values(), *built.parquet.values(), built.report):
        assert p.is_file(), p
    for d in (built.root / "world", built.root / "data", built.index_dir, built.tokenizer_dir, built.model_dir):
        assert (d / ".stamp.json").is_file(), d
    assert (built.model_dir / "generation_config.json").is_file()
    assert (built.model_dir / "tokenizer.json").is_file()
    df = pd.read_parquet(built.parquet["val_2hop"])
    assert set(df["data_source"]) == {"synthetic_2hop"} and len(df) == 6
    report = json.loads(built.report.read_text())
    assert set(report["build_seconds"]) == {"world", "data", "index", "tokenizer", "model"}


def test_warm_start_lowers_the_loss(built) -> None:
    ws = json.loads((built.model_dir / "warmstart.json").read_text())
    assert ws["loss_last10"] < ws["loss_first10"] - 1.0, ws
    assert 0.0 <= ws["eval"]["em_1hop"] <= 1.0 and ws["eval"]["n_1hop"] == 3


def test_expert_trajectory_masks_and_real_retrieval(built) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.model_dir)  # what verl loads (a Qwen2Tokenizer)
    observe = make_observer(built.index_dir)
    q = next(q for q in read_jsonl(built.questions["train"]) if q["hops"] == 2)
    segs = expert_segments(q, observe)
    trained_with = AutoTokenizer.from_pretrained(built.tokenizer_dir)
    assert tokenize_trajectory(trained_with, q["question"], segs) == tokenize_trajectory(tok, q["question"], segs)
    assert [p for _, p in segs] == [True, False, True, False, True]
    for hop, (text, _) in enumerate(segs[1::2]):
        assert text.strip().startswith(INFO_OPEN) and text.strip().endswith(INFO_CLOSE)
        assert f'"{q["hop_queries"][hop]}"' in text, "the hop's support passage is in the top 3"
    assert segs[0][0].endswith(SEARCH_CLOSE) and segs[-1][0].endswith(ANSWER_CLOSE)
    ids, mask = tokenize_trajectory(tok, q["question"], segs)
    assert len(ids) == len(mask) and ids[-1] == tok.eos_token_id and mask[-1] == 1
    policy = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert INFO_OPEN not in policy and q["golden_answers"][0] in policy and "<|user|>" not in policy
    n_prompt = len(prompt_ids(tok, q["question"]))
    assert not any(mask[:n_prompt]) and ids[n_prompt - 1] == tok.convert_tokens_to_ids("<|assistant|>")
    observed = tok.decode([t for t, m in zip(ids[n_prompt:], mask[n_prompt:], strict=True) if not m])
    assert observed.count(INFO_OPEN) == observed.count(INFO_CLOSE) == 2


def test_early_stop_demonstration_answers_the_bridge_entity(built) -> None:
    """One search, then the first hop's value as answer: scored 0 by the project's reward."""
    from sorl_verl.rewards.score import compute_score

    observe = make_observer(built.index_dir)
    q = next(q for q in read_jsonl(built.questions["train"]) if q["hops"] == 2)
    segs = early_stop_segments(q, observe)
    assert [p for _, p in segs] == [True, False, True]
    assert segs[0][0] == expert_segments(q, observe)[0][0] and segs[1] == expert_segments(q, observe)[1]
    bridge = q["hop_queries"][1]
    assert segs[-1][0].endswith(f"<answer> {bridge} </answer>") and bridge not in q["golden_answers"]
    response = "".join(t for t, _ in segs)
    assert compute_score("synthetic_2hop", response, {"target": q["golden_answers"]})["em"] == 0.0
    one_hop = next(q for q in read_jsonl(built.questions["train"]) if q["hops"] == 1)
    with pytest.raises(ValueError, match="multi-hop"):
        early_stop_segments(one_hop, observe)


def test_early_stop_rate_is_a_seeded_share_of_multi_hop_questions(built) -> None:
    from transformers import AutoTokenizer

    qs = read_jsonl(built.questions["train"])
    multi = [q for q in qs if q["hops"] > 1]
    assert not any(stops_early(q, 1.0) for q in qs if q["hops"] == 1)
    assert all(stops_early(q, 1.0) for q in multi) and not any(stops_early(q, 0.0) for q in multi)
    drawn = [stops_early(q, 0.5, seed=3) for q in multi]
    assert drawn == [stops_early(q, 0.5, seed=3) for q in multi], "the draw is a function of (seed, id)"
    # the share over n questions is Binomial(n, 0.5): within 4 standard deviations
    n = len(multi)
    assert abs(sum(drawn) - n / 2) <= 4 * (n / 4) ** 0.5, (sum(drawn), n)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stops_early(multi[0], 1.5)
    tok = AutoTokenizer.from_pretrained(built.tokenizer_dir)
    observe = make_observer(built.index_dir)
    two = [q for q in qs if q["hops"] == 2][:4]
    expert = build_qa_sft_examples(tok, two, observe, progress=False)
    early = build_qa_sft_examples(tok, two, observe, progress=False, early_stop_rate=1.0)
    for (e_ids, _), (s_ids, _) in zip(expert, early, strict=True):
        assert (
            len(s_ids) < len(e_ids) and tok.decode(e_ids).count("<search>") - tok.decode(s_ids).count("<search>") == 1
        )


def test_rollout_loop_scores_scripted_policies(built) -> None:
    """The evaluation loop with the expert replayed turn by turn scores EM 1; a wrong final answer
    scores 0; a policy that never answers stops after max_turns."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.model_dir)
    observe = make_observer(built.index_dir)
    qs = [q for q in read_jsonl(built.questions["val"]) if q["hops"] in (1, 2)]
    script = {}
    for q in qs:
        turns = [t for t, is_policy in expert_segments(q, observe) if is_policy]
        script[tuple(prompt_ids(tok, q["question"]))] = [tok(t, add_special_tokens=False)["input_ids"] for t in turns]
    search_close = tok.convert_tokens_to_ids(SEARCH_CLOSE)
    calls = []

    def expert(rows, wrong=False):
        out = []
        for row in rows:
            prompt = next(p for p in script if tuple(row[: len(p)]) == p)
            turn = row[len(prompt) :].count(search_close)
            seq = script[prompt][turn]
            if wrong and turn == len(script[prompt]) - 1:
                seq = tok("<answer> Nobody </answer>", add_special_tokens=False)["input_ids"]
            out.append(seq)
        calls.append(len(rows))
        return out

    res = evaluate_em(None, tok, qs, observe, generate=expert)
    assert res["em_1hop"] == 1.0 and res["em_2hop"] == 1.0 and res["n"] == len(qs)
    n2 = sum(q["hops"] == 2 for q in qs)
    assert calls == [len(qs), len(qs), n2]  # every row searches once; 2-hop rows search again, then answer
    assert evaluate_em(None, tok, qs, observe, generate=lambda rows: expert(rows, wrong=True))["em"] == 0.0

    def searcher_forever(rows):
        return [tok("<search> x </search>", add_special_tokens=False)["input_ids"] for _ in rows]

    resp = greedy_rollouts(None, tok, qs[:2], observe, max_turns=3, generate=searcher_forever)
    # as in training: turns 1 and 2 get their observation, the search asked for on the last turn is not run
    assert all(r.count(INFO_OPEN) == 2 and r.count(SEARCH_CLOSE) == 3 and ANSWER_CLOSE not in r for r in resp)


def test_parquet_and_tokenizer_load_in_verl_rl_dataset(built, tmp_path) -> None:
    """verl's own dataset reads the rows and chat-templates every prompt within 48 tokens."""
    from omegaconf import OmegaConf
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = hf_tokenizer(str(built.tokenizer_dir))
    cfg = OmegaConf.create(
        {
            "max_prompt_length": 48,
            "filter_overlong_prompts": True,
            "cache_dir": str(tmp_path),
            "filter_overlong_prompts_workers": 1,
        }
    )
    files = [str(built.parquet["val_1hop"]), str(built.parquet["val_2hop"])]
    ds = RLHFDataset(files, tok, cfg)
    assert len(ds) == 12, "no prompt may be filtered as overlong"
    row = ds[0]
    assert row["raw_prompt"][0]["role"] == "user" and row["agent_name"] == "search_r1"
    assert row["data_source"] in {"synthetic_1hop", "synthetic_2hop"}


def test_a_caller_waits_for_the_build_that_holds_the_lock_then_reuses_it(built) -> None:
    """A build in progress elsewhere (here: this test holding ``root``'s build lock, which blocks any
    other open file of the lock, in this process too) makes ``ensure_embedded_default`` wait, then
    reuse what was built: how the test suite's background build and its first user meet."""
    import threading

    from sorl_verl.embedded.steps import build_lock

    result = {}

    def call() -> None:
        result["paths"] = ensure_embedded_default(built.root, config=SMALL, progress=False)

    worker = threading.Thread(target=call, daemon=True)
    with build_lock(built.root):
        worker.start()
        worker.join(timeout=2.0)  # a built root alone takes milliseconds: only the lock holds it back
        assert worker.is_alive() and not result, "ensure_embedded_default did not wait for the build lock"
    worker.join(timeout=60)
    assert result["paths"].model_dir == built.model_dir


def test_second_call_reuses_and_a_changed_parameter_rebuilds_downstream(built, capsys, tmp_path) -> None:
    """The rebuild runs on a copy of the built root, so the module's build stays as it was (any test
    order)."""
    import shutil

    stamps = {d: (d / ".stamp.json").read_text() for d in (built.index_dir, built.tokenizer_dir, built.model_dir)}
    capsys.readouterr()
    again = ensure_embedded_default(built.root, config=SMALL, progress=False)
    assert "building" not in capsys.readouterr().err  # build progress goes to stderr
    assert {d: (d / ".stamp.json").read_text() for d in stamps} == stamps
    assert again.model_dir == built.model_dir
    # a different SFT budget rebuilds only the model step
    copy = shutil.copytree(built.root, tmp_path / "copy")
    changed = EmbeddedConfig(**{**SMALL.__dict__, "sft": SFTConfig(steps=2, batch_size=4, warmup_steps=1)})
    rebuilt = ensure_embedded_default(copy, config=changed, progress=False)
    out = capsys.readouterr().err
    assert "building model" in out and "building tokenizer" not in out and "building index" not in out
    assert (rebuilt.model_dir / ".stamp.json").read_text() != stamps[built.model_dir]
    assert {d: (d / ".stamp.json").read_text() for d in stamps} == stamps, "the module's build is untouched"
