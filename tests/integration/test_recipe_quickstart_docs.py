"""Runs every bash block of docs/quickstart.md that is not marked ``# GPU only`` or ``# network``,
in order, in one bash session, on small stand-in files placed where the download step puts the
real ones, and stand-ins for two GPU runs' metrics written with verl's own Tracking into the run
directories the quickstart finds with DRY_RUN. Then checks what each step produced."""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "quickstart.md"
SKIP_MARKERS = ("# GPU only", "# network")
QA_TEST_SETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")

CORPUS = [
    ("Charles Darwin", "Charles Darwin wrote On the Origin of Species, published in 1859."),
    ("Paris", "Paris is the capital and largest city of France."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    ("Alan Turing", "Alan Turing was an English mathematician and computer scientist."),
]


def cpu_blocks(markdown: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL)
    return [b for b in blocks if not b.lstrip().startswith(SKIP_MARKERS)]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _stand_in_downloads(work: Path) -> dict[str, int]:
    """Raw files in the layout of step 2; returns rows per converted output."""
    _jsonl(
        work / "raw/wiki18/wiki-18.jsonl",
        [{"id": str(i), "contents": f'"{t}"\n{x}'} for i, (t, x) in enumerate(CORPUS)],
    )
    flashrag = work / "raw/flashrag"
    counts = {}
    for ds in ("nq", "hotpotqa"):
        rows = [
            {"id": f"{ds}{i}", "question": f"{ds} question {i}?", "golden_answers": [f"answer {i}"]} for i in range(3)
        ]
        _jsonl(flashrag / ds / "train.jsonl", rows)
        counts[f"train/{ds}"] = 3
    for i, ds in enumerate(QA_TEST_SETS):
        split = "dev" if ds in ("hotpotqa", "2wikimultihopqa", "musique") else "test"
        rows = [{"id": f"{ds}t{j}", "question": f"{ds} test {j}?", "golden_answers": ["Paris"]} for j in range(i + 1)]
        _jsonl(flashrag / ds / f"{split}.jsonl", rows)
        counts[f"test/{ds}"] = i + 1
    options = {"A": "aspirin", "B": "insulin", "C": "heparin", "D": "warfarin"}
    for split, n in (("train", 4), ("test", 2)):  # the Hub copy's file names
        _jsonl(
            work / f"raw/medqa/phrases_no_exclude_{split}.jsonl",
            [{"question": f"Drug {j}?", "options": options, "answer_idx": "B"} for j in range(n)],
        )
        counts[f"medical/{split}/medqa"] = n
    import pandas as pd

    for split, name in (("train", "train-00000-of-00001.parquet"), ("test", "validation-00000-of-00001.parquet")):
        rows = [
            {"id": f"m{j}", "question": f"Q{j}?", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": c}
            for j, c in enumerate((0, 3, 1))
        ]
        (work / "raw/medmcqa/data").mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(work / "raw/medmcqa/data" / name)
        counts[f"medical/{split}/medmcqa"] = 3
    return counts


#: writes what two GPU runs leave behind (verl's file + tensorboard loggers, one launch each) into
#: the run directories given as arguments: validation EM rises to step 10 for SO-GRPO; GRPO peaks
#: at step 5 and falls (so its best step is not its last)
STAND_IN_RUNS = """
import os, sys
from verl.utils.tracking import Tracking
QA = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
for run, slope in zip(sys.argv[1:], (0.02, 0.01)):
    os.makedirs(run)
    os.environ["VERL_FILE_LOGGER_PATH"] = os.path.join(run, "metrics.20250101-000000-1.jsonl")
    os.environ["TENSORBOARD_DIR"] = os.path.join(run, "tensorboard")
    tracker = Tracking(project_name="sorl", experiment_name=os.path.basename(run), default_backend=["file", "tensorboard"])
    for step in range(1, 11):
        data = {"critic/score/mean": slope * step, "actor/pg_clipfrac": 0.01, "sorl/norm_factor": 1.0,
                "actor/grad_norm": 0.4, "actor/entropy": 1.0 - slope * step}
        if step % 5 == 0:
            level = slope * step if slope == 0.02 else (0.3 if step == 5 else 0.05)
            for i, ds in enumerate(QA):
                data[f"val-aux/{ds}/em/mean@1"] = level + 0.01 * i
                data[f"val-aux/{ds}/f1/mean@1"] = level + 0.02 * i
        tracker.log(data, step=step)
    tracker.finish()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_blocks_are_marked_and_cpu_blocks_cover_every_step():
    markdown = QUICKSTART.read_text()
    blocks = cpu_blocks(markdown)
    text = "\n".join(blocks)
    for command in ("sorl-verl build-index", "sorl-verl serve", "sorl-verl convert",
                    "DRY_RUN=1 bash recipe/sorl/run_", "sorl-verl eval --metrics", "sorl-verl plot"):  # fmt: skip
        assert command in text, command
    assert "python -m sorl_verl" not in markdown and "scripts/eval.py" not in markdown  # the docs use the CLI
    # everything that trains or needs a GPU/network is in a marked block
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL):
        if block in blocks:
            assert "hf download" not in block and "--device cuda" not in block and "VAL_ONLY" not in block
            for line in re.findall(r"^[^#\n]*bash recipe/sorl/run_.*$", block, flags=re.MULTILINE):
                assert line.startswith("DRY_RUN=1 ") or "run_dir bash" in line, line


def test_quickstart_cpu_blocks_run_end_to_end(tmp_path):
    work = tmp_path / "sorl_work"
    counts = _stand_in_downloads(work)
    (tmp_path / "stand_in_runs.py").write_text(STAND_IN_RUNS)
    blocks = cpu_blocks(QUICKSTART.read_text())
    after = next(i for i, b in enumerate(blocks) if "RUN=$(run_dir " in b)  # the runs' directories are known
    blocks.insert(after + 1, f'{sys.executable} {tmp_path / "stand_in_runs.py"} "$RUN" "$BASELINE"')
    script = "set -euo pipefail\ntrap 'kill $(jobs -p) 2> /dev/null || true' EXIT\n" + "\n".join(blocks)
    recipe_vars = ("TRAIN_FILES", "VAL_FILES", "OUTPUT_DIR", "DRY_RUN", "RUN_NAME", "RUN_DIR", "RETRIEVAL_HOST")
    env = {k: v for k, v in os.environ.items() if k not in recipe_vars}
    env.update(SORL_WORK=str(work), PORT=str(_free_port()), PATH=f"{REPO / '.venv' / 'bin'}:{env['PATH']}")
    proc = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout

    # 3-4: index built and served; the query finds Darwin first
    assert (work / "index/wiki18_bm25").is_dir()
    reply = json.loads(next(line for line in out.splitlines() if line.startswith('{"result"')))
    assert "Origin of Species" in reply["result"][0][0]["document"]["contents"]

    # 5: every converted parquet file has the stand-in's rows
    import pandas as pd

    for name, n in counts.items():
        frame = pd.read_parquet(work / "data" / f"{name}.parquet")
        assert len(frame) == n, name
        assert set(frame["agent_name"]) == {"search_r1"}

    # 6: the printed command composes against verl's config with the hydra lists of files
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line == "python3" and lines[i + 1] == "-m")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("trainer.val_before_train="))
    argv = lines[start : end + 1]
    with initialize_config_dir(config_dir=argv[3].removeprefix("--config-path="), version_base=None):
        cfg = compose(config_name="sorl_trainer", overrides=argv[5:])
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    data = work / "data"
    assert list(cfg.data.train_files) == [str(data / "train/nq.parquet"), str(data / "train/hotpotqa.parquet")]
    assert list(cfg.data.val_files) == [str(data / f"test/{ds}.parquet") for ds in QA_TEST_SETS]
    assert cfg.sorl.agent.retrieval_url == f"http://127.0.0.1:{env['PORT']}/retrieve"
    assert cfg.sorl.guard.enable and cfg.sorl.guard.patience == 1 and cfg.trainer.test_freq > 0  # GUARD=1, the default

    # 0: the environment file every step sources
    assert f'export SORL_WORK="{work}"' in (work / "env.sh").read_text()

    # 8: the run directories found by DRY_RUN, and the EM tables of their last and best steps
    runs = sorted((work / "outputs").iterdir())
    assert [re.sub(r"-[0-9a-f]{8}$", "", r.name) for r in runs] == [
        "grpo-search-qwen2.5-3b-sync",
        "so_grpo-search-qwen2.5-3b-sync",
    ]
    run = runs[1]
    assert f"\n{run}\n" in f"\n{out}\n"  # echo "$RUN"
    with (run / "eval/eval.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    last = {r["data_source"]: r for r in rows if r["which"] == "last"}
    assert list(last) == [*QA_TEST_SETS, "average"] and {r["step"] for r in rows} == {"10"}  # rising: best = last
    assert abs(float(last["average"]["em"]) - sum(0.2 + 0.01 * i for i in range(7)) / 7) < 1e-9
    markdown = (run / "eval/eval.md").read_text()
    assert markdown.startswith("# SO-GRPO Qwen2.5-3B") and "## best validated step: 10" in markdown

    # 9: the overlay plot and its CSV
    assert (work / "curves.png").stat().st_size > 20_000
    rows = (work / "curves.csv").read_text().splitlines()
    assert rows[0] == "run,step,metric,value" and any(r.startswith("SO-GRPO,10,sorl/norm_factor,") for r in rows)
    assert any(r.startswith("GRPO,5,val-aux/nq/em/mean@1,0.3") for r in rows)
