#!/usr/bin/env python
"""Fetching a batch's top-k passages from an index's document store, from a cold page cache.

The document store (``docs.jsonl`` + offsets, read through a memory map) of a large index does
not stay in the page cache beside the postings. This measures, per query, the wall and CPU time
of reading its top-k documents in batches of ``--batch`` queries, each mode starting from a cold
cache for ``docs.jsonl`` (the mapping is closed and ``POSIX_FADV_DONTNEED`` drops its pages):

- ``readahead``: the kernel's default advice (what the store did before ``MADV_RANDOM``);
- ``random``: ``MADV_RANDOM``, so a fault reads only its page (``DocStore.__getitem__``);
- ``random+willneed``: also ``MADV_WILLNEED`` on every document of the batch first
  (``DocStore.get_many``, what the server's search does).

The documents are the top-k rows saved by ``retrieval_scale.py --scoring-only --topk-out``:

    python scripts/bench/docstore_fetch.py --index /tmp/rscale/n21015324/index --rows top21_numpy.json \
        --json-out /tmp/docstore_fetch_21m.json   # measured: docs/results/bench/docstore_fetch.json, run '21m'
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

from sorl_verl.retrieval.corpus import DOCS_FILE, DocStore


def fetch_cold(index: Path, positions: list[list[int]], mode: str) -> dict[str, float]:
    """Wall and CPU ms of reading ``positions`` (batches of document positions) through a fresh ``DocStore``."""
    with open(index / DOCS_FILE, "rb") as f:  # no map of this process holds the file's pages now
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    time.sleep(0.5)
    store = DocStore(index)  # maps the file advised MADV_RANDOM
    if mode == "readahead":
        store._mm.madvise(mmap.MADV_NORMAL)  # back to the kernel's default: the store as it was
    w0, c0 = time.perf_counter(), time.process_time()
    for batch in positions:
        if mode == "random+willneed":
            store.get_many(batch)
        else:
            for p in batch:
                store[p]
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    store._mm.close()
    store._file.close()
    return {"wall_ms": 1000 * wall, "cpu_ms": 1000 * cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--index", required=True, help="index directory (docs.jsonl, doc_offsets.npy)")
    ap.add_argument("--rows", required=True, help="top-k rows: JSON list of [[position, score], ...] per query")
    ap.add_argument("--batch", type=int, default=256, help="queries per batch (one server request)")
    ap.add_argument("--rounds", type=int, default=2, help="times each mode runs (interleaved)")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    rows = json.loads(Path(a.rows).read_text())
    positions = [[int(p) for row in rows[s : s + a.batch] for p, _ in row] for s in range(0, len(rows), a.batch)]
    res: dict[str, Any] = {"command": " ".join(sys.argv), "queries": len(rows), "batch": a.batch,
                           "loadavg_start": os.getloadavg(), "runs": []}  # fmt: skip
    for r in range(a.rounds):
        for mode in ("readahead", "random", "random+willneed"):
            t = fetch_cold(Path(a.index), positions, mode)
            row = {"round": r, "mode": mode, "wall_ms_per_query": t["wall_ms"] / len(rows),
                   "cpu_ms_per_query": t["cpu_ms"] / len(rows)}  # fmt: skip
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
    res["loadavg_end"] = os.getloadavg()
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
