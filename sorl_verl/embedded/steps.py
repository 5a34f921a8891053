"""Stamped, atomic build steps (progress on stderr) and what the builds of both tasks share.

``run_step(name, out, inputs, build)`` runs ``build(tmp_dir)`` unless ``out/.stamp.json`` records
the same hash of ``inputs``; the result is assembled in a temporary sibling directory and renamed
into place, so an interrupted build never leaves a half-written step. ``build_lock(root)`` makes
concurrent first uses wait for one builder instead of building twice. :class:`EmbeddedPaths` is
the layout of a built task, :func:`build_bm25_step` its index step, :func:`record_build` its
``report.json``.
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EmbeddedPaths:
    """Where the built artefacts of one task are."""

    root: Path
    corpus: Path
    questions: dict[str, Path]  # split -> jsonl
    parquet: dict[str, Path]  # "train", "val", "test" and per-group splits ("train_1hop", "val_diagnosis") -> parquet
    index_dir: Path
    tokenizer_dir: Path
    model_dir: Path
    report: Path


def task_paths(root: str | Path, splits: tuple[str, ...], groups: tuple[str, ...]) -> EmbeddedPaths:
    """The layout under ``root``: ``world/``, ``data/{split}.parquet`` and ``data/{split}_{group}.parquet``, ..."""
    root = Path(root)
    parquet = {s: root / "data" / f"{s}.parquet" for s in splits}
    parquet.update({f"{s}_{g}": root / "data" / f"{s}_{g}.parquet" for s in splits for g in groups})
    return EmbeddedPaths(
        root=root, corpus=root / "world" / "corpus.jsonl",
        questions={s: root / "world" / f"{s}.jsonl" for s in splits},
        parquet=parquet, index_dir=root / "index", tokenizer_dir=root / "tokenizer",
        model_dir=root / "model", report=root / "report.json",
    )  # fmt: skip


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


def build_bm25_step(corpus: Path, progress: bool) -> Callable[[Path], None]:
    """A step that writes the BM25 index of ``corpus`` into the step's directory itself."""

    def build(tmp: Path) -> None:
        from sorl_verl.retrieval.build import build_index

        build_index(corpus, tmp / "bm25", overwrite=True, show_progress=progress)
        for f in (tmp / "bm25").iterdir():
            f.rename(tmp / f.name)
        (tmp / "bm25").rmdir()

    return build


def build_tokenizer_step(
    corpus: Path, prompts: Callable[[], list[str]], vocab_size: int, extra_tokens: Sequence[str] = ()
) -> Callable[[Path], None]:
    """A step that trains the tiny BPE tokenizer on the passages of ``corpus`` followed by ``prompts()``
    (``extra_tokens``: whole tokens added to it, :func:`~sorl_verl.embedded.tokenizer.train_tokenizer`)."""

    def build(tmp: Path) -> None:
        from sorl_verl.embedded.tokenizer import train_tokenizer
        from sorl_verl.embedded.world import read_jsonl

        texts = [d["contents"] for d in read_jsonl(corpus)] + prompts()
        train_tokenizer(texts, tmp, vocab_size=vocab_size, extra_tokens=extra_tokens)

    return build


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` for the duration (1 is fastest on a shared 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def record_build(paths: EmbeddedPaths, timings: dict[str, float]) -> None:
    """Merge the seconds of the steps just built and the model's ``warmstart.json`` into ``report.json``."""
    if not timings:
        return
    old = json.loads(paths.report.read_text()) if paths.report.is_file() else {}
    old.setdefault("build_seconds", {}).update(timings)
    ws = paths.model_dir / "warmstart.json"
    if ws.is_file():
        old["warmstart"] = json.loads(ws.read_text())
    paths.report.write_text(json.dumps(old, indent=1))


def named_warmstart(table: dict[str, float], name: str) -> float:
    """``table[name]``: the early-stop rate of a named warm-start, or ``ValueError`` listing the names."""
    if name not in table:
        raise ValueError(f"unknown warm-start {name!r}; choose from {sorted(table)}")
    return table[name]


def warmstart_root(base: str, table: dict[str, float], name: str) -> Path:
    """``data_home()/<base>`` for the ``expert`` warm-start, ``<base>-<name>`` for another name of
    ``table`` (``ValueError`` for a name not in it): each named warm-start is built under its own root."""
    from sorl_verl.paths import data_home

    named_warmstart(table, name)
    return data_home() / (base if name == "expert" else f"{base}-{name}")
