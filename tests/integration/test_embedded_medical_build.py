"""The embedded medical default on a tiny budget: real world, real BM25 index, real tokenizer, real SFT."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sorl_verl.agent.actions import parse_action, turn_well_formed
from sorl_verl.agent.prompts import INFO_CLOSE, INFO_OPEN
from sorl_verl.embedded.medical_build import MedicalEmbeddedConfig, ensure_embedded_medical
from sorl_verl.embedded.medical_trajectories import (
    build_medical_sft_examples,
    early_stop_segments,
    expert_segments,
    sft_questions,
    user_message,
)
from sorl_verl.embedded.medical_world import (
    QUESTION_TYPES,
    MedicalWorldConfig,
    data_source,
    generate_medical_world,
)
from sorl_verl.embedded.tiny_model import TinyModelSpec
from sorl_verl.embedded.warmstart import SFTConfig, make_observer, prompt_ids, tokenize_trajectory
from sorl_verl.embedded.world import read_jsonl, write_world
from sorl_verl.rewards.score import compute_score

SMALL = MedicalEmbeddedConfig(
    world=MedicalWorldConfig(seed=3, num_conditions=24, num_drugs=16, num_mechanisms=6, num_val_per_type=3,
                             num_test_per_type=3),
    vocab_size=800,
    model=TinyModelSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=128, max_position_embeddings=1024),
    sft=SFTConfig(steps=25, batch_size=8, lr=5e-3, warmup_steps=3),
    sft_per_type=20,
    eval_per_type=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return ensure_embedded_medical(tmp_path_factory.mktemp("medical"), config=SMALL, progress=False)


def test_every_artefact_is_built_and_stamped(built) -> None:
    import pandas as pd

    for p in (built.corpus, *built.questions.values(), *built.parquet.values(), built.report):
        assert p.is_file(), p
    for d in (built.root / "world", built.root / "data", built.index_dir, built.tokenizer_dir, built.model_dir):
        assert (d / ".stamp.json").is_file(), d
    for name in ("generation_config.json", "tokenizer.json", "warmstart.json"):
        assert (built.model_dir / name).is_file(), name
    val = pd.read_parquet(built.parquet["val"])
    assert set(val["data_source"]) == {data_source(t) for t in QUESTION_TYPES}
    assert set(val["agent_name"]) == {"search_r1"} and set(val["ability"]) == {"medical-mcq"}
    for t in QUESTION_TYPES:
        assert set(pd.read_parquet(built.parquet[f"val_{t}"])["data_source"]) == {data_source(t)}
    report = json.loads(built.report.read_text())
    assert set(report["build_seconds"]) == {"world", "data", "index", "tokenizer", "model"}


def test_reuse_and_rebuild_only_downstream_of_a_changed_parameter(built, tmp_path) -> None:
    import shutil

    steps = ("world", "data", "index", "tokenizer", "model")
    root = shutil.copytree(built.root, tmp_path / "copy")  # stamps name inputs, not paths: a copy is reused

    def stamps() -> dict[str, str]:
        return {n: (root / n / ".stamp.json").read_text() for n in steps}

    before = stamps()
    ensure_embedded_medical(root, config=SMALL, progress=False)
    assert stamps() == before
    ensure_embedded_medical(
        root, config=replace(SMALL, sft=replace(SMALL.sft, steps=SMALL.sft.steps + 1)), progress=False
    )
    after = stamps()
    assert {n for n in steps if after[n] != before[n]} == {"model"}
    assert json.loads((root / "report.json").read_text())["build_seconds"].keys() >= {"model"}


def test_warm_start_lowers_the_loss_and_reports_success_per_type(built) -> None:
    ws = json.loads((built.model_dir / "warmstart.json").read_text())
    assert ws["loss_last10"] < ws["loss_first10"] - 1.0, ws
    assert set(ws["eval"]) == {"T0", "T1"}
    for ev in ws["eval"].values():
        assert ev["n"] == sum(ev[f"n_{t}"] for t in QUESTION_TYPES) == ev["n_1hop"] + ev["n_2hop"]
        assert all(0.0 <= ev[f"success_{t}"] <= 1.0 for t in QUESTION_TYPES)
    assert ws["num_examples"] >= SMALL.sft_per_type * len(QUESTION_TYPES)


def test_bm25_top3_holds_every_needed_passage_of_the_default_world(tmp_path) -> None:
    """Recall 1.0: each hop's query brings its support passage into the top 3 (default world, every split)."""
    from sorl_verl.retrieval.build import build_index
    from sorl_verl.retrieval.index import load_searcher

    world = generate_medical_world(MedicalWorldConfig())
    corpus = write_world(world, tmp_path / "world")["corpus"]
    searcher = load_searcher(build_index(corpus, tmp_path / "index", show_progress=False))
    pairs = [(query, doc) for qs in world.questions.values() for q in qs
             for query, doc in zip(q["hop_queries"], q["support_ids"], strict=True)]  # fmt: skip
    hits = searcher.search([query for query, _ in pairs], 3)
    missed = [(query, doc) for (query, doc), top in zip(pairs, hits, strict=True) if doc not in {h["id"] for h in top}]
    assert len(pairs) > 2000 and missed == []


def test_trajectories_answer_with_the_gold_options_text_and_parse_as_agent_actions(built) -> None:
    """Each type's expert trajectory: a search per hop (its passage in the observation), then the last
    fact and the gold option's text as answer, which the MCQ reward scores 1 (another option's text and
    the text of no option 0); tokenized as verl's tokenizer does, prompt and observations mask 0."""
    from transformers import AutoTokenizer

    observe = make_observer(built.index_dir)
    train = read_jsonl(built.questions["train"])
    for qtype in QUESTION_TYPES:
        q = next(q for q in train if q["type"] == qtype)
        segs = expert_segments(q, observe)
        assert [p for _, p in segs] == [True, False] * q["hops"] + [True]
        actions = [parse_action(text) for text, policy in segs if policy]
        assert [(a.kind, a.content) for a in actions] == [("search", h) for h in q["hop_queries"]] + [
            ("answer", q["answer"])
        ]
        assert all(turn_well_formed(text) for text, policy in segs if policy)
        assert segs[-1][0].endswith(f" {q['answer']}. </think>\n<answer> {q['answer']} </answer>")
        for i, hop in enumerate(q["hop_queries"]):
            assert f'"{hop}"' in segs[2 * i + 1][0], "the hop's passage is in its observation"
        gt = {"target": [q["answer_idx"]], "options": q["options"]}
        response = "".join(text for text, _ in segs)
        assert compute_score(data_source(qtype), response, gt)["score"] == 1.0
        head = response[: response.rindex("<answer>")]
        other = next(v for k, v in q["options"].items() if k != q["answer_idx"])
        assert compute_score(data_source(qtype), f"{head}<answer> {other} </answer>", gt)["score"] == 0.0
        assert compute_score(data_source(qtype), f"{head}<answer> Nothing </answer>", gt)["score"] == 0.0

    q = next(q for q in train if q["hops"] == 2)
    segs = expert_segments(q, observe)
    tok = AutoTokenizer.from_pretrained(built.model_dir)  # what verl loads (a Qwen2Tokenizer)
    trained_with = AutoTokenizer.from_pretrained(built.tokenizer_dir)
    ids, mask = tokenize_trajectory(tok, q["question"], segs, prompt=user_message(q))
    assert (ids, mask) == tokenize_trajectory(trained_with, q["question"], segs, prompt=user_message(q))
    n_prompt = len(prompt_ids(tok, q["question"], user_message(q)))
    assert not any(mask[:n_prompt]) and ids[-1] == tok.eos_token_id and mask[-1] == 1
    assert tok.decode(ids[:n_prompt]) == tok.apply_chat_template(
        [{"role": "user", "content": user_message(q)}], add_generation_prompt=True, tokenize=False
    )
    observed = tok.decode([t for t, m in zip(ids[n_prompt:], mask[n_prompt:], strict=True) if not m])
    assert observed.count(INFO_OPEN) == observed.count(INFO_CLOSE) == 2
    policy = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert INFO_OPEN not in policy and policy.rstrip().endswith(f"<answer> {q['answer']} </answer><|im_end|>")


def test_early_stop_demonstration_answers_the_bridge_and_scores_zero(built) -> None:
    """A two-hop question's early-stop demonstration is the expert's first search, then the first hop's
    fact and its value (the bridge entity, of another kind than the options) as answer: MCQ score 0."""
    observe = make_observer(built.index_dir)
    questions = read_jsonl(built.questions["train"])
    two_hop = [q for q in questions if q["hops"] == 2]
    assert {q["type"] for q in two_hop} == {t for t, qt in QUESTION_TYPES.items() if len(qt.chain) == 2}
    for q in two_hop[:8]:
        segs, expert = early_stop_segments(q, observe), expert_segments(q, observe)
        assert [p for _, p in segs] == [True, False, True] and segs[:2] == expert[:2], "the expert's first search"
        bridge = q["hop_queries"][1]
        assert bridge not in q["options"].values()
        # the thought that led the expert to its second search, then the bridge as the answer
        assert segs[-1][0] == expert[2][0].replace(f"<search> {bridge} </search>", f"<answer> {bridge} </answer>")
        assert segs[-1][0] != expert[2][0]
        gt = {"target": [q["answer_idx"]], "options": q["options"]}
        assert compute_score(data_source(q["type"]), "".join(t for t, _ in segs), gt)["score"] == 0.0
    with pytest.raises(ValueError, match="multi-hop"):
        early_stop_segments(next(q for q in questions if q["hops"] == 1), observe)


def test_early_stop_rate_replaces_that_share_of_two_hop_demonstrations(built) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.tokenizer_dir)
    observe = make_observer(built.index_dir)
    questions = read_jsonl(built.questions["train"])
    one = [q for q in questions if q["hops"] == 1][:3]
    two = [q for q in questions if q["hops"] == 2][:4]
    expert = build_medical_sft_examples(tok, one + two, observe, progress=False)
    early = build_medical_sft_examples(tok, one + two, observe, progress=False, early_stop_rate=1.0)
    assert early[: len(one)] == expert[: len(one)], "one-hop demonstrations never stop early"
    for (e_ids, _), (s_ids, _) in zip(expert[len(one) :], early[len(one) :], strict=True):
        searches = tok.decode(e_ids).count("<search>") - tok.decode(s_ids).count("<search>")
        assert searches == 1 and len(s_ids) < len(e_ids)
    assert build_medical_sft_examples(tok, two, observe, progress=False, early_stop_rate=0.0) == expert[len(one) :]


def test_prompt_is_the_parquet_rows_user_message(built) -> None:
    import pandas as pd

    rows = pd.read_parquet(built.parquet["val"])
    questions = read_jsonl(built.questions["val"])
    for row, q in zip(rows.itertuples(), questions, strict=True):
        assert list(row.prompt) == [{"role": "user", "content": user_message(q)}]


def test_extra_option_draws_balance_types_and_keep_the_answer() -> None:
    world = generate_medical_world(SMALL.world)
    train = world.questions["train"]
    qs = sft_questions(world, train, per_type=40, seed=1)
    for t in QUESTION_TYPES:
        of_type = [q for q in qs if q["type"] == t]
        n = sum(q["type"] == t for q in train)
        assert len(of_type) == n * max(1, -(-40 // n)) >= 40
    assert len({q["id"] for q in qs}) == len(qs)
    for q in qs:
        assert q["options"][q["answer_idx"]] == q["answer"] and list(q["options"].values()).count(q["answer"]) == 1
    redrawn = [q for q in qs if "~" in q["id"]]
    assert redrawn and any(q["answer_idx"] != next(o for o in train if o["id"] == q["id"].split("~")[0])["answer_idx"]
                           for q in redrawn)  # fmt: skip
