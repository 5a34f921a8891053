"""What the collapse guard's checkpoint costs: verl's own FSDP checkpoint save and load, and the guard's snapshot.

One process, ``torch.distributed`` world size 1 (nccl on cuda, gloo on cpu, on 127.0.0.1). A randomly
initialised Qwen2 of a named shape (``3b`` has Qwen2.5-3B's: 36 layers, hidden 2048, tied embeddings,
3.086 B parameters; ``tiny`` is for the CPU rehearsal) is built in float32 directly on the device (verl's
``model_dtype: fp32``), wrapped with FSDP2 by verl's ``apply_fsdp2`` with the engine's
``MixedPrecisionPolicy`` (bf16 compute, fp32 reduce), given the SORL actor's optimizer
(``sorl_verl.algorithms.optim.AdamW`` through verl's ``build_optimizer``) and verl's constant LR schedule,
and trained one real step so that the Adam moments exist. Then, with verl's ``FSDPCheckpointManager``
(default contents model, optimizer, extra; no processing class), timed with a device synchronize around each:

    save       save_checkpoint to <dir>/global_step_1/actor (what the trainer waits for: the page cache)
    sync       os.sync() right after it (the durable write)
    snapshot   the guard's best_step_1 snapshot (``sorl_verl.trainer.guard.link_tree``: hard links)
    load_warm  load_checkpoint from the snapshot after perturbing weights and optimizer state (page cache)
    load_cold  the same after ``echo 3 > /proc/sys/vm/drop_caches`` (root only; reported when refused)

After each load the parameters, the Adam moments and steps, and the scheduler are checked bit for bit against
CPU copies taken before the save (a mismatch exits non-zero). Reported: bytes per file and in all ``S``,
``P``, ``S/P``, each time and its GB/s (10^9 B), device peak memory, free disk and RAM. Before saving, free
disk and RAM are checked against ``12 P`` (plus a margin); if either is short the script refuses with exit
status 3 before building the model. The JSON (``--json-out``) is rewritten after every phase, so a run
cut short still leaves what it measured. The checkpoint folder is removed at the end (``--keep`` keeps it)::

    python3 scripts/bench/guard_checkpoint_cost.py --device cuda --model 3b --ckpt-dir /root/ckpt --json-out X
    nice -n 19 .venv/bin/python scripts/bench/guard_checkpoint_cost.py --device cpu --model tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import MixedPrecisionPolicy, apply_fsdp2
from verl.utils.torch_functional import get_constant_schedule_with_warmup
from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_in_step import MODELS, sync  # noqa: E402

from sorl_verl.trainer.guard import link_tree  # noqa: E402

#: Qwen2 shapes with tied input/output embeddings (as Qwen2.5-1.5B and -3B have them).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {**MODELS["tiny"], "tie_word_embeddings": True},
    "1.5b": {**MODELS["1.5b"], "tie_word_embeddings": True},
    "3b": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
}  # fmt: skip
#: bytes per parameter of the checkpoint: fp32 weights + AdamW's fp32 exp_avg and exp_avg_sq
BYTES_PER_PARAMETER = 12
#: exit status when the checkpoint would not fit on the disk or its reference copy in RAM
DOES_NOT_FIT = 3


def qwen2_config(name: str) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(**SHAPES[name], max_position_embeddings=32768)


def count_parameters(name: str) -> int:
    """``P``, a tied embedding counted once (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(qwen2_config(name), dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(device: str, fn: Callable[[], object]) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a (possibly DTensor) tensor: with one rank, all of it."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and every optimizer state tensor (Adam: ``step``, ``exp_avg``, ``exp_avg_sq``), by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        yield f"param/{n}", local(p.detach())
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                yield f"optim/{names[id(p)]}/{key}", local(value.detach())


def snapshot_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """CPU copies of :func:`state_tensors`."""
    return {name: t.to("cpu", copy=True) for name, t in state_tensors(model, optimizer)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def differing(reference: dict[str, torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              first: bool = False) -> list[str]:  # fmt: skip
    """Names whose bits differ from ``reference`` (or that one side lacks), one tensor at a time on the device;
    ``first``: stop at the first one."""
    bad, seen = [], set()
    for name, t in state_tensors(model, optimizer):
        seen.add(name)
        if name not in reference or not same_bits(reference[name].to(t.device), t):
            bad.append(name)
            if first:
                return bad
    return bad + sorted(reference.keys() - seen)


@torch.no_grad()
def perturb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Move every weight, moment and step away from the saved values (what a collapse's steps do)."""
    for p in model.parameters():
        p.add_(1.0)
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.is_floating_point():
                value.add_(1.0)


def files_bytes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def filesystem_of(path: Path) -> str:
    """``device type`` of the mount holding ``path`` (from /proc/mounts; '?' where unreadable)."""
    best, found = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, found = mount, f"{dev} {fstype} on {mount}"
    except OSError:
        pass
    return found


def drop_page_cache() -> str | None:
    """Drop the page cache (root); ``None`` on success, else why not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def init_distributed(device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    dist.init_process_group(backend=backend, rank=0, world_size=1)


def build_actor(name: str, device: str, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """fp32 Qwen2 on ``device``, FSDP2 as verl's FSDP engine applies it, the SORL AdamW, verl's LR schedule."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(qwen2_config(name), dtype=torch.float32)
    model.train()
    mesh = init_device_mesh(device.split(":")[0], mesh_shape=(1,), mesh_dim_names=("fsdp",))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    fsdp_kwargs = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": None, "reshard_after_forward": True}
    apply_fsdp2(model, fsdp_kwargs, {"wrap_policy": {}, "forward_prefetch": False})
    optim_config = FSDPOptimizerConfig(lr=lr, optimizer_impl="sorl_verl.algorithms.optim", optimizer="AdamW")
    optimizer = build_optimizer(model.parameters(), optim_config)
    scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0)
    return model, optimizer, scheduler


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, ids: torch.Tensor) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)  # as at a checkpoint between steps; also frees the gradients


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (nccl)")
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint root (default: a new folder in the temp dir)")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--no-cold", action="store_true", help="skip the load after dropping the page cache")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    device = a.device
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device {device}: torch.cuda.is_available() is False")
    root = Path(a.ckpt_dir) if a.ckpt_dir else Path(tempfile.mkdtemp(prefix="guard_ckpt_"))
    if root.exists() and any(root.iterdir()):
        ap.error(f"--ckpt-dir {root} is not empty")
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "command": " ".join(["python3", "scripts/bench/guard_checkpoint_cost.py", *(argv or sys.argv[1:])]),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": a.model,
        "shape": SHAPES[a.model],
        "ckpt_dir": str(root),
        "filesystem": filesystem_of(root),
        "seconds": {},
        "gb_per_s": {},
    }

    def write() -> None:
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(out, indent=1) + "\n")

    params = count_parameters(a.model)
    need = BYTES_PER_PARAMETER * params
    disk_free, ram_free = shutil.disk_usage(root).free, psutil.virtual_memory().available
    out.update(parameters=params, estimated_bytes=need, disk_free_before=disk_free, ram_available_before=ram_free)
    print(f"{a.model}: P = {params:,} parameters, checkpoint ~{need / 1e9:.2f} GB (12 P); free disk at {root} "
          f"({out['filesystem']}) {disk_free / 1e9:.2f} GB, available RAM {ram_free / 1e9:.2f} GB")  # fmt: skip
    short = [f"disk {disk_free / 1e9:.2f} GB free < {1.05 * need / 1e9:.2f} GB"] if disk_free < 1.05 * need else []
    if ram_free < 1.5 * need:  # the CPU reference copy (12 P) and torch.save's staging
        short.append(f"RAM {ram_free / 1e9:.2f} GB available < {1.5 * need / 1e9:.2f} GB")
    if short:
        out["refused"] = f"the {a.model} checkpoint would not fit: " + "; ".join(short)
        print(out["refused"])
        write()
        sys.exit(DOES_NOT_FIT)
    write()

    init_distributed(device)
    try:
        seconds = out["seconds"]
        start = time.perf_counter()
        model, optimizer, scheduler = build_actor(a.model, device, a.lr)
        sync(device)
        seconds["build"] = time.perf_counter() - start
        ids = torch.randint(0, SHAPES[a.model]["vocab_size"], (a.rows, a.length), device=device)
        seconds["train_step"] = timed(device, lambda: train_step(model, optimizer, scheduler, ids))
        if cuda:
            out["peak_memory_train_bytes"] = torch.cuda.max_memory_allocated()
        start = time.perf_counter()
        reference = snapshot_state(model, optimizer)
        seconds["reference_copy"] = time.perf_counter() - start
        reference_sched = scheduler.state_dict()
        print(f"built in {seconds['build']:.1f} s, one train step {seconds['train_step']:.2f} s, "
              f"CPU reference copy {seconds['reference_copy']:.1f} s")  # fmt: skip

        manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=scheduler, processing_class=None)
        step_dir = root / "global_step_1"
        actor_dir = step_dir / "actor"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds["save"] = timed(device, lambda: manager.save_checkpoint(local_path=str(actor_dir), global_step=1))
        if cuda:
            out["peak_memory_save_bytes"] = torch.cuda.max_memory_allocated()
        files = files_bytes(step_dir)
        total = sum(files.values())
        out.update(files=files, bytes=total, s_over_p=total / params, disk_free_after_save=shutil.disk_usage(root).free)
        out["gb_per_s"]["save"] = gb_per_s(total, seconds["save"])
        write()
        print(f"save_checkpoint {seconds['save']:.2f} s ({out['gb_per_s']['save']:.2f} GB/s), S = {total:,} B")

        start = time.perf_counter()
        os.sync()
        seconds["sync"] = time.perf_counter() - start
        out["gb_per_s"]["sync"] = gb_per_s(total, seconds["sync"])
        write()
        print(f"os.sync {seconds['sync']:.2f} s")

        best = root / "sorl_guard" / "best_step_1"
        tmp = best.with_name(best.name + ".tmp")

        def snapshot() -> None:  # the guard's _keep_best, without the trainer around it
            tmp.mkdir(parents=True)
            link_tree(actor_dir, tmp / "actor")
            os.replace(tmp, best)

        seconds["snapshot"] = timed("cpu", snapshot)
        out["snapshot_hard_linked"] = all(p.stat().st_nlink > 1 for p in (best / "actor").rglob("*") if p.is_file())
        write()
        print(f"best_step snapshot {seconds['snapshot'] * 1e3:.2f} ms (hard links: {out['snapshot_hard_linked']})")

        verified: dict[str, bool] = {}
        out["verified_bit_for_bit"] = verified

        def load(tag: str) -> None:
            perturb(model, optimizer)
            scheduler.step()
            if not differing(reference, model, optimizer, first=True) or scheduler.state_dict() == reference_sched:
                raise SystemExit(f"{tag}: the perturbation changed nothing; the check would prove nothing")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            seconds[tag] = timed(device, lambda: manager.load_checkpoint(local_path=str(best / "actor")))
            out["gb_per_s"][tag] = gb_per_s(total, seconds[tag])
            if cuda:
                out[f"peak_memory_{tag}_bytes"] = torch.cuda.max_memory_allocated()
            bad = differing(reference, model, optimizer)
            verified[tag] = not bad and scheduler.state_dict() == reference_sched
            write()
            print(f"{tag} {seconds[tag]:.2f} s ({out['gb_per_s'][tag]:.2f} GB/s); restored bit for bit: {verified[tag]}"
                  + (f" (differ: {bad[:5]})" if bad else ""))  # fmt: skip

        load("load_warm")
        if a.no_cold:
            out["cold"] = "skipped (--no-cold)"
        else:
            refused = drop_page_cache()
            out["cold"] = f"drop_caches refused: {refused}" if refused else "page cache dropped"
            print(out["cold"])
            if not refused:
                load("load_cold")
        out["ram_available_end"] = psutil.virtual_memory().available
    finally:
        dist.destroy_process_group()
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    peaks = [v for k, v in out.items() if k.startswith("peak_memory_")]
    if peaks:
        out["peak_memory_max_bytes"] = max(peaks)
    write()

    rows = [(name, seconds[name], out["gb_per_s"].get(name)) for name in seconds]
    print(f"\n{a.model} on {out['device']}: P = {params:,}, S = {total:,} B ({total / 1e9:.2f} GB), S/P = "
          f"{total / params:.3f}")  # fmt: skip
    for name, size in files.items():
        print(f"  {name:45s} {size:>16,} B")
    print(f"{'phase':15s} {'seconds':>9s} {'GB/s':>7s}")
    for name, secs, rate in rows:
        print(f"{name:15s} {secs:9.3f} {'' if rate is None else f'{rate:7.2f}'}")
    if cuda:
        print(f"device peak memory {out['peak_memory_max_bytes'] / 2**30:.1f} GiB (allocated by torch)")
    if not all(verified.values()):
        raise SystemExit("restored state differs from the saved one")
    return out


if __name__ == "__main__":
    main()
