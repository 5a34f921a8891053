"""The collapse guard's trainer glue (sorl_verl/trainer/guard.py) on a stand-in for verl's v1 trainer:
which checkpoint it keeps, what a restore loads and in which order each verl mode's replicas are
paused and given the restored weights, the state a resume reads back, and the stop.

The stand-in has verl's hook names and checkpoint layout (``global_step_<n>/{actor,data.pt}``,
``latest_checkpointed_iteration.txt``); its "actor worker" holds a real torch AdamW with verl's
constant LR schedule, reached the way the guard reaches a Ray worker (``__ray_call__``)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from verl.utils.torch_functional import get_constant_schedule_with_warmup

from sorl_verl.trainer import guard as guard_module
from sorl_verl.trainer.guard import CollapseGuard, GuardStopped

LR = 1e-3
VAL = "val-core/src/reward/mean@1"


class Handle:
    """A Ray actor handle whose ``__ray_call__.remote(fn, *args)`` runs ``fn(worker, *args)`` here."""

    def __init__(self, worker):
        self.__ray_call__ = types.SimpleNamespace(remote=lambda fn, *args: fn(worker, *args))


class Recorder:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __getattr__(self, method):
        return lambda *args, **kwargs: self.log.append((self.name, method, *args))


class FakeTrainer:
    """verl v1 ``PPOTrainer``'s surface the guard uses; the actor's 'weights' are one tensor."""

    def __init__(self, config):
        self.config = config
        self.calls: list = []
        self.weights = torch.zeros(3)
        self.data_position = 0
        param = torch.nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.AdamW([param], lr=LR)
        scheduler = get_constant_schedule_with_warmup(self.optimizer, num_warmup_steps=0)
        role = types.SimpleNamespace(actor=types.SimpleNamespace(engine=types.SimpleNamespace(
            optimizer=self.optimizer, lr_scheduler=scheduler)))  # fmt: skip
        trainer = self

        class ActorGroup:
            workers = [Handle(types.SimpleNamespace(worker_dict={"actor_rollout": role}))]

            def load_checkpoint(self, local_path, del_local_after_load=True):
                assert del_local_after_load is False, "the guard must never let verl delete its snapshot"
                trainer.calls.append(("actor", "load_checkpoint", local_path))
                trainer.weights = torch.load(Path(local_path) / "model.pt")

        class Loader:
            def load_state_dict(self, state):
                trainer.calls.append(("data", "load_state_dict", state))
                trainer.data_position = state["position"]

            def state_dict(self):
                return {"position": trainer.data_position}

        self.actor_rollout_wg = ActorGroup()
        self.train_dataloader = Loader()
        self.train_dataloader_it = object()
        self.checkpoint_manager = Recorder(self.calls, "replicas")
        self.standalone_checkpoint_manager = Recorder(self.calls, "standalone")
        self.global_steps = 0

    def _load_checkpoint(self):
        self.global_steps = int(self.config.trainer.get("resume_step", 0))
        if self.global_steps:
            folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
            self.weights = torch.load(folder / "actor" / "model.pt")

    def on_step_begin(self):
        pass

    def _save_checkpoint(self):
        folder = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
        (folder / "actor").mkdir(parents=True, exist_ok=True)
        torch.save(self.weights.clone(), folder / "actor" / "model.pt")
        torch.save(self.train_dataloader.state_dict(), folder / "data.pt")
        (folder.parent / "latest_checkpointed_iteration.txt").write_text(str(self.global_steps))
        self.calls.append(("trainer", "save", self.global_steps))

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        pass

    def switch_to_trainer(self):
        self.calls.append(("hybrid", "switch_to_trainer"))

    def switch_to_rollout(self):
        self.calls.append(("hybrid", "switch_to_rollout"))


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(guard_module, "ray", types.SimpleNamespace(get=lambda refs: refs))


def make(tmp_path, mode="sync", resume_step=0, **guard):
    cls = type("Guarded", (CollapseGuard, FakeTrainer), {"base_trainer_mode": mode})
    config = OmegaConf.create({
        "trainer": {"test_freq": 1, "default_local_dir": str(tmp_path / "ckpt"), "resume_mode": "auto",
                    "resume_step": resume_step},
        "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "so_grpo", "clip_norm_tau": 0.2}}},
        "sorl": {"guard": {"enable": True, "drop": 0.5, "patience": 1, "backoff": 0.5, "max_restores": 1, **guard}},
    })  # fmt: skip
    trainer = cls(config)
    trainer._load_checkpoint()
    return trainer


def train_step(trainer, score=None, save=False, **extra):
    """One step as verl's fit runs it: step begins, weights move, save, validation, metrics."""
    trainer.global_steps += 1
    trainer.on_step_begin()
    trainer.weights = trainer.weights + 1.0
    trainer.data_position += 1
    if save:
        trainer._save_checkpoint()
    metrics = dict(extra)
    if score is not None:
        metrics[VAL] = score
    trainer._compute_metrics(None, metrics, {}, global_steps=trainer.global_steps, epoch=0)
    return metrics


def lr(trainer):
    return trainer.optimizer.param_groups[0]["lr"]


ROLLOUT_ORDER = {
    "sync": [("replicas", "sleep_replicas"), ("actor", "load_checkpoint"), ("replicas", "update_weights", 3)],
    "colocate_async": [("replicas", "abort_replicas"), ("replicas", "sleep_replicas"), ("actor", "load_checkpoint"),
                       ("replicas", "update_weights", 3), ("replicas", "resume_generation_replicas")],
    "separate_async": [("actor", "load_checkpoint"), ("standalone", "update_weights", 3)],
}  # fmt: skip


@pytest.mark.parametrize("mode", sorted(ROLLOUT_ORDER))
def test_collapse_restores_the_best_and_the_replicas_get_it(tmp_path, mode):
    trainer = make(tmp_path, mode)
    ckpt = tmp_path / "ckpt"
    m1 = train_step(trainer, score=0.6)  # new best: the guard saves step 1 and keeps it
    assert m1["sorl/guard/best_step"] == 1 and (ckpt / "sorl_guard" / "best_step_1" / "actor" / "model.pt").exists()
    best_weights = trainer.weights.clone()
    train_step(trainer, save=True)  # verl's own checkpoint of step 2, no validation
    trainer.calls.clear()
    m3 = train_step(trainer, score=0.1, save=True)  # collapse: 0.1 < 0.5 * 0.6
    assert m3["sorl/guard/collapse"] == 1 and m3["sorl/guard/restores"] == 1 and m3["sorl/guard/lr_scale"] == 0.5
    assert torch.equal(trainer.weights, best_weights) and trainer.data_position == 1
    assert trainer.train_dataloader_it is None, "the next batch must come from the restored position"
    order = [c[:3] if c[0] != "actor" else c[:2] for c in trainer.calls if c[0] in ("replicas", "standalone", "actor")]
    assert order == ROLLOUT_ORDER[mode]
    assert trainer.calls[-1] == ("trainer", "save", 3), "the restored state is the newest checkpoint"
    assert torch.equal(torch.load(ckpt / "global_step_3" / "actor" / "model.pt"), best_weights)
    state = json.loads((ckpt / "global_step_3" / "sorl_guard.json").read_text())
    assert (state["restores"], state["lr_scale"], state["best_step"]) == (1, 0.5, 1)
    assert lr(trainer) == pytest.approx(LR * 0.5)
    assert json.loads((ckpt / "global_step_2" / "sorl_guard.json").read_text())["restores"] == 0


def test_separate_async_lent_hybrid_replicas_are_taken_back_and_lent_again(tmp_path):
    from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

    trainer = make(tmp_path, "separate_async")
    train_step(trainer, score=0.6)
    trainer.current_mode = HybridEngineMode.ROLLOUT
    trainer.calls.clear()
    train_step(trainer, score=0.0)
    names = [c[:2] for c in trainer.calls if c[0] in ("hybrid", "standalone", "actor")]
    assert names == [("hybrid", "switch_to_trainer"), ("actor", "load_checkpoint"), ("standalone", "update_weights"),
                     ("hybrid", "switch_to_rollout")]  # fmt: skip


def test_resume_reads_the_state_and_reapplies_the_scale(tmp_path):
    trainer = make(tmp_path)
    train_step(trainer, score=0.6)
    train_step(trainer, score=0.1)  # restore at step 2, saved as global_step_2
    resumed = make(tmp_path, resume_step=2)
    assert resumed.guard_state.restores == 1 and resumed.guard_state.best_step == 1
    assert lr(resumed) == pytest.approx(LR * 0.5), "the backed-off lr must survive the resume"
    m = train_step(resumed, score=0.55)
    assert m["sorl/guard/restores"] == 1 and m["sorl/guard/collapse"] == 0
    with pytest.raises(GuardStopped, match=r"max_restores=1 restore\(s\); stopping the run.*best_step_1"):
        train_step(resumed, score=0.05)
    events = [
        json.loads(line)["event"] for line in (tmp_path / "ckpt/sorl_guard/events.jsonl").read_text().splitlines()
    ]
    assert events == ["new_best", "restore", "stop"]


def test_a_new_best_replaces_the_snapshot_and_survives_a_rewrite_of_its_folder(tmp_path):
    trainer = make(tmp_path)
    train_step(trainer, score=0.3, save=True)  # verl saved step 1 itself: no second save
    assert [c for c in trainer.calls if c[:2] == ("trainer", "save")] == [("trainer", "save", 1)]
    first = trainer.weights.clone()
    trainer.weights = trainer.weights * 0 - 7
    trainer._save_checkpoint()  # step 1 saved again (as after a resume from an older checkpoint)
    snap = tmp_path / "ckpt" / "sorl_guard" / "best_step_1" / "actor" / "model.pt"
    assert torch.equal(torch.load(snap), first), "verl's rewrite must not reach the snapshot through a hard link"
    train_step(trainer, score=0.9)
    assert sorted(p.name for p in (tmp_path / "ckpt" / "sorl_guard").glob("best_step_*")) == ["best_step_2"]


def test_warning_metric_restores_and_a_misspelled_one_fails_naming_the_knob(tmp_path):
    trainer = make(tmp_path, warning_metric="actor/ppo_kl", warning_threshold=0.1, patience_steps=2)
    train_step(trainer, score=0.6, **{"actor/ppo_kl": 0.5})
    m = train_step(trainer, **{"actor/ppo_kl": 0.5})
    assert m["sorl/guard/collapse"] == 1 and m["sorl/guard/reason"] == 2 and m["sorl/guard/restores"] == 1
    bad = make(tmp_path / "b", warning_metric="actor/ppo_kll", warning_threshold=0.1)
    with pytest.raises(ValueError, match=r"sorl\.guard\.warning_metric='actor/ppo_kll'.*actor/ppo_kl"):
        train_step(bad, **{"actor/ppo_kl": 0.5})
    wrong = make(tmp_path / "c", val_metric="val-core/*/acc/mean@*")
    with pytest.raises(ValueError, match=r"sorl\.guard\.val_metric"):
        train_step(wrong, score=0.5)


def test_off_means_untouched(tmp_path):
    cls = type("Guarded", (CollapseGuard, FakeTrainer), {"base_trainer_mode": "sync"})
    config = OmegaConf.create({"trainer": {"test_freq": -1, "default_local_dir": str(tmp_path)}})
    trainer = cls(config)
    trainer._load_checkpoint()
    metrics = train_step(trainer, score=0.0)
    assert metrics == {VAL: 0.0} and lr(trainer) == LR and not list(tmp_path.iterdir())


def test_a_learning_rate_scale_with_no_actor_optimizer_to_apply_it_to_fails(tmp_path):
    cls = type("Guarded", (CollapseGuard, FakeTrainer), {"base_trainer_mode": "sync"})
    config = OmegaConf.create({"trainer": {"test_freq": -1, "default_local_dir": str(tmp_path)},
                               "sorl": {"fault_injection": {"lr_factor": 10.0}}})  # fmt: skip
    trainer = cls(config)
    trainer.actor_rollout_wg.workers = [Handle(types.SimpleNamespace(worker_dict={"rollout": object()}))]
    with pytest.raises(RuntimeError, match="no actor optimizer"):
        trainer._load_checkpoint()
