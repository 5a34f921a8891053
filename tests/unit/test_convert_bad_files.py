"""Bad input files (issue 12.6): one message naming file and line, exit 2, nothing half-written,
with and without ``--skip-bad``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sorl_verl.data.convert import BadFileError, ConvertReport, convert_rows


def convert_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sorl_verl.data.convert", *args], capture_output=True, text=True)


def assert_one_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr  # no traceback
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def qa_line(i: int) -> bytes:
    return json.dumps({"question": f"q{i}?", "golden_answers": ["Paris"]}).encode() + b"\n"


@pytest.mark.parametrize("skip_bad", [False, True])
@pytest.mark.parametrize(
    ("name", "content", "line"),
    [
        ("nq.jsonl", qa_line(1) + qa_line(2) + b'{"question": "caf\xe9?", "golden_answers": ["x"]}\n' + qa_line(4), 3),
        ("nq.csv", b"question,answer\nq1?,Paris\nq2?,Lyon \xff\n", 3),
        ("nq.json", b'[{"question": "q1?", "answer": "Paris"},\n {"question": "\xc3(", "answer": "x"}]\n', 2),
    ],
)
def test_non_utf8_byte_names_file_and_line_and_leaves_output_untouched(
    tmp_path: Path, name: str, content: bytes, line: int, skip_bad: bool
) -> None:
    src = tmp_path / name
    src.write_bytes(content)
    out = tmp_path / "out" / "train.parquet"
    out.parent.mkdir()
    out.write_bytes(b"previous run")
    proc = convert_cli("--dataset", "nq", "--input", str(src), "--output", str(out), *(["--skip-bad"] * skip_bad))
    assert_one_error(proc, f"{src}:line {line}", "not valid UTF-8")
    assert out.read_bytes() == b"previous run" and sorted(p.name for p in out.parent.iterdir()) == ["train.parquet"]


@pytest.mark.parametrize("skip_bad", [False, True])
def test_medmcqa_undetectable_cop_base_is_one_clear_error(tmp_path: Path, skip_bad: bool) -> None:
    rows = [
        {"question": f"q{i}?", "opa": "w", "opb": "x", "opc": "y", "opd": "z", "cop": c}
        for i, c in enumerate([1, 3, 2])
    ]
    src = tmp_path / "mm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mm.parquet"
    proc = convert_cli("--dataset", "medmcqa", "--input", str(src), "--output", str(out), *(["--skip-bad"] * skip_bad))
    assert_one_error(proc, f"{src}:line 1", "cannot tell whether cop is 0- or 1-based", "[1, 2, 3]", "--cop-base")
    assert not out.exists()
    with pytest.raises(BadFileError, match="cannot tell"):
        convert_rows("medmcqa", src, skip_bad=True)
    assert [r["reward_model"]["ground_truth"]["target"] for r in convert_rows("medmcqa", src, cop_base=1)] == [
        ["A"],
        ["C"],
        ["B"],
    ]


def test_lone_surrogate_is_a_bad_row_with_its_line(tmp_path: Path) -> None:
    src = tmp_path / "nq.jsonl"
    src.write_text(qa_line(1).decode() + '{"question": "bad \\ud800 text?", "answer": "x"}\n' + qa_line(3).decode())
    proc = convert_cli("--dataset", "nq", "--input", str(src), "--output", str(tmp_path / "a.parquet"))
    assert_one_error(proc, f"{src}:line 2", "not valid Unicode")
    report = ConvertReport()
    assert len(convert_rows("nq", src, skip_bad=True, report=report)) == 2 and report.skipped == 1
    ok = convert_cli("--dataset", "nq", "--input", str(src), "--output", str(tmp_path / "b.parquet"), "--skip-bad")
    assert ok.returncode == 0, ok.stderr
    assert len(pd.read_parquet(tmp_path / "b.parquet")) == 2


def test_corrupt_parquet_and_json_are_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "in.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "in.json").write_text('[{"question": "q?",\n "answer": }]')
    for name, needle in (("in.parquet", "not a readable parquet file"), ("in.json", f"{tmp_path / 'in.json'}:line 2")):
        proc = convert_cli("--dataset", "nq", "--input", str(tmp_path / name), "--output", str(tmp_path / "o.parquet"))
        assert_one_error(proc, needle)
    assert_one_error(
        convert_cli("--dataset", "nq", "--input", str(tmp_path / "missing.jsonl"), "--output", "x"), "not found"
    )
