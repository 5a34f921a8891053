"""Corpus reading and the document store of an index directory.

Corpus format (Search-R1's wiki-18): JSON lines ``{"id": ..., "contents": "\\"Title\\"\\ntext"}``.
Rows with ``title`` + ``text`` instead of ``contents`` are accepted and converted to that form.
The index keeps a normalized copy (``docs.jsonl``) plus byte offsets (``doc_offsets.npy``), so a
document is read by position through a memory map without loading the corpus into RAM.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "doc_offsets.npy"


class CorpusFormatError(ValueError):
    """A corpus line is not a JSON object with ``contents`` (or ``title`` and ``text``)."""


def normalize_doc(row: dict[str, Any], line_no: int, where: str | None = None) -> dict[str, str]:
    """``{"id": str, "contents": str}`` from a corpus row; the id defaults to the 0-based line index.

    Errors name ``where`` (default ``corpus line <line_no + 1>``, 1-based as editors count).
    """
    where = where or f"corpus line {line_no + 1}"
    if "contents" in row:
        contents = row["contents"]
    elif "text" in row:
        title = row.get("title")
        contents = f'"{title}"\n{row["text"]}' if title else row["text"]
    else:
        raise CorpusFormatError(f"{where}: needs 'contents' (or 'title' and 'text'), got keys {sorted(row)}")
    if not isinstance(contents, str):
        raise CorpusFormatError(f"{where}: 'contents' must be a string")
    doc_id = str(row.get("id", row.get("_id", line_no)))
    for name, value in (("contents", contents), ("id", doc_id)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CorpusFormatError(
                f"{where}: '{name}' has a lone surrogate (an unpaired \\u{ord(value[e.start]):04x} escape) "
                f"at character {e.start}; fix or drop that line"
            ) from e
    return {"id": doc_id, "contents": contents}


def iter_corpus(path: str | Path, digest: Any | None = None, progress: Any | None = None) -> Iterator[dict[str, str]]:
    """Normalized documents of a JSON-lines corpus; feeds raw bytes to ``digest`` and ``progress``."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f):
            where = f"{path} line {line_no + 1}"
            if digest is not None:
                digest.update(raw)
            if progress is not None:
                progress.update(len(raw))
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except RecursionError as e:
                raise CorpusFormatError(f"{where}: invalid JSON (nested too deeply)") from e
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (not UTF-8), an over-long integer
                raise CorpusFormatError(f"{where}: invalid JSON ({str(e)[:200]})") from e
            if not isinstance(row, dict):
                raise CorpusFormatError(f"{where}: expected a JSON object")
            yield normalize_doc(row, line_no, where)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class DocWriter:
    """Appends normalized documents to ``docs.jsonl`` and records their byte offsets."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._f = open(out_dir / DOCS_FILE, "wb")  # noqa: SIM115 - closed in close()
        self._offsets = array("q", [0])  # 8 bytes per document (a list of ints would take ~36)

    def add(self, doc: dict[str, str]) -> None:
        line = json.dumps(doc, ensure_ascii=False).encode("utf-8") + b"\n"
        self._f.write(line)
        self._offsets.append(self._offsets[-1] + len(line))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def close(self) -> None:
        self._f.close()
        np.save(self.out_dir / OFFSETS_FILE, np.frombuffer(self._offsets, dtype=np.int64))


class DocStore:
    """Read-only, memory-mapped access to the documents of an index directory by position."""

    def __init__(self, index_dir: str | Path) -> None:
        index_dir = Path(index_dir)
        self.offsets = np.load(index_dir / OFFSETS_FILE)
        self._file = open(index_dir / DOCS_FILE, "rb")  # noqa: SIM115 - lives as long as the store
        size = int(self.offsets[-1])
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if len(self._mm) != size:
            raise ValueError(f"{index_dir / DOCS_FILE}: {len(self._mm)} bytes, offsets say {size}")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, str]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return json.loads(self._mm[start:end])
