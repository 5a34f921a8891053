"""Summarize the normalizer calibration runs (scripts/experiments/calibrate_normalizer.sh).

Reads ``<regime>/sorl_updates.jsonl`` (one record per optimizer step with each micro-batch's
``clip_bias_norm`` = ||C|| and ``clip_bias_rel`` = rho) and prints, per regime, the distribution of
both over the micro-batches that had gradients, and for candidate values of tau the share of
micro-batches with Z = max(1, q/tau) > 1 and the mean step factor mean(1/Z). The runs are read
from a directory (what scripts/experiments/calibrate_normalizer.sh writes) or from the ``.tar.xz`` the
repository keeps of it.

    python scripts/experiments/calibration_summary.py docs/results/calibration/runs.tar.xz [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
from pathlib import Path

REGIMES = ("on_policy", "mild", "moderate", "heavy")
TAUS = {"clip_bias_norm": (0.05, 0.1, 0.2, 0.25, 0.3), "clip_bias_rel": (0.1, 0.2, 0.3, 0.4, 0.5)}


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for an empty list)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def update_logs(source: Path) -> dict[str, str]:
    """regime -> text of its ``<regime>/sorl_updates.jsonl``, from a directory or a ``.tar.xz`` of one."""
    names = {f"{regime}/sorl_updates.jsonl": regime for regime in REGIMES}
    if source.is_dir():
        return {regime: (source / name).read_text() for name, regime in names.items() if (source / name).is_file()}
    with tarfile.open(source, "r:xz") as tar:
        found = {}
        for member in tar:
            handle = tar.extractfile(member) if member.name in names else None
            if handle is not None:
                found[names[member.name]] = handle.read().decode()
    return {regime: found[regime] for regime in REGIMES if regime in found}


def micro_batches(text: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"clip_bias_norm": [], "clip_bias_rel": []}
    for line in text.splitlines():
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
    parser.add_argument("source", type=Path, help="calibration directory or its .tar.xz")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result: dict[str, dict] = {}
    try:
        logs = update_logs(args.source)
    except (OSError, tarfile.TarError) as exc:
        print(f"error: {args.source}: {exc}", file=sys.stderr)
        return 2
    for regime, text in logs.items():
        data = micro_batches(text)
        result[regime] = {key: summarize(values, TAUS[key]) for key, values in data.items()}
    if not result:
        print(f"error: no <regime>/sorl_updates.jsonl in {args.source}", file=sys.stderr)
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
