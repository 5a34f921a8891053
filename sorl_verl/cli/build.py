"""Build (or reuse) the embedded default: synthetic world, BM25 index, tokenizer, warm-started tiny model.

``sorl-verl build [--root DIR] [--seed N] [--force] [--sft-steps N] [--threads N] [--quiet]`` (or
``python -m sorl_verl.cli.build``): the QA default through
:func:`sorl_verl.embedded.qa_build.ensure_embedded_default`, each step built only when missing.
Prints the artefact paths, the build seconds of each step and the warm-start's greedy EM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from sorl_verl.embedded.qa_build import EmbeddedConfig, ensure_embedded_default


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="sorl-verl build", description=__doc__.split("\n")[0])
    p.add_argument("--root", help="output directory (default: $SORL_HOME/embedded)")
    p.add_argument("--seed", type=int, default=EmbeddedConfig.seed, help="world seed (a new seed = a fresh world)")
    p.add_argument("--force", action="store_true", help="rebuild every step")
    p.add_argument("--sft-steps", type=int, help="warm-start optimiser steps")
    p.add_argument("--threads", type=int, help="torch threads for the warm-start (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (none either when stderr is not a terminal)")
    a = p.parse_args(argv)
    cfg = EmbeddedConfig(seed=a.seed)
    if a.sft_steps is not None:
        cfg = replace(cfg, sft=replace(cfg.sft, steps=a.sft_steps))
    if a.threads is not None:
        cfg = replace(cfg, num_threads=a.threads)
    t0 = time.perf_counter()
    progress = not a.quiet and sys.stderr.isatty()  # bars redraw with carriage returns: a terminal only
    paths = ensure_embedded_default(a.root, force=a.force, config=cfg, progress=progress)
    report = json.loads(paths.report.read_text()) if paths.report.is_file() else {}
    ev = report.get("warmstart", {}).get("eval", {})
    print(f"embedded default ready in {time.perf_counter() - t0:.1f}s under {paths.root}")
    print(f"  corpus    {paths.corpus}\n  train     {paths.parquet['train']}\n  val       {paths.parquet['val']}")
    print(f"  index     {paths.index_dir}\n  model     {paths.model_dir}")
    print(
        "  build seconds (last build of each step): "
        + ", ".join(f"{k}={v}" for k, v in report.get("build_seconds", {}).items())
    )
    if ev:
        print(
            "  warm-start greedy EM on val: " + ", ".join(f"{k}={ev[k]:.3f}" for k in sorted(ev) if k.startswith("em"))
        )


if __name__ == "__main__":
    main()
