"""scripts/setup_env.sh keeps its venvs in the project's cache, keyed by what decides their contents.

Each test runs the real script in a scratch checkout (pyproject.toml, the two setup scripts and an
empty ``sorl_verl`` package) with every package source closed: no pip config, an unreachable index,
an empty find-links folder. A build then stops at torch's install as a killed one would stop, before
its marker, which is what these tests need; the full build and its reuse are measured in
docs/development.md ("CI budget").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH_SPEC = "torch==2.13.0+cpu" if sys.platform != "darwin" else "torch==2.13.0"
BUILD_LINE = re.compile(r"\[setup\] creating \.venv with .* in (\S+/([\w+-]+-([0-9a-f]{16}))\.build-\w+)$", re.M)


def checkout(root: Path) -> Path:
    """A scratch checkout with what setup_env.sh reads."""
    (root / "scripts").mkdir(parents=True)
    (root / "sorl_verl").mkdir()
    (root / "sorl_verl" / "__init__.py").write_text("")
    shutil.copy(ROOT / "pyproject.toml", root)
    for name in ("setup_env.sh", "setup_cpu_vllm.sh"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts")
    return root


def setup_env(co: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    links = co.parent / "no-wheels"
    links.mkdir(exist_ok=True)
    closed = {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": str(links),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "1",
        "TORCH_INDEX_URL": "http://127.0.0.1:9/whl",
        "PYTHON_BIN": sys.executable,
    }
    run_env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    run_env |= {**closed, "SORL_HOME": str(home), **env}
    return subprocess.run(
        ["bash", "scripts/setup_env.sh"], cwd=co, env=run_env, capture_output=True, text=True, timeout=300
    )


def failed_build(proc: subprocess.CompletedProcess) -> tuple[Path, str, str]:
    """(build folder, published name, key) of a build that stopped at torch's install."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[setup] error: cannot install the CPU build" in proc.stderr
    match = BUILD_LINE.search(proc.stdout)
    assert match, proc.stdout
    return Path(match[1]), match[2], match[3]


def test_a_killed_build_is_never_published_and_the_next_build_removes_it(tmp_path):
    co, home = checkout(tmp_path / "co"), tmp_path / "home"
    first, name, key = failed_build(setup_env(co, home))
    venvs = home / "venvs"
    assert first.parent == venvs.resolve() and first.is_dir()
    assert not (first / ".sorl_venv_complete").exists()  # the marker is written last
    assert not (venvs / name).exists() and not (co / ".venv").exists() and not (co / ".venv").is_symlink()

    (co / "sorl_verl" / "__init__.py").write_text("x = 1\n")  # the project's code is installed editable
    second, name2, key2 = failed_build(setup_env(co, home))
    assert (name2, key2) == (name, key), "the project's own code is not part of the key"
    assert not first.exists(), "the next build of the key removes the unfinished folder"
    assert sorted(p.name for p in venvs.iterdir() if ".build-" in p.name) == [second.name]


def test_the_key_follows_what_decides_the_contents(tmp_path):
    co, home = checkout(tmp_path / "co"), tmp_path / "home"
    _, _, key = failed_build(setup_env(co, home))
    with open(co / "scripts" / "setup_cpu_vllm.sh", "a") as f:
        f.write("\n# changed\n")
    key_scripts = failed_build(setup_env(co, home))[2]
    assert key_scripts != key
    with open(co / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    assert failed_build(setup_env(co, home))[2] not in (key, key_scripts)


def finished_venv(path: Path, key: str, imports_from: Path, extras: str = "test") -> None:
    """A venv as a finished build leaves it (marker last), whose ``sorl_verl`` is ``imports_from``'s."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python3*/site-packages")
    (site / "sorl_checkout.pth").write_text(f"{imports_from}\n")
    (path / ".sorl_venv_complete").write_text(f"{key}\n{extras}\n")


def test_a_finished_venv_of_the_key_is_reused_through_a_symlink(tmp_path):
    co, home = checkout(tmp_path / "co"), tmp_path / "home"
    build, name, key = failed_build(setup_env(co, home))
    published = build.parent / name
    finished_venv(published, key, imports_from=co.resolve())

    proc = setup_env(co, home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "creating" not in proc.stdout and "sorl-verl in .venv from this checkout" not in proc.stdout
    assert (co / ".venv").is_symlink() and (co / ".venv").resolve() == published
    # the symlink is kept under another SORL_HOME (a test's empty home): nothing is made there
    other_home = tmp_path / "other-home"
    assert setup_env(co, other_home).returncode == 0 and not other_home.exists()

    # another clone with the same key links the same venv and reinstalls the project from itself
    co2 = checkout(tmp_path / "co2")
    proc = setup_env(co2, home)
    assert f"[setup] .venv -> {published} (cached" in proc.stdout
    assert f"[setup] sorl-verl in .venv from this checkout ({co2.resolve()})" in proc.stdout
    assert (co2 / ".venv").resolve() == published


def test_a_link_to_a_venv_with_more_extras_is_kept(tmp_path):
    """`bash scripts/setup_cpu_vllm.sh` into .venv links it to the venv with vLLM (extras test,cpu-vllm):
    a later setup_env.sh for the extras test (test.sh, demo.sh) keeps that link, as a plain .venv with
    vLLM added was kept, instead of taking vLLM away again."""
    co, home = checkout(tmp_path / "co"), tmp_path / "home"
    build, name, key = failed_build(setup_env(co, home, SORL_EXTRAS="test,cpu-vllm"))
    assert name == f"test+cpu-vllm-{key}"
    with_vllm = build.parent / name
    finished_venv(with_vllm, key, imports_from=co.resolve(), extras="test,cpu-vllm")
    (co / ".venv").symlink_to(with_vllm)
    proc = setup_env(co, home)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    assert (co / ".venv").resolve() == with_vllm


def test_a_plain_venv_folder_is_used_in_place(tmp_path):
    co, home = checkout(tmp_path / "co"), tmp_path / "home"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(co / ".venv")], check=True)
    (co / ".venv" / ".sorl_installed").write_text(f"{TORCH_SPEC}\ntest\n")  # its stamp: installed
    proc = setup_env(co, home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "" and not (co / ".venv").is_symlink() and not home.exists()


def test_the_cache_can_be_turned_off_for_a_new_venv(tmp_path):
    co, home = checkout(tmp_path / "co"), tmp_path / "home"
    proc = setup_env(co, home, SORL_VENV_CACHE="0")
    assert proc.returncode == 1 and "[setup] creating .venv with" in proc.stdout and " in /" not in proc.stdout
    assert (co / ".venv").is_dir() and not (co / ".venv").is_symlink() and not home.exists()
