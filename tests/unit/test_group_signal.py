"""scripts/experiments/group_signal.py: the informative-group share against brute-force enumeration."""

from __future__ import annotations

import itertools
import runpy
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "experiments" / "group_signal.py"
informative_share = runpy.run_path(str(SCRIPT))["informative_share"]


@given(n=st.integers(2, 9), data=st.data())
def test_informative_share_is_the_share_of_mixed_subsets(n, data):
    group = data.draw(st.integers(1, n))
    k = data.draw(st.integers(0, n))
    outcomes = [1] * k + [0] * (n - k)
    subsets = list(itertools.combinations(range(n), group))
    mixed = sum(len({outcomes[i] for i in s}) == 2 for s in subsets)
    assert informative_share(k, n, group) == pytest.approx(mixed / len(subsets), abs=1e-12)


def test_informative_share_limits():
    assert informative_share(0, 8, 4) == 0.0 and informative_share(8, 8, 4) == 0.0
    assert informative_share(4, 8, 1) == 0.0  # a group of one never disagrees
    with pytest.raises(ValueError, match="at least 4 samples"):
        informative_share(1, 3, 4)
