"""The collapse guard inside the SORL trainers: keep the best checkpoint, restore it on a collapse.

The rule is :mod:`sorl_verl.trainer.guard_rule`; this module is its glue to verl's v1
``PPOTrainer`` (a mixin of the three SORL trainers). Off unless ``sorl.guard.enable=true``.

- **Observation**: verl merges a validation's metrics into the step's metrics before
  ``_compute_metrics``; the mixin reads the validation score (and the warning metric) there,
  after the step's update, checkpoint save and weight sync.
- **Validation records**: every validation, with the guard on or off, adds each source's number
  of questions and the variance of their scores (``val-aux/<source>/<var>/questions``,
  ``.../question_var``), which rule ``stderr`` reads; metrics only, nothing trained changes.
- **Best checkpoint**: a validation that sets a new best gets a checkpoint of that step (verl's own
  ``_save_checkpoint``, skipped when ``trainer.save_freq`` already saved this step), and its
  files are hard-linked into ``<trainer.default_local_dir>/sorl_guard/best_step_<s>`` so that
  ``max_actor_ckpt_to_keep`` rotation cannot delete it (no extra disk where hard links work;
  a copy otherwise, file by file: :func:`link_or_copy`). The new best enters the guard's state
  (and ``sorl_guard.json``) only once its snapshot is complete; the previous snapshot is removed
  after that, so at most one snapshot is kept (two while one is replaced).
- **Restore**: actor (weights, optimizer, LR scheduler, RNG), critic, and the train dataloader's
  position are loaded from that snapshot; the backed-off scales are applied; the rollout
  replicas get the restored weights (sync: the colocated replicas; colocate_async: same, and
  generation resumes; separate_async: the standalone replicas, and the hybrid ones when lent out);
  in the asynchronous modes the collapsed policy's queued rows are dropped and its in-flight
  prompts dropped when they finish (:mod:`sorl_verl.trainer.guard_sampler`), and the prefetch
  window is refilled with fresh prompts; then a checkpoint of the restored state is saved at the
  current step, so a kill after a restore resumes from it. verl's ``global_steps`` keeps counting
  (logs stay monotonic); the LR scheduler is restored with the rest (its position is the best
  step's: a schedule that decays over ``total_training_steps`` does not reach its last
  ``current - best`` steps per restore; docs/guard.md).
- **State**: :class:`~sorl_verl.trainer.guard_rule.GuardState` is written into every checkpoint
  folder as ``sorl_guard.json`` and read back on verl's resume, so restores and scales survive a
  kill; a best snapshot that is missing then falls back to the newest complete one. Events (new best, restore, stop, with reasons and seconds) go to
  ``sorl_guard/events.jsonl``.
- **Scales**: the learning rate (``state.lr_scale`` x the fault injection's factor of the step)
  and ``clip_norm_tau`` (``state.tau_scale`` x the configured value) are set inside the actor
  workers through Ray's ``__ray_call__`` (:mod:`sorl_verl.trainer.guard_worker`), at start-up,
  before every step when they change, and after every checkpoint load.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import ray
import torch
from omegaconf import DictConfig, OmegaConf

from sorl_verl.trainer import guard_sampler
from sorl_verl.trainer.guard_rule import (
    SECONDS_METRIC,
    Action,
    Decision,
    FaultInjection,
    GuardConfig,
    GuardState,
    can_have_records,
    guard_metrics,
    guard_settings,
    observe_step,
    observe_validation,
    question_records,
    validation_score,
    validation_se,
)
from sorl_verl.trainer.guard_worker import actor_lr_scale, set_clip_norm_tau

logger = logging.getLogger("sorl_verl.trainer.guard")

#: guard state file inside each ``global_step_<n>`` checkpoint folder
STATE_FILE = "sorl_guard.json"
#: the guard's own folder under ``trainer.default_local_dir``
GUARD_DIR = "sorl_guard"
#: losses whose normalizer has a ``clip_norm_tau`` to lower
TAU_LOSSES = ("so_grpo", "so_ppo", "s_ppo")
#: parts of a verl checkpoint folder the guard keeps and restores (``critic`` is verl's ``str(Role.Critic)``)
CHECKPOINT_PARTS = ("actor", "critic", "data.pt")
#: file inside a complete best snapshot: its step, score and standard error (written last)
SNAPSHOT_FILE = "sorl_guard_best.json"
#: what a restore loads from a verl checkpoint: ``checkpoint.save_contents`` must hold them all
RESTORED_CONTENTS = ("model", "optimizer", "extra")


class GuardStopped(RuntimeError):
    """A collapse after ``max_restores`` restores: the guard stops the run."""


def check_guard_against_trainer(config: DictConfig, guard: GuardConfig) -> None:
    """Start-up checks of the guard against the rest of the trainer config (names the knobs)."""
    if not guard.enable:
        return
    test_freq = int(config.trainer.get("test_freq", -1) or -1)
    if test_freq <= 0:
        raise ValueError(
            f"sorl.guard.enable=true needs periodic validation (the best checkpoint is chosen by it), but "
            f"trainer.test_freq={test_freq}; set trainer.test_freq > 0"
        )
    sections = [("actor_rollout_ref.actor", config.actor_rollout_ref.actor)]
    critic = config.get("critic", None)
    if critic is not None and critic.get("enable", None):
        sections.append(("critic", critic))
    for name, section in sections:
        checkpoint = section.get("checkpoint", None) or {}
        if checkpoint.get("async_save", False):
            raise ValueError(
                f"sorl.guard.enable=true links a checkpoint's files right after verl saves them, but "
                f"{name}.checkpoint.async_save=True may still be writing them; set {name}.checkpoint.async_save=False"
            )
        for key in ("save_contents", "load_contents"):
            contents = checkpoint.get(key, None)
            missing = [c for c in RESTORED_CONTENTS if contents is not None and c not in contents]
            if missing:
                raise ValueError(
                    f"sorl.guard.enable=true restores weights, optimizer and scheduler/RNG from a checkpoint, but "
                    f"{name}.checkpoint.{key}={list(contents)} lacks {missing}; set it to {list(RESTORED_CONTENTS)}"
                )
    if guard.rule == "stderr" and not can_have_records(guard.val_metric):
        raise ValueError(
            f"sorl.guard.rule=stderr reads the validation questions and their variance the SORL trainers log per "
            f"source and variable (val-aux/<source>/<var>/questions), but sorl.guard.val_metric="
            f"{guard.val_metric!r} is no validation metric val-core/<source>/<var>/<stat>; use such a val_metric "
            f"(default {GuardConfig.val_metric}) or sorl.guard.rule=drop"
        )
    nnodes = int(config.trainer.get("nnodes", 1) or 1)
    if nnodes > 1 and not guard.shared_storage:
        raise ValueError(
            f"sorl.guard.enable=true with trainer.nnodes={nnodes}: the guard links and reads the best snapshot and "
            f"data.pt on the driver's node only, so trainer.default_local_dir="
            f"{config.trainer.get('default_local_dir', None)} must be one file system shared by all nodes; if it "
            "is, set sorl.guard.shared_storage=true, else use a shared path (or sorl.guard.enable=false)"
        )
    if guard.backoff_target == "clip_norm_tau":
        policy_loss = config.actor_rollout_ref.actor.get("policy_loss", {})
        loss_mode, mode = policy_loss.get("loss_mode", None), policy_loss.get("clip_norm_mode", None)
        if loss_mode not in TAU_LOSSES or mode == "none":
            raise ValueError(
                "sorl.guard.backoff_target=clip_norm_tau lowers the SORL normalizer's tau, but "
                f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} (clip_norm_mode={mode}) has none; "
                f"use one of {TAU_LOSSES} with clip_norm_mode max|add, or backoff_target=lr"
            )


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes a hard link to the file ``src``, or a copy where the file system refuses links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def link_tree(src: Path, dst: Path) -> None:
    """Copy the tree ``src`` to ``dst`` (absent) file by file with :func:`link_or_copy`."""
    for root, _dirs, files in os.walk(src):
        target = dst / Path(root).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            link_or_copy(Path(root) / name, target / name)


def unshare_tree(folder: Path) -> None:
    """Unlink files of ``folder`` that have other hard links, so rewriting them in place (torch.save
    truncates) cannot change a guard snapshot."""
    if not folder.is_dir():
        return
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if path.stat().st_nlink > 1:
                path.unlink()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class CollapseGuard:
    """Mixin for a verl v1 ``PPOTrainer`` (module docstring)."""

    base_trainer_mode: ClassVar[str]
    guard_config: GuardConfig
    guard_fault: FaultInjection
    guard_state: GuardState = GuardState()
    _guard_applied: tuple[float, float] | None = None
    _guard_saved_step: int | None = None

    def __init__(self, config: DictConfig) -> None:
        sections = {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v
                    for k in ("guard", "fault_injection") if (v := OmegaConf.select(config, f"sorl.{k}")) is not None}  # fmt: skip
        self.guard_config, self.guard_fault = guard_settings(sections)
        check_guard_against_trainer(config, self.guard_config)
        super().__init__(config)  # type: ignore[call-arg]

    # ------------------------------------------------------------------ paths and state

    @property
    def guard_active(self) -> bool:
        return self.guard_config.enable

    def _ckpt_root(self) -> Path:
        root = Path(str(self.config.trainer.default_local_dir))  # type: ignore[attr-defined]
        return root if root.is_absolute() else Path.cwd() / root

    def _guard_dir(self) -> Path:
        return self._ckpt_root() / GUARD_DIR

    def _step_folder(self, step: int) -> Path:
        return self._ckpt_root() / f"global_step_{step}"

    def _best_folder(self, step: int) -> Path:
        return self._guard_dir() / f"best_step_{step}"

    def _resumed_folder(self) -> Path | None:
        """The checkpoint folder verl resumed from (``None`` for a fresh start)."""
        step = int(self.global_steps)  # type: ignore[attr-defined]
        if step == 0:
            return None
        trainer = self.config.trainer  # type: ignore[attr-defined]
        if trainer.resume_mode == "resume_path":
            folder = Path(str(trainer.resume_from_path))
            return folder if folder.is_absolute() else Path.cwd() / folder
        return self._step_folder(step)

    def _event(self, kind: str, **fields: Any) -> None:
        self._guard_dir().mkdir(parents=True, exist_ok=True)
        record = {"time": time.time(), "step": int(self.global_steps), "event": kind, **fields}  # type: ignore[attr-defined]
        with open(self._guard_dir() / "events.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ scales inside the workers

    def _guard_apply(self, force: bool = False) -> None:
        """Set the actor's learning-rate scale (and clip_norm_tau) for the coming step if changed."""
        if not (self.guard_active or self.guard_fault.active):
            return
        step = int(self.global_steps)  # type: ignore[attr-defined]
        wanted = (self.guard_state.lr_scale * self.guard_fault.factor(max(step, 1)), self.guard_state.tau_scale)
        if not force and wanted == self._guard_applied:
            return
        workers = self.actor_rollout_wg.workers  # type: ignore[attr-defined]
        lrs = ray.get([w.__ray_call__.remote(actor_lr_scale, wanted[0]) for w in workers])
        if not any(lrs):
            raise RuntimeError(
                "sorl.guard: no actor optimizer found in the actor workers to scale the learning rate of"
            )
        if self.guard_config.backoff_target == "clip_norm_tau":
            tau = float(self.config.actor_rollout_ref.actor.policy_loss.clip_norm_tau) * wanted[1]  # type: ignore[attr-defined]
            taus = ray.get([w.__ray_call__.remote(set_clip_norm_tau, tau) for w in workers])
            if not any(taus):
                raise RuntimeError(
                    "sorl.guard.backoff_target=clip_norm_tau: no actor loss with a clip_norm_tau found in the actor "
                    "workers to set it in"
                )
        logger.info(
            "sorl.guard: step %s actor lr scale %s (lr %s), tau scale %s", step, wanted[0], lrs[0][:1], wanted[1]
        )
        self._guard_applied = wanted

    # ------------------------------------------------------------------ verl hooks

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()  # type: ignore[misc]
        self._guard_saved_step = None
        if self.guard_active:
            self.guard_state = self._read_resumed_state()
        self._guard_apply(force=True)

    def _read_resumed_state(self) -> GuardState:
        folder = self._resumed_folder()
        if folder is None:
            return GuardState()
        path = folder / STATE_FILE
        if not path.is_file():
            logger.warning(
                "sorl.guard: %s has no %s (saved without the guard); starting the guard afresh", folder, STATE_FILE
            )
            return GuardState()
        state = GuardState.from_dict(json.loads(path.read_text()))
        if state.best_step is not None and not self._best_folder(state.best_step).is_dir():
            state = self._newest_snapshot_state(state, folder)
        logger.info("sorl.guard: resumed state from %s: %s", path, state)
        return state

    def _newest_snapshot_state(self, state: GuardState, folder: Path) -> GuardState:
        """``state`` with the best of the newest complete snapshot (one with :data:`SNAPSHOT_FILE`),
        for a resumed state whose own best snapshot is missing; no best when there is none."""
        complete = [p for p in self._guard_dir().glob("best_step_*")
                    if p.name.removeprefix("best_step_").isdigit() and (p / SNAPSHOT_FILE).is_file()]  # fmt: skip
        complete.sort(key=lambda p: int(json.loads((p / SNAPSHOT_FILE).read_text())["best_step"]))
        kept = json.loads((complete[-1] / SNAPSHOT_FILE).read_text()) if complete else {}
        logger.warning(
            "sorl.guard: the resumed checkpoint %s names the best snapshot of step %s, which is missing; %s",
            folder, state.best_step,
            f"falling back to {complete[-1]}" if complete else "no complete snapshot is left: the next validation sets the best",
        )  # fmt: skip
        return replace(
            state, best_step=kept.get("best_step"), best_score=kept.get("best_score"), best_se=kept.get("best_se")
        )

    def on_step_begin(self) -> None:
        super().on_step_begin()  # type: ignore[misc]
        self._guard_apply()

    def _save_checkpoint(self) -> None:
        step = int(self.global_steps)  # type: ignore[attr-defined]
        if self.guard_active:
            folder = self._step_folder(step)
            unshare_tree(folder)
            folder.mkdir(parents=True, exist_ok=True)
            write_json(folder / STATE_FILE, self.guard_state.to_dict())
        super()._save_checkpoint()  # type: ignore[misc]
        self._guard_saved_step = step

    def _build_replay_buffer(self) -> Any:
        buffer = super()._build_replay_buffer()  # type: ignore[misc]
        if self.guard_active and self.base_trainer_mode != "sync":
            guard_sampler.install(vars(buffer).get("_buffer", buffer))  # under ReproducibleRollouts' proxy
        return buffer

    def _val_metrics_update(self, data_sources: Any, sample_uids: Any, reward_extra_infos_dict: dict,
                            sample_turns: Any, expected_acc_counts: dict | None = None) -> dict[str, float]:  # fmt: skip
        """verl's validation metrics plus each source's question count and score variance
        (:func:`~sorl_verl.trainer.guard_rule.question_records`), with the guard on or off: the guard's
        rule ``stderr`` reads them, and the study replays that rule on unguarded runs
        (:mod:`sorl_verl.study.rule_replay`). Metrics only: nothing trained depends on them."""
        metrics = super()._val_metrics_update(  # type: ignore[misc]
            data_sources, sample_uids, reward_extra_infos_dict, sample_turns, expected_acc_counts=expected_acc_counts
        )
        metrics.update(question_records(data_sources, sample_uids, reward_extra_infos_dict))
        return metrics

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)  # type: ignore[misc]
        if self.guard_active:
            start = time.perf_counter()
            metrics.update(self._guard_observe(metrics, int(global_steps)))
            metrics[SECONDS_METRIC] = time.perf_counter() - start

    # ------------------------------------------------------------------ the rule applied

    def _guard_observe(self, metrics: dict, step: int) -> dict[str, float]:
        config = self.guard_config
        decisions: list[Decision] = []
        validated = any(k.startswith(("val-core/", "val-aux/")) for k in metrics)
        if validated:
            score = validation_score(metrics, config.val_metric)
            if score is None:
                names = sorted(k for k in metrics if k.startswith("val-core/"))
                raise ValueError(
                    f"sorl.guard.val_metric={config.val_metric!r} matches no finite validation metric; logged: {names}"
                )
            se = validation_se(metrics, config.val_metric) if config.rule == "stderr" else None
            decisions.append(observe_validation(config, self.guard_state, step, score, se))
        if config.warning_metric is not None and not (
            decisions and decisions[-1].action in (Action.RESTORE, Action.STOP)
        ):
            value = metrics.get(config.warning_metric)
            if value is not None:
                state = decisions[-1].state if decisions else self.guard_state
                decisions.append(observe_step(config, state, step, float(value)))
            elif any(k.startswith("actor/") for k in metrics):
                close = difflib.get_close_matches(config.warning_metric, list(metrics), n=5, cutoff=0.5)
                raise ValueError(
                    f"sorl.guard.warning_metric={config.warning_metric!r} is not a logged metric; close: {close}"
                )
        collapsed, kind = False, ""
        for decision in decisions:
            if decision.action == Action.NEW_BEST:
                self._keep_best(step, decision.state)  # the state names the new best once its snapshot exists
                continue
            self.guard_state = decision.state
            if decision.action in (Action.RESTORE, Action.STOP):
                collapsed, kind = True, decision.reason.split(":", 1)[0]
                if decision.action == Action.STOP:
                    self._stop(decision, metrics, step)
                self._restore(step, decision.reason)
            elif decision.reason:
                logger.warning("sorl.guard: %s", decision.reason)
        if self._guard_saved_step == step:  # keep the state in this step's checkpoint current
            write_json(self._step_folder(step) / STATE_FILE, self.guard_state.to_dict())
        return guard_metrics(config, self.guard_state, collapsed, kind)

    def _keep_best(self, step: int, state: GuardState) -> None:
        """Checkpoint this step (unless saved), snapshot it, and only then make ``state`` (the new best)
        the guard's: a failed save or link leaves the previous best and the state naming it."""
        start = time.perf_counter()
        saved = self._guard_saved_step == step
        if not saved:
            self._save_checkpoint()  # writes the state as it was: the previous best
        best = self._best_folder(step)
        tmp = best.with_name(best.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        source = self._step_folder(step)
        tmp.mkdir(parents=True)
        for part in CHECKPOINT_PARTS:
            if (source / part).is_dir():
                link_tree(source / part, tmp / part)
            elif (source / part).is_file():
                link_or_copy(source / part, tmp / part)
        write_json(tmp / SNAPSHOT_FILE, {"best_step": step, "best_score": state.best_score, "best_se": state.best_se})
        shutil.rmtree(best, ignore_errors=True)
        os.replace(tmp, best)
        self.guard_state = state
        write_json(self._step_folder(step) / STATE_FILE, self.guard_state.to_dict())
        for old in self._guard_dir().glob("best_step_*"):
            if old != best:
                shutil.rmtree(old, ignore_errors=True)
        seconds = time.perf_counter() - start
        logger.info("sorl.guard: new best validation score %.4g at step %s (%s, %.1f s)",
                    self.guard_state.best_score, step, best, seconds)  # fmt: skip
        self._event("new_best", score=self.guard_state.best_score, saved_checkpoint=not saved, seconds=seconds)

    def _restore(self, step: int, reason: str) -> None:
        state = self.guard_state
        best = self._best_folder(int(state.best_step))  # type: ignore[arg-type]
        start = time.perf_counter()
        message = (
            f"sorl.guard: collapse at step {step} ({reason}); restoring step {state.best_step} "
            f"(score {state.best_score:.4g}) from {best}, restore {state.restores} of {self.guard_config.max_restores}, "
            f"lr scale {state.lr_scale:g}, clip_norm_tau scale {state.tau_scale:g}"
        )
        logger.warning(message)
        print(message, flush=True)
        self._pause_rollout()
        self.actor_rollout_wg.load_checkpoint(local_path=str(best / "actor"), del_local_after_load=False)  # type: ignore[attr-defined]
        if getattr(self, "use_critic", False):
            self.critic_wg.load_checkpoint(local_path=str(best / "critic"), del_local_after_load=False)  # type: ignore[attr-defined]
        self.train_dataloader.load_state_dict(torch.load(best / "data.pt", weights_only=False))  # type: ignore[attr-defined]
        self.train_dataloader_it = None
        self._guard_apply(force=True)
        self._resume_rollout()
        dropped = self._drop_collapsed_rollouts()
        self._save_checkpoint()
        seconds = time.perf_counter() - start
        self._event("restore", reason=reason, restored_step=state.best_step, restores=state.restores,
                    lr_scale=state.lr_scale, tau_scale=state.tau_scale, seconds=seconds, **dropped)  # fmt: skip

    def _drop_collapsed_rollouts(self) -> dict[str, int]:
        """Asynchronous modes: drop the collapsed policy's queued and in-flight groups
        (:func:`~sorl_verl.trainer.guard_sampler.drop_collapsed_rollouts`) and refill the prefetch window
        with as many fresh prompts, in whole ``gen_batch_size`` fetches (verl's unit of dispatch)."""
        if self.base_trainer_mode == "sync":
            return {}
        cleared, condemned = guard_sampler.drop_collapsed_rollouts(self.replay_buffer)  # type: ignore[attr-defined]
        data = self.config.data  # type: ignore[attr-defined]
        gen_batch = int(data.get("gen_batch_size", None) or data.train_batch_size)
        refill = (cleared + condemned) // gen_batch * gen_batch
        if refill:
            self._add_prompts_to_generate(refill)  # type: ignore[attr-defined]
        logger.warning("sorl.guard: dropped %s queued and %s in-flight prompt groups of the collapsed policy; "
                       "%s fresh prompts dispatched", cleared, condemned, refill)  # fmt: skip
        return {"dropped_queued": cleared, "dropped_in_flight": condemned, "refilled": refill}

    def _stop(self, decision: Decision, metrics: dict, step: int) -> None:
        state = decision.state
        message = (
            f"sorl.guard: collapse at step {step} ({decision.reason}) after max_restores="
            f"{self.guard_config.max_restores} restore(s); stopping the run. The best validation score "
            f"{state.best_score:.4g} is step {state.best_step}'s, kept in {self._best_folder(int(state.best_step))}."  # type: ignore[arg-type]
        )
        self._event("stop", reason=decision.reason)
        metrics.update(guard_metrics(self.guard_config, state, True, decision.reason.split(":", 1)[0]))
        tracker = getattr(self, "logger", None)
        if tracker is not None:
            tracker.log(data=metrics, step=step)
        raise GuardStopped(message)

    # ------------------------------------------------------------------ rollout replicas

    def _pause_rollout(self) -> None:
        """Quiesce the replicas before the actor loads a checkpoint (as verl does before its resume)."""
        mode = self.base_trainer_mode
        if mode == "separate_async":
            from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

            self._guard_lent_out = getattr(self, "current_mode", None) == HybridEngineMode.ROLLOUT
            if self._guard_lent_out:
                self.switch_to_trainer()  # type: ignore[attr-defined]
            return
        if mode == "colocate_async":
            self.checkpoint_manager.abort_replicas()  # type: ignore[attr-defined]
        self.checkpoint_manager.sleep_replicas()  # type: ignore[attr-defined]

    def _resume_rollout(self) -> None:
        """Send the restored weights to every replica that generates (the verl mode's own sync calls)."""
        step = self.global_steps  # type: ignore[attr-defined]
        mode = self.base_trainer_mode
        if mode == "separate_async":
            self.standalone_checkpoint_manager.update_weights(step)  # type: ignore[attr-defined]
            if getattr(self, "_guard_lent_out", False):
                self.switch_to_rollout()  # type: ignore[attr-defined]
            return
        self.checkpoint_manager.update_weights(step)  # type: ignore[attr-defined]
        if mode == "colocate_async":
            self.checkpoint_manager.resume_generation_replicas()  # type: ignore[attr-defined]
