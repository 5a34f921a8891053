"""What the FSDP gloo-rank tests share (test_algo_clip_bias_grad_fsdp, test_algo_loss_fsdp1).

Importable by name from the integration tests and from their ranks: ``conftest.py`` and the header
``gloo_ranks`` prepends to every rank script put this folder on ``sys.path`` (the test folders are no
packages, and pytest runs in ``importlib`` mode).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def load_path(path: str | Path, name: str | None = None) -> ModuleType:
    """The module at ``path`` (a test module: not importable by name), executed once per call."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(relative: str) -> ModuleType:
    """A test module by its path below ``tests/``."""
    return load_path(TESTS / relative)


#: the start of an FSDP rank script (``gloo_ranks(script, world, data_path, test_file)``: argv = rank, world,
#: port, data path, the test file): the test file as ``case``, the plugin's losses registered in verl (as
#: verl's import does in a worker), the gloo group joined, the actor's update-scaled optimizer held (a loss
#: with ``clip_norm_apply=update`` needs one alive; it never steps), the data loaded
RANK_PREAMBLE = """
import json, sys, warnings, torch, torch.distributed as dist
from _fsdp_ranks import load_path
case = load_path(sys.argv[5], "fsdp_case")
import sorl_verl.plugin
from sorl_verl.algorithms import optim
rank, world, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
actor_optimizer = optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
data = torch.load(path)
"""


def rank_script(body: str) -> str:
    """An FSDP rank script: :data:`RANK_PREAMBLE`, then ``body`` (which ends with ``finish(...)``)."""
    return RANK_PREAMBLE + body
