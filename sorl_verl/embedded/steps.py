"""Stamped, atomic build steps (progress on stderr).

``run_step(name, out, inputs, build)`` runs ``build(tmp_dir)`` unless ``out/.stamp.json`` records
the same hash of ``inputs``; the result is assembled in a temporary sibling directory and renamed
into place, so an interrupted build never leaves a half-written step. ``build_lock(root)`` makes
concurrent first uses wait for one builder instead of building twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def digest(obj: Any) -> str:
    """Short sha256 of the JSON form of ``obj`` (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stamp_of(path: Path) -> str | None:
    f = path / ".stamp.json"
    return json.loads(f.read_text())["inputs"] if f.is_file() else None


def log(tag: str, message: str) -> None:
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)


def run_step(
    name: str,
    out: Path,
    inputs: dict[str, Any],
    build: Callable[[Path], None],
    *,
    force: bool,
    timings: dict[str, float],
    tag: str,
) -> str:
    """Run ``build(tmp_dir)`` unless ``out`` holds a stamp of the same inputs; returns the stamp."""
    stamp = digest({"step": name, **inputs})
    if not force and stamp_of(out) == stamp:
        return stamp
    log(tag, f"building {name} -> {out}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    timings[name] = round(time.perf_counter() - t0, 2)
    (tmp / ".stamp.json").write_text(json.dumps({"inputs": stamp, "seconds": timings[name]}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(tag, f"{name} done in {timings[name]:.1f}s")
    return stamp


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """Exclusive lock on ``root/.build.lock`` for the duration of a build."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
