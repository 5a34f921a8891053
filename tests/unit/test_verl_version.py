"""One verl version range: pyproject.toml's verl dependency, read by ``sorl_verl.verl_version``;
the trainers' and the CPU path's version checks must hold the same range."""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet

from sorl_verl.verl_version import SUPPORTED_VERL, SUPPORTED_VERL_RANGE, TESTED_VERL, declared_range


def test_the_range_is_the_declared_dependency_lower_bound_first():
    assert SpecifierSet(SUPPORTED_VERL_RANGE) == SUPPORTED_VERL
    assert SUPPORTED_VERL_RANGE.startswith(f">={TESTED_VERL},")
    assert TESTED_VERL in SUPPORTED_VERL
    reqs = ["torch>=2", "verl[verl-core]<0.12,>=0.11.2", 'verl[vllm]>=0.1; extra == "vllm"']
    assert declared_range(reqs) == ">=0.11.2,<0.12"  # the extra's conditional requirement is not the range


@pytest.mark.parametrize("reqs", [["torch>=2"], ["verl"], ["verl>=1", "verl<2"]])
def test_a_missing_unversioned_or_doubled_verl_requirement_fails_naming_it(reqs):
    with pytest.raises(RuntimeError, match="one versioned verl requirement"):
        declared_range(reqs)


def test_the_version_checks_use_the_same_range():
    from sorl_verl.cpu.verl_compat import VERL_CHECKED
    from sorl_verl.trainer.verl_compat import SUPPORTED_VERL as TRAINER_SUPPORTED

    assert TRAINER_SUPPORTED == SUPPORTED_VERL and VERL_CHECKED == SUPPORTED_VERL
