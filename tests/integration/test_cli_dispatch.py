"""``sorl-verl``: one entry point whose subcommands hand their arguments to the existing modules'
``main``; every subcommand's ``--help``; the ``python -m`` forms still work; and a wheel (a
non-editable install) carries every tool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from sorl_verl import cli

REPO = Path(__file__).resolve().parents[2]
EXPECTED = {
    "doctor": "sorl_verl.doctor",
    "build-index": "sorl_verl.retrieval.build",
    "serve": "sorl_verl.retrieval.server",
    "convert": "sorl_verl.data.convert",
    "eval": "sorl_verl.cli.eval",
    "plot": "sorl_verl.cli.plot",
    "demo": "sorl_verl.cli.demo",
    "build": "sorl_verl.cli.build",
    "summary": "sorl_verl.cli.summary",
    "recipe-plan": "sorl_verl.cli.recipe_plan",
    "study": "sorl_verl.study.cli",
}


def _run(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_every_user_tool_is_a_subcommand_dispatching_to_its_module_main():
    assert {c.name: c.target.partition(":")[0] for c in cli.COMMANDS} == EXPECTED
    for command in cli.COMMANDS:
        module = __import__(EXPECTED[command.name], fromlist=["main"])
        assert cli.resolve(command) is module.main


@pytest.mark.parametrize("name", list(EXPECTED))
def test_help_of_every_subcommand(name):
    proc = _run("-m", "sorl_verl", name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.lstrip().splitlines()[0]
    if name == "demo":  # scripts/demo.sh prints its header comment
        assert "bash scripts/demo.sh [--algo" in proc.stdout
    else:
        assert first.startswith("usage:") and "--help" not in proc.stderr, proc.stdout[:300]


def test_usage_unknown_command_and_exit_codes(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in EXPECTED)
    assert cli.main([]) == 2
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_arguments_reach_the_module_and_exit_codes_come_back(tmp_path, monkeypatch, capsys):
    """Real modules: convert writes the parquet the python -m form writes; eval's exit 2 on bad input."""
    raw = tmp_path / "nq.jsonl"
    raw.write_text("".join(json.dumps({"question": f"q{i}?", "golden_answers": ["x"]}) + "\n" for i in range(3)))
    assert cli.main(["convert", "--dataset", "nq", "--input", str(raw), "--output", str(tmp_path / "a.parquet")]) == 0
    proc = _run(
        "-m", "sorl_verl.data.convert", "--dataset", "nq", "--input", str(raw), "--output", str(tmp_path / "b.parquet")
    )
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a.parquet"), pd.read_parquet(tmp_path / "b.parquet"))
    assert cli.main(["eval", "--metrics", str(tmp_path / "missing.jsonl"), "--out-dir", str(tmp_path / "e")]) == 2
    assert "no such metrics file" in capsys.readouterr().err


def test_study_is_imported_only_when_asked_for_and_gets_its_argv(monkeypatch):
    calls = []
    stand_in = types.ModuleType("sorl_verl.study.cli")  # stand-in for the study CLI: records its argv
    stand_in.main = lambda argv: calls.append(argv) or 7
    monkeypatch.setitem(sys.modules, "sorl_verl.study.cli", stand_in)
    assert cli.main(["study", "status", "--grid", "g.yaml"]) == 7
    assert calls == [["status", "--grid", "g.yaml"]]
    proc = _run(
        "-c",
        "import sys, sorl_verl.__main__; print(sorted(m for m in sys.modules if 'study' in m or 'matplotlib' in m))",
    )
    assert proc.stdout.strip() == "[]"  # importing the CLI imports no subcommand


def test_missing_command_module_is_one_message(monkeypatch, capsys):
    monkeypatch.setattr(
        cli, "BY_NAME", {**cli.BY_NAME, "study": cli.Command("study", "sorl_verl.no_such.cli:main", "")}
    )
    assert cli.main(["study"]) == 2
    assert "`sorl-verl study` needs sorl_verl.no_such.cli" in capsys.readouterr().err


def test_console_script_is_installed():
    exe = shutil.which("sorl-verl", path=str(Path(sys.executable).parent))
    assert exe, "sorl-verl console script missing: pip install -e ."
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "build-index" in proc.stdout


def test_a_wheel_install_has_every_tool_and_the_demo_says_what_it_needs(tmp_path):
    """Built from a copy of the sources (no build/ left in the checkout), unpacked on its own
    sys.path: the tools import from the wheel; the demo, which needs a checkout, exits 2 saying so."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "sorl_verl", src / "sorl_verl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("sorl_verl-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(site)
    assert {f"{EXPECTED[c].replace('.', '/')}.py" for c in EXPECTED} <= names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "sorl-verl = sorl_verl.__main__:main" in (site / entry_points).read_text()
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import sorl_verl.cli.eval as m; print(m.__file__)"
    assert _run("-c", code, cwd=tmp_path, env=env).stdout.strip().startswith(str(site))
    for name in ("eval", "plot"):
        proc = _run("-m", "sorl_verl", name, "--help", cwd=tmp_path, env=env)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: sorl-verl {name}"), proc.stderr[-2000:]
    proc = _run("-m", "sorl_verl", "demo", cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "runs scripts/demo.sh of a source checkout" in proc.stderr
