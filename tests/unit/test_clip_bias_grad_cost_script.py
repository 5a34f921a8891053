"""scripts/bench/clip_bias_grad_cost.py on the CPU with a tiny Qwen2: every contender runs a whole step and
the extra products run exactly where they should."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def test_tiny_step_runs_each_contender_and_the_products(bench_script: Callable[[str], ModuleType], tmp_path: Path):
    out = tmp_path / "cost.json"
    result = bench_script("clip_bias_grad_cost").main(
        ["--rows", "2", "--length", "48", "--reps", "1", "--spread", "1.0", "--json-out", str(out)]
    )
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    assert data["turn_clipfrac_mean"] > 0
    logged = data["clip_bias_grad_norm"]
    assert logged["base"] is None  # no diagnostic due, reference relative: no product
    assert all(logged[name] > 0 for name in ("gradient", "relative", "diagnostic"))
    assert logged["gradient"] == logged["relative"] == logged["diagnostic"]  # the same C(theta) each time
    assert data["ratio_to_base"]["base"] == 1.0 and all(v > 0 for v in data["median_s"].values())
