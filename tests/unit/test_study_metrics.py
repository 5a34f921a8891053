"""The one reader of verl's metrics file (sorl_verl/study/metrics.py): record lines and validation keys."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.study.metrics import ValKey, parse_val_key, read_records, records, validation_by_source

SOURCE_CHARS = string.ascii_letters + string.digits + "_-./@"
VAR_CHARS = string.ascii_lowercase + "_"


@given(
    kind=st.sampled_from(["core", "aux"]),
    source=st.text(SOURCE_CHARS, min_size=1, max_size=30).filter(lambda s: not s.startswith("/")),
    var=st.text(VAR_CHARS, min_size=1, max_size=12),
    n=st.integers(min_value=1, max_value=10_000),
)
def test_a_validation_key_parses_back_into_its_parts(kind, source, var, n):
    """The source may hold '/' (the last segment before mean@ is the variable)."""
    assert parse_val_key(f"val-{kind}/{source}/{var}/mean@{n}") == ValKey(kind, source, var, n)


@pytest.mark.parametrize(
    "key",
    [
        "val-core/src/reward/mean",  # no @n
        "val-core/reward/mean@4",  # no source
        "val-other/src/reward/mean@4",
        "val-core/src/reward/std@4",
        "training/global_step",
        "val-core/src/reward/mean@x",
    ],
)
def test_other_keys_are_not_validation_means(key):
    assert parse_val_key(key) is None


def test_validation_by_source_takes_core_means_at_the_largest_n():
    data = {
        "val-core/a/reward/mean@1": 0.1,
        "val-core/a/reward/mean@4": 0.4,
        "val-core/a/reward/mean@2": 0.2,
        "val-aux/a/em/mean@8": 0.9,  # aux: not the core metric
        "val-core/b/acc/mean@1": 0.5,
        "val-core/c/reward/mean@1": "n/a",  # not a number
    }
    assert validation_by_source(data) == {"a": 0.4, "b": 0.5}


def test_records_skip_what_is_not_a_record_and_strict_names_the_bad_line(tmp_path):
    lines = [
        json.dumps({"step": 3, "data": {"x": 1}}),
        "",
        json.dumps({"step": "4", "data": {"x": 2}}),  # step not an integer
        json.dumps({"step": True, "data": {"x": 2}}),  # nor is a bool
        json.dumps([1, 2]),
        json.dumps({"step": 5, "data": [1]}),
        json.dumps({"data": {"x": 6}}),  # no step: 0
        '{"step": 7, "da',  # a run still writing
    ]
    assert list(records(lines)) == [(3, {"x": 1}), (0, {"x": 6})]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert list(read_records(path)) == [(3, {"x": 1}), (0, {"x": 6})]
    with pytest.raises(ValueError, match=rf"^{path}:8: not JSON"):
        list(read_records(path, strict=True))
