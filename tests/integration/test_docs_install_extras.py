"""The GPU install extras resolve to verl's own extras of the installed verl release (the way verl
installs vLLM / SGLang / Megatron, with its pinned builds), under the base dependency's verl version
range, which is written there only (``sorl_verl.verl_version`` reads it); the CPU install is
untouched; the quickstart shows them."""

from __future__ import annotations

from importlib.metadata import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
GPU_EXTRAS = {"vllm": {"vllm"}, "sglang": {"sglang"}, "megatron": {"megatron", "mcore"}}


def test_gpu_extras_are_verl_s_own_extras_under_the_base_version_range():
    from sorl_verl.verl_version import SUPPORTED_VERL, declared_range

    base = next(Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "verl")
    assert base.specifier == SUPPORTED_VERL == SpecifierSet(declared_range(PROJECT["dependencies"]))

    verl_extras = set(metadata("verl").get_all("Provides-Extra"))
    extras = PROJECT["optional-dependencies"]
    for name, wanted in GPU_EXTRAS.items():
        (req,) = (Requirement(r) for r in extras[name])
        assert req.name == "verl" and req.extras == wanted, (name, req)
        assert wanted <= verl_extras, f"verl {metadata('verl')['Version']} has no extra {wanted - verl_extras}"
        assert not req.specifier, (name, "the verl range is the base dependency's; an extra adds none")


def test_cpu_install_brings_no_gpu_stack():
    names = {Requirement(r).name for r in PROJECT["dependencies"]}
    assert not names & {"vllm", "sglang", "megatron-core", "flash-attn"}
    base = next(Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "verl")
    assert base.extras == {"verl-core"}
    for extra in ("test", "dense", "plot"):
        assert all(Requirement(r).name != "verl" for r in PROJECT["optional-dependencies"][extra])


def test_quickstart_installs_with_an_engine_extra():
    text = (REPO / "docs" / "quickstart.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("pip install -e")]
    assert line.startswith('pip install -e ".[vllm,plot]"') and '".[sglang,plot]"' in line, line
