"""``sorl-verl eval`` (sorl_verl/cli/eval.py): EM/F1 per data source from (a) HF generation with the search loop against the
project's live retrieval server, (b) a generations file, (c) a verl validation metrics file.

The model is a tiny Llama whose weights make greedy decoding follow a fixed token chain
(one-hot embeddings, zeroed attention/MLP outputs, lm_head = successor table):
after the generation prompt it searches ``capital``; after ``</information>`` it answers ``paris``.
So every number in the tables below is known in advance.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "sorl_verl", "eval"]  # what `sorl-verl eval` runs

WORDS = ["<pad>", "<eos>", "<unk>", "<|assistant|>", "<search>", "capital", "</search>", "<information>",
         "</information>", "<answer>", "paris", "</answer>"]  # fmt: skip
SUCCESSOR = {"<|assistant|>": "<search>", "<search>": "capital", "capital": "</search>",
             "</information>": "<answer>", "<answer>": "paris", "paris": "</answer>"}  # fmt: skip
CORPUS = [
    {"id": "1", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "2", "contents": '"Rome"\nRome is the capital of Italy.'},
]


@pytest.fixture(scope="module")
def eval_script():
    from sorl_verl.cli import eval as module

    return module


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory) -> Path:
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from sorl_verl.agent.prompts import information_block
    from sorl_verl.retrieval.client import failure_text, format_documents

    out = tmp_path_factory.mktemp("chain_model")
    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"<\|?/?[a-z_]+\|?>"), "isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    # the observation's words are whole tokens too, so the retrieved text survives decoding
    unavailable = failure_text("the search service is unavailable")  # the retrieval client's notice
    observations = information_block(format_documents(CORPUS)) + information_block(unavailable)
    observed = [piece for piece, _ in pre.pre_tokenize_str(observations)]
    words = list(dict.fromkeys(WORDS + observed))
    words += [f"pad{i}" for i in range(-len(words) % 4)]  # hidden = vocab size: 2 heads of even size
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(out)
    size = len(vocab)
    config = LlamaConfig(
        vocab_size=size, hidden_size=size, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(size, size)
        for word, i in vocab.items():
            head[vocab[SUCCESSOR.get(word, "<eos>")], i] = 1.0
        model.lm_head.weight.copy_(head)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0, do_sample=False)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def test_sets(tmp_path_factory) -> list[Path]:
    """Two parquet files like the converters write: QA (nq, hotpotqa) and medical MCQ (medqa)."""
    import pandas as pd

    from sorl_verl.data.records import mcq_record, qa_record

    out = tmp_path_factory.mktemp("test_sets")
    qa = [
        qa_record("What is the capital of France?", ["Paris"], "nq", "test", 0),
        qa_record("Where was the painter born?", ["Lyon"], "nq", "test", 1),
        qa_record("Which city and country host the Louvre?", ["Paris France"], "hotpotqa", "test", 0),
    ]
    mcq = [
        mcq_record("Capital of France?", {"A": "London", "B": "Paris"}, "B", "medqa", "test", 0),
        mcq_record("Capital of Italy?", {"A": "Paris", "B": "Rome"}, "B", "medqa", "test", 1),
    ]
    pd.DataFrame(qa).to_parquet(out / "qa_test.parquet")
    pd.DataFrame(mcq).to_parquet(out / "medical_test.parquet")
    return [out / "qa_test.parquet", out / "medical_test.parquet"]


@pytest.fixture(scope="module")
def retrieval_url(tmp_path_factory):
    from sorl_verl.retrieval.build import build_index
    from sorl_verl.retrieval.server import serve_in_background

    root = tmp_path_factory.mktemp("retrieval")
    (root / "corpus.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    index = build_index(root / "corpus.jsonl", root / "index", show_progress=False)
    with serve_in_background(index) as server:
        yield server.retrieve_url


def _table(out_dir: Path, which: str | None = None) -> dict[str, dict[str, str]]:
    with (out_dir / "eval.csv").open() as fh:
        return {row["data_source"]: row for row in csv.DictReader(fh) if which in (None, row["which"])}


def _assert_row(row: dict[str, str], n, em: float, f1: float, sub_em: float) -> None:
    assert row["n"] == str(n)
    for key, want in (("em", em), ("f1", f1), ("substring_em", sub_em)):
        assert math.isclose(float(row[key]), want, abs_tol=1e-9), (row, key, want)


def test_generation_with_live_retrieval_server(chain_model, test_sets, retrieval_url, tmp_path):
    out = tmp_path / "eval"
    proc = subprocess.run(
        [*CLI, "--model", str(chain_model), "--data", *map(str, test_sets),
         "--out-dir", str(out), "--retrieval-url", retrieval_url, "--max-new-tokens", "8", "--title", "chain model"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _table(out)
    assert list(table) == ["nq", "hotpotqa", "medqa", "average"]  # papers' order, average last
    _assert_row(table["nq"], 2, 0.5, 0.5, 0.5)  # "paris" vs Paris (1) and Lyon (0)
    _assert_row(table["hotpotqa"], 1, 0.0, 2 * 1.0 * 0.5 / 1.5, 0.0)  # one of two gold tokens: F1 = 2/3
    _assert_row(table["medqa"], 2, 0.5, 0.5, 0.5)  # "paris" names option B (right) and option A (wrong)
    _assert_row(table["average"], 5, 1 / 3, (0.5 + 2 / 3 + 0.5) / 3, 1 / 3)
    generations = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 5
    for record in generations:
        assert (record["searches"], record["turns"]) == (1, 2)
        # the observation is the server's top-3 (two docs here) in Search-R1's "Doc i(Title: ...)" format,
        # appended as its own tokens; the word-level test tokenizer decodes tokens joined by single spaces
        assert record["response"] == (
            '<search> capital </search> <information> Doc 1(Title: "Paris") Paris is the capital of France. '
            'Doc 2(Title: "Rome") Rome is the capital of Italy. </information> <answer> paris </answer>'
        )
    markdown = (out / "eval.md").read_text()
    assert {row["which"] for row in _table(out).values()} == {"generated"}
    assert markdown.startswith("# chain model\n") and "| hotpotqa | 1 | 0.000 | 0.667 | 0.000 |" in markdown


def test_unreachable_server_and_turn_budget(eval_script, chain_model, test_sets, tmp_path):
    dead = "http://127.0.0.1:9/retrieve"
    eval_script.main(["--model", str(chain_model), "--data", str(test_sets[0]), "--out-dir", str(tmp_path / "a"),
                      "--retrieval-url", dead, "--max-new-tokens", "8", "--max-per-source", "1"])  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "a" / "generations.jsonl").read_text().splitlines()]
    assert [r["data_source"] for r in rows] == ["nq", "hotpotqa"]  # --max-per-source 1
    # the project's retrieval client's failure notice (after its retries)
    failed = "<information> Search failed (the search service is unavailable). Try the search again"
    assert all(failed in r["response"] for r in rows)
    _assert_row(_table(tmp_path / "a")["nq"], 1, 1.0, 1.0, 1.0)  # still answers after the failed search
    # one turn only: a search asked for on the last turn is not run, so nothing is answered
    eval_script.main(["--model", str(chain_model), "--data", str(test_sets[0]), "--out-dir", str(tmp_path / "b"),
                      "--retrieval-url", dead, "--max-new-tokens", "8", "--max-turns", "1"])  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "b" / "generations.jsonl").read_text().splitlines()]
    assert {(r["searches"], r["turns"], r["response"]) for r in rows} == {(0, 1, "<search> capital </search>")}
    _assert_row(_table(tmp_path / "b")["average"], 3, 0.0, 0.0, 0.0)


def test_rescoring_a_generations_file(eval_script, tmp_path, capsys):
    rows = [
        {"data_source": "nq", "response": "<think>x</think><answer> The Paris </answer>", "ground_truth": {"target": ["Paris"]}},
        {"data_source": "nq", "response": "<answer>Paris city</answer>", "ground_truth": ["Paris"]},
        {"data_source": "bamboogle", "response": "no answer tag", "ground_truth": "Paris"},
        {"data_source": "medmcqa", "response": "<answer> B </answer>",
         "ground_truth": {"target": ["B"], "options": {"A": "x", "B": "y"}}},
    ]  # fmt: skip
    path = tmp_path / "gens.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_script.main(["--generations", str(path), "--out-dir", str(tmp_path / "out")])
    table = _table(tmp_path / "out")
    assert list(table) == ["nq", "bamboogle", "medmcqa", "average"]
    # EM: articles dropped (1) / extra token (0); F1 of "paris city" vs "paris" = 2*(1/2*1)/(3/2) = 2/3
    _assert_row(table["nq"], 2, 0.5, (1 + 2 / 3) / 2, 1.0)
    _assert_row(table["bamboogle"], 1, 0.0, 0.0, 0.0)
    _assert_row(table["medmcqa"], 1, 1.0, 1.0, 1.0)
    (tmp_path / "bad.jsonl").write_text("\n" + json.dumps({"data_source": "nq", "response": "x"}) + "\n")
    assert eval_script.main(["--generations", str(tmp_path / "bad.jsonl"), "--out-dir", str(tmp_path / "x")]) == 2
    assert "bad.jsonl:2: missing ['ground_truth']" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing half-written


def _log_validations(metrics: Path, ems: dict[int, float], monkeypatch) -> None:
    """verl's own Tracking file logger: validation at each step of ``ems``, training steps between."""
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    tracker = Tracking(project_name="p", experiment_name="val", default_backend=["file"])
    for step, em in ems.items():
        tracker.log({"val-core/nq/reward/mean@1": em, "val-aux/nq/em/mean@1": em, "val-aux/nq/f1/mean@1": em + 0.1,
                     "val-aux/popqa/em/mean@1": em / 2, "val-aux/popqa/f1/mean@1": em}, step=step)  # fmt: skip
        tracker.log({"actor/pg_clipfrac": 0.1, "critic/score/mean": 0.3}, step=step + 1)
    tracker.finish()


def test_table_from_a_verl_validation_run_reports_last_and_best_steps(eval_script, tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    _log_validations(metrics, {0: 0.1, 50: 0.4, 100: 0.06}, monkeypatch)  # a collapse after step 50
    assert eval_script.main(["--metrics", str(metrics), "--out-dir", str(tmp_path / "out")]) == 0
    last, best = _table(tmp_path / "out", "last"), _table(tmp_path / "out", "best")
    assert list(last) == ["nq", "popqa", "average"] and {r["step"] for r in last.values()} == {"100"}
    assert math.isclose(float(last["nq"]["em"]), 0.06) and math.isclose(float(last["popqa"]["em"]), 0.03)
    assert {r["step"] for r in best.values()} == {"50"}
    assert math.isclose(float(best["nq"]["em"]), 0.4) and math.isclose(float(best["nq"]["f1"]), 0.5)
    assert math.isclose(float(best["popqa"]["em"]), 0.2) and math.isclose(float(best["average"]["em"]), 0.3)
    assert best["popqa"]["substring_em"] == ""  # not logged -> left empty, never invented
    markdown = (tmp_path / "out" / "eval.md").read_text()
    assert "## last validated step: 100 (macro-average EM 0.045)" in markdown
    assert "## best validated step: 50 (macro-average EM 0.300)" in markdown


def test_run_directory_launches_in_order_and_step_picking(eval_script, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    # two launches of one run (the second resumed at 50 and validated it again, then went on)
    _log_validations(run / "metrics.20250101-000000-1.jsonl", {0: 0.1, 50: 0.3}, monkeypatch)
    _log_validations(run / "metrics.20250102-000000-1.jsonl", {50: 0.35, 100: 0.2, 150: 0.5}, monkeypatch)
    for step in (50, 100):
        (run / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
    capsys.readouterr()  # verl's logger announces its file
    assert eval_script.main(["--metrics", str(run), "--print-step", "best"]) == 0
    assert capsys.readouterr().out.strip() == "150"
    assert (
        eval_script.main(["--metrics", str(run), "--print-step", "best", "--checkpoints", str(run / "checkpoints")])
        == 0
    )
    assert capsys.readouterr().out.strip() == "50"  # 0.35: the resumed launch's value for step 50 wins
    assert (
        eval_script.main(["--metrics", str(run), "--print-step", "last", "--checkpoints", str(run / "checkpoints")])
        == 0
    )
    assert capsys.readouterr().out.strip() == "100"
    assert eval_script.main(["--metrics", str(run), "--print-step", "last", "--checkpoints", str(tmp_path)]) == 2
    assert "none of the validated steps [0, 50, 100, 150]" in capsys.readouterr().err
    assert eval_script.main(["--metrics", str(tmp_path / "none"), "--out-dir", str(tmp_path / "o")]) == 2
    assert "no such metrics file or run directory" in capsys.readouterr().err
