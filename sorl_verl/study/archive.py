"""A study grid's finished runs in one compressed file: what the repository keeps of a study.

The archive is a tar file compressed with xz. It holds, for every finished cell (``done`` or
``failed``), the run directory's ``cell.json`` and ``metrics.jsonl`` byte for byte, and the collapse
guard's event log ``checkpoints/sorl_guard/events.jsonl`` where the run had the guard on (one JSON
line per new best, restore and stop: at most ``steps / test_freq + max_restores + 1`` lines of a few
hundred bytes), at ``<regime>/<algorithm>/seed<k>/<file>`` -- the run directory layout, so
``tar -xJf <archive> -C $SORL_HOME/study/<grid>`` restores the cells for ``study run`` to skip
and ``study aggregate`` to read. Train logs, checkpoints and ``sorl_updates.jsonl`` stay in the
run directory. Members are sorted by key, with mtime 0, owner 0 and mode 0644, so archiving the
same runs twice writes the same bytes. :func:`read_archive` returns what
:func:`~sorl_verl.study.aggregate.collect` returns for the run directory, in the same order, so
``aggregate`` regenerates the same tables from either.
"""

from __future__ import annotations

import io
import json
import lzma
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from sorl_verl.study.metrics import Trace, parse_records
from sorl_verl.study.runner import CHECKPOINTS, METRICS, RECORD, read_record

#: the collapse guard's event log in a run directory (``sorl_verl.trainer.guard.GUARD_DIR`` under the
#: cell's ``trainer.default_local_dir``)
GUARD_EVENTS = f"{CHECKPOINTS}/sorl_guard/events.jsonl"
#: the files of a run directory an archive keeps (each where it exists)
ARCHIVED = (RECORD, METRICS, GUARD_EVENTS)
FINISHED = ("done", "failed")
_MEMBER = re.compile(rf"^(?P<key>[^/]+/[^/]+/seed\d+)/(?P<file>{'|'.join(re.escape(f) for f in ARCHIVED)})$")


class ArchiveError(ValueError):
    """An archive that cannot be written or read (the message names the file)."""


def default_archive(results: Path, grid_name: str) -> Path:
    """Where the repository keeps a grid's archive: ``<results>/study/<grid name>.tar.xz``."""
    return results / "study" / f"{grid_name}.tar.xz"


def _key_order(key: str) -> PurePosixPath:
    """Sort key of a cell: path order, as :func:`~sorl_verl.study.aggregate.cell_dirs` sorts run directories."""
    return PurePosixPath(key)


def finished_runs(out: Path, keys: Iterable[str] | None = None) -> dict[str, Path]:
    """Cell key -> run directory of every finished cell under ``out`` (only ``keys`` when given)."""
    wanted = None if keys is None else set(keys)
    found = {}
    for record in out.glob(f"*/*/seed*/{RECORD}"):
        rec = read_record(record.parent)
        key = rec.get("key")
        if rec.get("status") in FINISHED and isinstance(key, str) and (wanted is None or key in wanted):
            found[key] = record.parent
    return dict(sorted(found.items(), key=lambda kv: _key_order(kv[0])))


def write_archive(out: Path, path: Path, keys: Iterable[str] | None = None) -> list[str]:
    """Write the finished runs under ``out`` (only ``keys`` when given) to ``path``; returns their keys.

    Replaces ``path`` atomically; raises :class:`ArchiveError` when no run is finished.
    """
    runs = finished_runs(out, keys)
    if not runs:
        raise ArchiveError(f"no finished run under {out} to archive into {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w:xz", preset=9 | lzma.PRESET_EXTREME, format=tarfile.GNU_FORMAT) as tar:
        for key, directory in runs.items():
            for name in ARCHIVED:
                file = directory / name
                if not file.is_file():
                    continue
                data = file.read_bytes()
                info = tarfile.TarInfo(f"{key}/{name}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)
    return list(runs)


def read_archive(path: Path, keys: Iterable[str] | None = None) -> list[tuple[dict[str, Any], Trace]]:
    """(cell record, trace) of every finished run in the archive (only ``keys`` when given), key order.

    A member outside the run layout, or a ``cell.json`` that is not a JSON object, is an
    :class:`ArchiveError` naming the archive and the member.
    """
    wanted = None if keys is None else set(keys)
    files: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path, "r:xz") as tar:
            for member in tar:
                if member.isdir():
                    continue
                m = _MEMBER.match(member.name)
                handle = tar.extractfile(member) if member.isfile() else None
                if m is None or handle is None:
                    raise ArchiveError(
                        f"{path}: {member.name!r} is not <regime>/<algorithm>/seed<k>/{'|'.join(ARCHIVED)}"
                    )
                files.setdefault(m.group("key"), {})[m.group("file")] = handle.read()
    except (tarfile.TarError, lzma.LZMAError, EOFError) as exc:
        raise ArchiveError(f"{path}: not a readable .tar.xz study archive ({exc})") from exc
    found = []
    for key in sorted(files, key=_key_order):
        if RECORD not in files[key]:
            raise ArchiveError(f"{path}: {key} has {METRICS} but no {RECORD}")
        try:
            rec = json.loads(files[key][RECORD])
        except json.JSONDecodeError as exc:
            raise ArchiveError(f"{path}: {key}/{RECORD} is not JSON ({exc})") from exc
        if not isinstance(rec, dict):
            raise ArchiveError(f"{path}: {key}/{RECORD} is not a JSON object")
        if rec.get("status") not in FINISHED or (wanted is not None and rec.get("key") not in wanted):
            continue
        text = files[key].get(METRICS, b"").decode(errors="replace")
        found.append((rec, parse_records(text.splitlines())))
    return found
