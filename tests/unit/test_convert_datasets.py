"""Dataset converters on small files written by the test, read back as verl reads parquet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sorl_verl.agent.prompts import QA_INSTRUCTION
from sorl_verl.data.convert import BadRowError, ConvertReport, convert_files, convert_rows
from sorl_verl.rewards import compute_score


def write_jsonl(path: Path, rows: list[Any], raw_lines: list[str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows] + (raw_lines or [])
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("dataset", "row", "golds"),
    [
        (
            "nq",
            {"id": "n1", "question": "who wrote it?", "golden_answers": ["Ama Velt", "A. Velt"]},
            ["Ama Velt", "A. Velt"],
        ),
        ("nq", {"question": "q?", "answer": ["x", "y"]}, ["x", "y"]),
        (
            "triviaqa",
            {"question_id": "t1", "question": "q?", "answer": {"value": "Paris", "aliases": ["Paris", "Paree"]}},
            ["Paris", "Paree"],
        ),
        ("popqa", {"id": 7, "question": "q?", "possible_answers": '["Ost", "Ost village"]'}, ["Ost", "Ost village"]),
        ("hotpotqa", {"_id": "h1", "question": "q?", "answer": "yes", "type": "comparison"}, ["yes"]),
        ("2wikimultihopqa", {"_id": "w1", "question": "q?", "answer": "1912"}, ["1912"]),
        (
            "musique",
            {"id": "m1", "question": "q?", "answer": "Ost", "answer_aliases": ["Ost town"], "answerable": True},
            ["Ost", "Ost town"],
        ),
        ("bamboogle", {"Question": "q?", "Answer": "Quellport"}, ["Quellport"]),
    ],
)
def test_qa_field_variants(tmp_path: Path, dataset: str, row: dict, golds: list[str]) -> None:
    (rec,) = convert_rows(dataset, write_jsonl(tmp_path / "in.jsonl", [row]), "test")
    assert rec["data_source"] == dataset and rec["agent_name"] == "search_r1"
    assert rec["reward_model"]["ground_truth"]["target"] == golds
    assert rec["prompt"][0]["role"] == "user" and rec["prompt"][0]["content"].startswith(QA_INSTRUCTION)
    assert rec["extra_info"]["split"] == "test"
    for key in ("id", "_id", "question_id"):
        if key in row:
            assert rec["extra_info"]["id"] == str(row[key])


def test_medqa_dict_and_list_options(tmp_path: Path) -> None:
    rows = [
        {
            "question": "Drug?",
            "options": {"A": "Ibuprofen", "B": "Heparin", "C": "Warfarin", "D": "Aspirin", "E": "None"},
            "answer_idx": "B",
            "answer": "Heparin",
        },
        {"question": "Drug 2?", "options": [{"key": "A", "value": "x"}, {"key": "B", "value": "y"}], "answer": "y"},
    ]
    recs = convert_rows("medqa", write_jsonl(tmp_path / "m.jsonl", rows))
    assert [r["reward_model"]["ground_truth"]["target"] for r in recs] == [["B"], ["B"]]
    assert recs[0]["ability"] == "medical-mcq" and "E. None" in recs[0]["prompt"][0]["content"]


@pytest.mark.parametrize(
    ("cops", "letters"),
    [([0, 3, 1], ["A", "D", "B"]), ([1, 4, 2], ["A", "D", "B"]), (["b", "c", "a"], ["B", "C", "A"])],
)
def test_medmcqa_cop_auto_base(tmp_path: Path, cops: list, letters: list[str]) -> None:
    rows = [
        {"id": str(i), "question": f"q{i}?", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": c}
        for i, c in enumerate(cops)
    ]
    recs = convert_rows("medmcqa", write_jsonl(tmp_path / "mm.jsonl", rows))
    assert [r["reward_model"]["ground_truth"]["target"][0] for r in recs] == letters


def test_medmcqa_ambiguous_cop_needs_flag(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mm.jsonl", [{"question": "q?", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": 2}]
    )
    with pytest.raises(BadRowError, match="--cop-base"):
        convert_rows("medmcqa", path)
    assert convert_rows("medmcqa", path, cop_base=1)[0]["reward_model"]["ground_truth"]["target"] == ["B"]
    assert convert_rows("medmcqa", path, cop_base=0)[0]["reward_model"]["ground_truth"]["target"] == ["C"]


def test_bad_rows_name_file_and_line_or_are_skipped(tmp_path: Path) -> None:
    good = {"question": "q?", "golden_answers": ["x"]}
    path = write_jsonl(
        tmp_path / "nq.jsonl",
        [good, {"question": "no answer"}, good],
        raw_lines=["{not json", '{"question": "", "answer": "x"}'],
    )
    with pytest.raises(BadRowError, match=r"nq\.jsonl:line 2: no gold answer"):
        convert_rows("nq", path)
    report = ConvertReport()
    recs = convert_rows("nq", path, skip_bad=True, report=report)
    assert len(recs) == 2 and report.skipped == 3 and report.written == 2
    assert any("line 4: invalid JSON" in e for e in report.first_errors)
    assert any("line 5: no question" in e for e in report.first_errors)
    musique = write_jsonl(tmp_path / "mu.jsonl", [{"question": "q?", "answer": "x", "answerable": False}])
    with pytest.raises(BadRowError, match="line 1: unanswerable"):
        convert_rows("musique", musique)


def test_golds_that_normalize_to_empty_are_dropped_counted_and_reported(tmp_path: Path) -> None:
    rows = [
        {"question": "q1?", "golden_answers": ["A", "Paris", "The"]},
        {"question": "q2?", "golden_answers": ["?"]},
        {"question": "q3?", "answer": "Ost"},
    ]
    path = write_jsonl(tmp_path / "nq.jsonl", rows)
    with pytest.raises(BadRowError, match=r"nq\.jsonl:line 2: every gold answer normalizes to the empty string"):
        convert_rows("nq", path)
    report = ConvertReport()
    recs = convert_rows("nq", path, skip_bad=True, report=report)
    assert [r["reward_model"]["ground_truth"]["target"] for r in recs] == [["Paris"], ["Ost"]]
    assert (report.empty_golds, report.skipped) == (3, 1)
    (warning,) = report.warnings()
    assert "dropped 3 gold answer(s)" in warning and "'A' at " in warning and "nq.jsonl:line 1" in warning
    assert ConvertReport().warnings() == []
    out = tmp_path / "nq.parquet"
    cmd = [sys.executable, "-m", "sorl_verl.data.convert", "--dataset", "nq", "--input", str(path)]
    done = subprocess.run([*cmd, "--output", str(out), "--skip-bad"], capture_output=True, text=True)
    assert done.returncode == 0 and "dropped 3 gold answer(s)" in done.stderr


def test_parquet_and_json_list_inputs_roundtrip_to_verl_parquet(tmp_path: Path) -> None:
    pd.DataFrame(
        [
            {"id": "p1", "question": "capital?", "golden_answers": ["Quellport"]},
            {"id": "p2", "question": "x?", "golden_answers": []},
        ]
    ).to_parquet(tmp_path / "in.parquet")
    (tmp_path / "in.json").write_text(json.dumps([{"_id": "j1", "question": "y?", "answer": "Ost"}]))
    out = tmp_path / "out" / "train.parquet"
    with pytest.raises(BadRowError, match=r"in\.parquet:row 2"):
        convert_files("hotpotqa", [tmp_path / "in.parquet"], out)
    report = convert_files("hotpotqa", [tmp_path / "in.parquet", tmp_path / "in.json"], out, skip_bad=True)
    assert (report.written, report.skipped) == (2, 1)
    df = pd.read_parquet(out)
    assert list(df["extra_info"].map(lambda e: e["index"])) == [0, 1]
    assert list(df["extra_info"].map(lambda e: e["id"])) == ["p1", "j1"]
    gt = df.iloc[0]["reward_model"]["ground_truth"]
    assert compute_score(df.iloc[0]["data_source"], "<answer>quellport</answer>", gt)["score"] == 1.0


def test_mcq_parquet_rows_score_after_roundtrip(tmp_path: Path) -> None:
    rows = [
        {"question": "q1?", "options": {"A": "x", "B": "y", "C": "z", "D": "w", "E": "v"}, "answer_idx": "E"},
        {"question": "q2?", "options": {"A": "x", "B": "y", "C": "z", "D": "w"}, "answer_idx": "C"},
    ]
    out = tmp_path / "medqa.parquet"
    convert_files("medqa", [write_jsonl(tmp_path / "m.jsonl", rows)], out)
    df = pd.read_parquet(out)
    gt1 = df.iloc[1]["reward_model"]["ground_truth"]  # options of row 2 gain E=None in the parquet struct
    assert compute_score("medqa", "<answer>C</answer>", gt1)["score"] == 1.0
    assert compute_score("medqa", "<answer>E</answer>", gt1)["score"] == 0.0
    assert compute_score("medqa", "<answer>v</answer>", df.iloc[0]["reward_model"]["ground_truth"])["score"] == 1.0


def test_cli(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "b.jsonl", [{"Question": "q?", "Answer": "ok"}], raw_lines=["[1]"])
    out = tmp_path / "b.parquet"
    cmd = [
        sys.executable,
        "-m",
        "sorl_verl.data.convert",
        "--dataset",
        "bamboogle",
        "--input",
        str(src),
        "--output",
        str(out),
    ]
    failed = subprocess.run(cmd, capture_output=True, text=True)
    assert failed.returncode != 0 and "b.jsonl:line 2" in failed.stderr and not out.exists()
    ok = subprocess.run([*cmd, "--skip-bad", "--split", "test"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "written 1 rows, skipped 1 bad rows" in ok.stdout
    assert pd.read_parquet(out).iloc[0]["extra_info"]["split"] == "test"


def test_original_release_formats_csv_tsv_triviaqa_json(tmp_path: Path) -> None:
    (tmp_path / "popqa.tsv").write_text(
        'id\tsubj\tquestion\tpossible_answers\n4\tOst\tWhere is Ost?\t["Vale", "the Vale"]\n'
    )
    (tmp_path / "bamboogle.csv").write_text('Question,Answer\n"Who, then, won?",Ama Velt\n')
    trivia = {
        "Data": [{"QuestionId": "tq1", "Question": "Capital?", "Answer": {"Value": "Paris", "Aliases": ["Paree"]}}]
    }
    (tmp_path / "trivia.json").write_text(json.dumps(trivia))
    (tmp_path / "lines.json").write_text(
        json.dumps({"question": "a?", "answer": "b"}) + "\n" + json.dumps({"question": "c?", "answer": "d"}) + "\n"
    )
    (popqa,) = convert_rows("popqa", tmp_path / "popqa.tsv")
    assert popqa["reward_model"]["ground_truth"]["target"] == ["Vale", "the Vale"] and popqa["extra_info"]["id"] == "4"
    (bam,) = convert_rows("bamboogle", tmp_path / "bamboogle.csv")
    assert bam["extra_info"]["question"] == "Who, then, won?" and bam["reward_model"]["ground_truth"]["target"] == [
        "Ama Velt"
    ]
    (tq,) = convert_rows("triviaqa", tmp_path / "trivia.json")
    assert tq["reward_model"]["ground_truth"]["target"] == ["Paris", "Paree"] and tq["extra_info"]["id"] == "tq1"
    assert [r["extra_info"]["question"] for r in convert_rows("nq", tmp_path / "lines.json")] == ["a?", "c?"]
    (tmp_path / "bad.csv").write_text("Question,Answer\nq1?,ok\nq2?,\n")
    with pytest.raises(BadRowError, match=r"bad\.csv:line 3: no gold answer"):
        convert_rows("bamboogle", tmp_path / "bad.csv")
