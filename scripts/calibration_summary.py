"""Summarize the normalizer calibration runs (scripts/calibrate_normalizer.sh).

Reads ``<dir>/<regime>/sorl_updates.jsonl`` (one record per optimizer step with each micro-batch's
``clip_bias_norm`` = ||C|| and ``clip_bias_rel`` = rho) and prints, per regime, the distribution of
both over the micro-batches that had gradients, and for candidate values of tau the share of
micro-batches with Z = max(1, q/tau) > 1 and the mean step factor mean(1/Z).

    python scripts/calibration_summary.py docs/results/calibration [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REGIMES = ("on_policy", "mild", "moderate", "heavy")
TAUS = {"clip_bias_norm": (0.05, 0.1, 0.2, 0.25, 0.3), "clip_bias_rel": (0.1, 0.2, 0.3, 0.4, 0.5)}


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for an empty list)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def micro_batches(path: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"clip_bias_norm": [], "clip_bias_rel": []}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key in out:
            out[key].extend(record.get(key, []))
    return out


def summarize(values: list[float], taus: tuple[float, ...]) -> dict:
    return {
        "micro_batches": len(values),
        "clipped_share": sum(v > 0 for v in values) / max(1, len(values)),
        "p50": quantile(values, 0.5),
        "p90": quantile(values, 0.9),
        "max": max(values, default=0.0),
        "tau": {
            str(tau): {
                "triggered": sum(v > tau for v in values) / max(1, len(values)),
                "mean_step_factor": statistics.fmean(min(1.0, tau / v) if v > 0 else 1.0 for v in values)
                if values
                else 1.0,
            }
            for tau in taus
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result: dict[str, dict] = {}
    for regime in REGIMES:
        path = args.dir / regime / "sorl_updates.jsonl"
        if not path.exists():
            continue
        data = micro_batches(path)
        result[regime] = {key: summarize(values, TAUS[key]) for key, values in data.items()}
    if not result:
        print(f"error: no {args.dir}/<regime>/sorl_updates.jsonl", file=sys.stderr)
        return 2
    for key, label in (("clip_bias_norm", "||C|| (absolute)"), ("clip_bias_rel", "rho (relative)")):
        taus = TAUS[key]
        print(f"\n{label}")
        head = " | ".join(f"tau={t}: Z>1 / mean 1/Z" for t in taus)
        print(f"| regime | micro-batches | clipped | p50 | p90 | max | {head} |")
        print("|" + " --- |" * (6 + len(taus)))
        for regime, summary in result.items():
            s = summary[key]
            cells = " | ".join(
                f"{s['tau'][str(t)]['triggered']:.2f} / {s['tau'][str(t)]['mean_step_factor']:.2f}" for t in taus
            )
            print(
                f"| {regime} | {s['micro_batches']} | {s['clipped_share']:.2f} | {s['p50']:.3f} | {s['p90']:.3f} "
                f"| {s['max']:.3f} | {cells} |"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
