"""scripts/bench/clip_bias_grad_memory.py --small: each configuration runs in its own process, the
products run where they should, and the ratios are the peaks' ratios."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def test_small_mode_runs_each_configuration_and_reports_ratios(
    bench_script: Callable[[str], ModuleType], tmp_path: Path
):
    out = tmp_path / "memory.json"
    result = bench_script("clip_bias_grad_memory").main(["--small", "--threads", "1", "--json-out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["model"] == "tiny" and result["tokens"] == [2, 64] and result["turn_clipfrac"] > 0
    peaks = result["peak_rss_mib"]
    assert set(peaks) == {"base", "diagnostic", "gradient"} and all(p > 0 for p in peaks.values())
    for name, peak in peaks.items():
        assert result["ratio_to_base"][name] == peak / peaks["base"]
    logged = result["clip_bias_grad_norm"]
    assert logged["base"] is None  # no product without the diagnostic or a gradient reference
    assert logged["diagnostic"] == logged["gradient"] > 0  # the same C(theta), once each
    assert "ru_maxrss" in result["measure"]


def test_live_tensors_mode_adds_the_profiler_peak_of_each_configuration(
    bench_script: Callable[[str], ModuleType],
):
    result = bench_script("clip_bias_grad_memory").main(["--small", "--threads", "1", "--live-tensors"])
    live = result["peak_live_tensor_mib"]
    assert set(live) == {"base", "diagnostic", "gradient"} and all(v > 0 for v in live.values())
    assert result["live_extra_in_parameter_buffers"]["base"] == 0.0
    assert set(result["peak_rss_mib"]) == set(live)  # the RSS run is still made, in its own process
