"""Fixtures shared by the integration tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

#: this folder, on sys.path here and in every gloo rank, for the helpers the rank tests share (_fsdp_ranks.py)
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

#: prepended to every gloo rank script (with this folder on its sys.path); the script ends with ``finish("RESULT" + json.dumps(...))``:
#: a barrier (every rank is past its last collective), the result line flushed, then ``os._exit(0)``.
#: Tearing gloo down (``destroy_process_group`` or interpreter exit) can abort a rank with "terminate
#: called without an active exception" after the work is done; the result is what the tests check,
#: so the ranks leave without that teardown.
GLOO_FINISH = f"""
import os as _os, sys as _sys, torch.distributed as _dist
_sys.path.insert(0, {HERE!r})
def finish(line):
    _dist.barrier()
    print(line, flush=True)
    _sys.stderr.flush()
    _os._exit(0)
"""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gloo_ranks() -> Callable[..., list[dict]]:
    """``run(script, world, *args)``: ``script`` (after :data:`GLOO_FINISH`) in ``world`` fresh
    interpreters at once, rank ``r`` with ``sys.argv[1:] = [r, world, port, *args]`` (a test module
    cannot be pickled by name, so each rank runs code, not a function); returns each rank's
    ``RESULT`` JSON, by rank. A rank that fails fails the test with its stderr."""

    def run(script: str, world: int, *args: str) -> list[dict]:
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", GLOO_FINISH + script, str(rank), str(world), port, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(world)
        ]
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.split("RESULT", 1)[1]))
        return results

    return run
