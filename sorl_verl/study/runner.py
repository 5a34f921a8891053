"""Run the cells of a grid: one verl ``main_ppo`` process per cell, the way ``scripts/demo.sh`` runs it.

Per study invocation: the embedded default of the grid's task (``task: search_qa | medical_mcq``,
built on first use, the model aliased for ChatML: :func:`sorl_verl.embedded.demo_paths.embedded_task`,
the paths ``scripts/demo.sh --task qa|medical`` uses) and one retrieval server over that task's corpus
(``python -m sorl_verl.retrieval.server --index ... --port 0 --port-file ...``) shared by the cells.
Per cell, under the shared heavy-job lock (``flock`` on ``/tmp/sorl-heavy.lock``, taken per cell
so other heavy jobs can interleave)::

    VERL_PLATFORM=cpu VERL_FILE_LOGGER_PATH=<cell>/metrics.jsonl python -m verl.trainer.main_ppo \\
        --config-path <grid config_dir> --config-name sorl_trainer +task=<grid task> +platform=cpu \\
        data.train_files=... data.val_files=... actor_rollout_ref.model.path=... \\
        sorl.agent.retrieval_url=... trainer.experiment_name=... trainer.default_local_dir=... <cell overrides>

Run directory ``<out>/<regime>/<algorithm>/seed<k>/``: ``metrics.jsonl``, ``train.log`` and
``cell.json`` (command, overrides, status, exit code, wall time, last log lines). Status
``done`` (exit 0 and every step logged) is the completed marker: such a cell is skipped.
``failed`` is recorded and the grid goes on (re-run with ``retry_failed``). A finished cell
whose overrides (or task) differ from the grid's now is ``changed``: skipped and reported unless
``rerun_changed``. A cell found
``running`` or ``interrupted`` was cut off: it is restarted from scratch.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from sorl_verl.study.grid import DEFAULT_TASK, DEFAULT_WARMSTART, EMBEDDED_TASK, Cell, Grid
from sorl_verl.study.metrics import Trace, read_trace
from sorl_verl.study.pinned_warmstart import check_built, model_digest, pinned_model

DEFAULT_LOCK = "/tmp/sorl-heavy.lock"
RECORD = "cell.json"
METRICS = "metrics.jsonl"
LOG = "train.log"
#: the cell's ``trainer.default_local_dir`` (verl's checkpoints, the collapse guard's ``sorl_guard/``)
CHECKPOINTS = "checkpoints"
#: what a restarted cell removes from its directory
RUN_OUTPUTS = (METRICS, LOG, CHECKPOINTS, "outputs")
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class Inputs:
    """The embedded default's files and the retrieval endpoint shared by every cell."""

    train: Path | str  # one parquet or a hydra list of them
    val: Path
    model: Path
    retrieval_url: str


def cpu_name() -> str:
    """The CPU model name and its widest vector extension (from /proc/cpuinfo; '' if unreadable)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    ext = "avx512" if " avx512f" in info else "avx2" if " avx2" in info else ""
    return f"{name} ({ext})" if ext else name


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / cell.regime / cell.algorithm / f"seed{cell.seed}"


def read_record(directory: Path) -> dict[str, Any]:
    """The cell's ``cell.json`` ({} when absent or unreadable: the cell is pending)."""
    try:
        return json.loads((directory / RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_record(directory: Path, record: dict[str, Any]) -> None:
    """Atomically replace ``cell.json`` (never half-written)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(directory / RECORD)


def cell_command(grid: Grid, cell: Cell, inputs: Inputs, directory: Path) -> list[str]:
    """The exact ``main_ppo`` command of a cell (cell overrides win over the base ones)."""
    base = {
        "data.train_files": str(inputs.train),
        "data.val_files": str(inputs.val),
        "actor_rollout_ref.model.path": str(inputs.model),
        "sorl.agent.retrieval_url": inputs.retrieval_url,
        "trainer.experiment_name": f"{grid.name}-{cell.regime}-{cell.algorithm}-seed{cell.seed}",
        "trainer.default_local_dir": str(directory / CHECKPOINTS),
    }
    overrides = {**base, **cell.overrides}
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(grid.config_dir),
        "--config-name",
        "sorl_trainer",
        f"+task={cell.task}",
        "+platform=cpu",
        *[f"{k}={v}" for k, v in overrides.items()],
    ]


def cell_env(directory: Path) -> dict[str, str]:
    """The environment scripts/demo.sh gives main_ppo, with the cell's metrics file."""
    return {
        "VERL_PLATFORM": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "VERL_FILE_LOGGER_PATH": str(directory / METRICS),
    }


def default_timeout_s(grid: Grid, cell: Cell | None = None) -> float:
    """Generous wall limit of one cell: 10 min of start-up slack + 1 min per step and per validation, over
    the cell's steps and validations (step 0 and every ``test_freq`` steps; its regime's ``steps`` and
    ``test_freq``, else the grid's; the grid's without a cell)."""
    steps = grid.steps if cell is None else grid.steps_of(cell)
    test_freq = grid.test_freq if cell is None else grid.test_freq_of(cell)
    return 600.0 + 60.0 * steps + 60.0 * (1 + steps // test_freq)


# --- locks ----------------------------------------------------------------------------------


@contextlib.contextmanager
def flocked(path: str | None, wait_note: Callable[[], None] | None = None) -> Iterator[tuple[int, ...]]:
    """Hold an exclusive ``flock(2)`` on ``path`` (the lock ``flock(1)`` takes); no-op for None.

    Yields the lock's file descriptor (empty for None): a child given it (``pass_fds``) shares
    the lock, which then lasts while the child lives even if this process dies.
    """
    if not path:
        yield ()
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if wait_note:
                wait_note()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield (fd,)
    finally:
        os.close(fd)


class StudyBusy(RuntimeError):
    """Another study process holds the output directory."""


@contextlib.contextmanager
def study_lock(out: Path) -> Iterator[None]:
    """Exclusive ownership of ``out`` (``<out>/.study.lock``), so two runs never share a cell."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / ".study.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StudyBusy(f"another study process is running on {out}") from None
        yield
    finally:
        os.close(fd)


def study_running(out: Path) -> bool:
    """True while some process holds ``<out>/.study.lock``."""
    if not (out / ".study.lock").exists():
        return False
    fd = os.open(out / ".study.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# --- one cell -------------------------------------------------------------------------------


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _log_tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.strip()][-n:]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def progress_line(tag: str, step: int, steps: int, trace: Trace, elapsed: float) -> str:
    """``[study i/n key] step s/S  val v (@step)  reward r  Z z  elapsed t s``."""
    m = trace.train.get(step, {})
    vals = trace.val_scores
    val = f"val {vals[-1][1]:.3f} (@{vals[-1][0]})" if vals else "val -"
    parts = [f"{tag} step {step}/{steps}", val, f"reward {_fmt(m.get('critic/score/mean'))}"]
    if "actor/sorl/norm_factor" in m:
        parts.append(f"Z {_fmt(m['actor/sorl/norm_factor'])}")
    if "actor/ppo_kl" in m:
        parts.append(f"kl {m['actor/ppo_kl']:.2g}")
    parts.append(f"elapsed {elapsed:.0f} s")
    return "  ".join(parts)


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM then SIGKILL to the process group main_ppo leads (its Ray processes included)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_cell(
    grid: Grid,
    cell: Cell,
    directory: Path,
    inputs: Inputs,
    *,
    tag: str,
    timeout_s: float,
    out: TextIO = sys.stdout,
    poll_s: float = 2.0,
    pass_fds: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Run one cell from scratch in ``directory``; returns (and writes) its final record.

    ``pass_fds``: descriptors main_ppo inherits (the heavy-job lock, so that it stays held by a
    main_ppo orphaned by a killed runner).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name in RUN_OUTPUTS:
        p = directory / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    cmd = cell_command(grid, cell, inputs, directory)
    env_add = cell_env(directory)
    steps = grid.steps_of(cell)
    record: dict[str, Any] = {
        "grid": grid.name,
        "grid_file": str(grid.path),
        "key": cell.key,
        "regime": cell.regime,
        "algorithm": cell.algorithm,
        "seed": cell.seed,
        "task": cell.task,
        "warmstart": cell.warmstart,
        "steps": steps,
        "overrides": dict(cell.overrides),
        "command": cmd,
        "command_line": " ".join(f"{k}={shlex.quote(v)}" for k, v in env_add.items()) + " " + shlex.join(cmd),
        "env": env_add,
        "status": "running",
        "started": _now(),
        "host": os.uname().nodename,
        "cpu": cpu_name(),
        "model_digest": model_digest(inputs.model),
        "runner_pid": os.getpid(),
    }
    write_record(directory, record)
    t0 = time.monotonic()
    seen_step, seen_vals = 0, 0
    exit_code: int | None = None
    reason = ""
    with open(directory / LOG, "wb") as log:
        # cwd: hydra's outputs/<date>/<time> and anything else main_ppo writes stay in the run directory
        proc = subprocess.Popen(
            cmd,
            cwd=directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env_add},
            start_new_session=True,
            pass_fds=pass_fds,
        )
        record["pid"] = proc.pid
        write_record(directory, record)
        try:
            while True:
                exit_code = proc.poll()
                trace = read_trace(directory / METRICS)
                elapsed = time.monotonic() - t0
                if len(trace.val_scores) > seen_vals or trace.last_step > seen_step:
                    seen_vals, seen_step = len(trace.val_scores), trace.last_step
                    print(progress_line(tag, seen_step, steps, trace, elapsed), file=out, flush=True)
                if exit_code is not None:
                    break
                if elapsed > timeout_s:
                    reason = f"timed out after {timeout_s:.0f} s"
                    _stop_group(proc)
                    exit_code = proc.returncode
                    break
                time.sleep(poll_s)
        except BaseException:
            _stop_group(proc)
            record.update(status="interrupted", exit_code=proc.returncode, wall_s=round(time.monotonic() - t0, 1))
            write_record(directory, record)
            raise
    # leftovers of main_ppo's session (a Ray process that outlived the driver) would hold memory
    # after the lock is released; they are ours: same process group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    trace = read_trace(directory / METRICS)
    wall = time.monotonic() - t0
    complete = exit_code == 0 and trace.last_step >= steps
    if exit_code == 0 and not complete:
        reason = f"exited 0 after step {trace.last_step} of {steps}"
    elif exit_code != 0 and not reason:
        reason = f"main_ppo exited with code {exit_code}"
    record.update(
        status="done" if complete else "failed",
        finished=_now(),
        wall_s=round(wall, 1),
        exit_code=exit_code,
        steps_done=trace.last_step,
        reason=reason,
        log_tail=[] if complete else _log_tail(directory / LOG),
    )
    write_record(directory, record)
    return record


# --- the grid -------------------------------------------------------------------------------


#: override keys a grid's cell may set that a finished run's record may lack, with the value such a run
#: ran: the default when it ran. ``sorl.guard.rule``: ``drop`` until natural.yaml's question 5 made the
#: guard's default ``stderr`` (presets.yaml's guarded arms then wrote ``drop`` out)
RAN_DEFAULTS: dict[str, Any] = {"sorl.guard.rule": "drop"}


def changed_keys(record: dict[str, Any], cell: Cell) -> list[str]:
    """Override keys whose value in the recorded run differs from the grid's cell now (``task`` / ``warmstart``
    when those do; a record without one ran the default). A key of :data:`RAN_DEFAULTS` that the cell sets
    and the record lacks ran that default (a cell that does not set it is compared as before)."""
    ran = record.get("overrides")
    if not isinstance(ran, dict):
        return []
    now = dict(cell.overrides)
    ran = {**{k: v for k, v in RAN_DEFAULTS.items() if k in now}, **ran}
    keys = sorted(k for k in set(ran) | set(now) if ran.get(k) != now.get(k))
    grid_level = [("task", DEFAULT_TASK, cell.task), ("warmstart", DEFAULT_WARMSTART, cell.warmstart)]
    return [name for name, default, value in grid_level if record.get(name, default) != value] + keys


def cell_state(out: Path, cell: Cell, live: bool = False) -> str:
    """done | failed | changed | unfilled | pending | running | interrupted.

    ``changed``: finished (done or failed) with overrides that differ from the grid's now (the
    grid was edited since); ``running`` only when ``live`` (a study process holds ``out``).
    """
    record = read_record(cell_dir(out, cell))
    status = record.get("status")
    if status in ("done", "failed"):
        return "changed" if changed_keys(record, cell) else status
    if cell.unfilled:
        return "unfilled"
    if status in ("running", "interrupted"):
        return "running" if (live and status == "running") else "interrupted"
    return "pending"


def prepare_inputs(
    log: TextIO,
    task: str = DEFAULT_TASK,
    warmstart: str = DEFAULT_WARMSTART,
    pin: Path | None = None,
    digest: str | None = None,
) -> tuple[Inputs, Any]:
    """Build/load the embedded default of ``task`` from ``warmstart`` and start the retrieval server over its
    corpus (call it under the heavy lock). With ``pin`` (the grid's ``warmstart_pin``) the runs load that
    pinned warm-start instead of this machine's build (:mod:`sorl_verl.study.pinned_warmstart`); with
    ``digest`` (the grid's ``warmstart_digest``) a build of other weights is refused.

    Returns the inputs and the server (``.stop()`` it when done).
    """
    from sorl_verl.embedded.demo_paths import embedded_task
    from sorl_verl.retrieval.server import serve_in_background

    built = embedded_task(EMBEDDED_TASK[task], warmstart=warmstart)
    if built.overlay != task:
        raise ValueError(f"embedded default of {task!r} runs the overlay {built.overlay!r}")
    model = built.model
    if digest is not None:
        check_built(built.model, digest)
    if pin is not None:
        model = pinned_model(pin, built.model.parent)
        print(f"[study] pinned warm-start {model} (built here: {model_digest(built.model)})", file=log, flush=True)
    server = serve_in_background(built.index_dir, subprocess_mode=True)
    print(f"[study] task {task}: retrieval server {server.retrieve_url} (pid {server.pid})", file=log, flush=True)
    return Inputs(train=built.train, val=built.val, model=model, retrieval_url=server.retrieve_url), server


def cell_inputs(cell: Cell, inputs: Inputs, log: TextIO) -> Inputs:
    """The grid's inputs, with the model of the cell's regime's own pinned warm-start when it has one
    (unpacked once next to the grid's model folder and checked by digest, :func:`pinned_model`)."""
    if cell.warmstart_pin is None:
        return inputs
    model = pinned_model(cell.warmstart_pin, inputs.model.parent)
    print(f"[study] {cell.key}: the regime's own pinned warm-start {cell.warmstart} at {model}", file=log, flush=True)
    return replace(inputs, model=model)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM / SIGHUP raise SystemExit (128 + signal) in the main thread, so cleanup runs:
    the running cell's process group is stopped and the cell recorded as interrupted."""

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_grid(
    grid: Grid,
    out: Path,
    cells: Sequence[Cell],
    *,
    lock: str | None = DEFAULT_LOCK,
    retry_failed: bool = False,
    rerun_changed: bool = False,
    timeout_s: float | None = None,
    log: TextIO = sys.stdout,
    inputs: Inputs | None = None,
) -> dict[str, int]:
    """Run ``cells`` in order (done ones skipped); counts of the final states of these cells.

    ``timeout_s``: the wall limit of every cell (default: each cell's :func:`default_timeout_s`).
    ``inputs``: give them to skip the embedded default and the server (tests); by default they
    are prepared under the lock of the first cell that has to run, and the server is stopped at
    the end.
    """
    counts = {"done": 0, "failed": 0, "unfilled": 0, "changed": 0, "ran": 0}
    server = None
    n = len(cells)
    with study_lock(out), _terminate_as_exit():
        try:
            for i, cell in enumerate(cells, 1):
                tag = f"[study {i}/{n} {cell.key}]"
                state = cell_state(out, cell)
                if state == "done" or (state == "failed" and not retry_failed):
                    counts[state] += 1
                    rec = read_record(cell_dir(out, cell))
                    extra = "" if state == "done" else f": {rec.get('reason', '')} (--retry-failed re-runs it)"
                    print(f"{tag} {state}, skipped{extra}", file=log, flush=True)
                    continue
                if state == "changed" and not rerun_changed:
                    counts["changed"] += 1
                    keys = changed_keys(read_record(cell_dir(out, cell)), cell)
                    print(f"{tag} skipped: ran with other {', '.join(keys)} (--rerun-changed)", file=log, flush=True)
                    continue
                if state == "unfilled":
                    counts["unfilled"] += 1
                    print(f"{tag} skipped: {', '.join(cell.unfilled)} still '???' in the grid", file=log, flush=True)
                    continue
                if state == "interrupted":
                    print(f"{tag} was interrupted: restarting from scratch", file=log, flush=True)
                waiting = f"{tag} waiting for {lock}"
                with flocked(lock, lambda msg=waiting: print(msg, file=log, flush=True)) as fds:
                    if inputs is None:  # first cell to run: embedded default (built on first use) + server
                        inputs, server = prepare_inputs(
                            log, grid.task, grid.warmstart, grid.warmstart_pin, grid.warmstart_digest
                        )
                    print(f"{tag} start ({grid.steps_of(cell)} steps)", file=log, flush=True)
                    directory = cell_dir(out, cell)
                    limit = timeout_s or default_timeout_s(grid, cell)
                    rec = run_cell(
                        grid, cell, directory, cell_inputs(cell, inputs, log), tag=tag, timeout_s=limit, out=log,
                        pass_fds=fds,
                    )  # fmt: skip
                counts["ran"] += 1
                counts[rec["status"]] += 1
                print(_finished_line(tag, rec, cell_dir(out, cell)), file=log, flush=True)
        finally:
            if server is not None:
                server.stop()
    return counts


def _finished_line(tag: str, rec: dict[str, Any], directory: Path) -> str:
    from sorl_verl.study.collapse import judge

    trace = read_trace(directory / METRICS)
    v = judge(trace.val_scores, trace.first_nonfinite(), rec.get("exit_code"), trace.last_step)
    vals = trace.val_scores
    score = (
        f"val {vals[0][1]:.3f} -> {vals[-1][1]:.3f} (peak {max(s for _, s in vals):.3f})" if vals else "no validation"
    )
    verdict = ("COLLAPSED: " + v.reason) if v.collapsed else ("not judged: " + v.reason if not v.judged else "stable")
    if trace.task not in (None, rec.get("task", DEFAULT_TASK)):
        verdict += f"; validated on {trace.task} data sources, not {rec.get('task', DEFAULT_TASK)}'s"
    if rec["status"] == "done":
        return f"{tag} done in {rec['wall_s']:.0f} s: {score}; {verdict}"
    return f"{tag} FAILED in {rec['wall_s']:.0f} s ({rec['reason']}; see {directory / LOG}): {score}; {verdict}"
