"""The SORL trainers refuse, before any worker starts, a run verl's v1 loop would end short of its
``trainer.total_training_steps`` (sorl_verl/trainer/trainers.py ``check_steps_fit_epochs``): verl
stops after ``trainer.total_epochs`` epochs of ``rows // data.train_batch_size`` batches."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from sorl_verl.trainer.trainers import SORLTrainerSync, check_steps_fit_epochs


def config(batch: int, epochs: int, steps: int | None):
    return OmegaConf.create(
        {"data": {"train_batch_size": batch}, "trainer": {"total_epochs": epochs, "total_training_steps": steps}}
    )


def verl_v1_steps(rows: int, batch: int, epochs: int, steps: int) -> int:
    """The steps verl 0.9.1's v1 loop (trainer_base.py fit) trains: it runs while the epoch
    ``(global_steps - 1) // steps_per_epoch`` is below ``total_epochs`` and ``global_steps <= steps``."""
    per_epoch = rows // batch
    trained, global_steps, epoch = 0, 1, 0
    while epoch < epochs and global_steps <= steps:
        trained += 1
        global_steps += 1
        epoch = (global_steps - 1) // per_epoch
    return trained


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(0, 3000),
    batch=st.integers(1, 600),
    epochs=st.integers(1, 40),
    steps=st.one_of(st.none(), st.integers(1, 400)),
)
def test_refuses_exactly_the_runs_verl_would_cut_short(rows, batch, epochs, steps):
    per_epoch = rows // batch
    if per_epoch == 0:
        with pytest.raises(ValueError, match=rf"^the training set has {rows} rows, fewer than one batch"):
            check_steps_fit_epochs(rows, config(batch, epochs, steps))
        return
    if steps is None:
        check_steps_fit_epochs(rows, config(batch, epochs, steps))
        return
    short = verl_v1_steps(rows, batch, epochs, steps) < steps
    assert short == (per_epoch * epochs < steps)
    if not short:
        check_steps_fit_epochs(rows, config(batch, epochs, steps))
        return
    with pytest.raises(ValueError) as exc:
        check_steps_fit_epochs(rows, config(batch, epochs, steps))
    text = str(exc.value)
    assert text.startswith(f"trainer.total_training_steps={steps}, but verl stops after trainer.total_epochs={epochs}")
    fit_epochs = math.ceil(steps / per_epoch)
    assert f"trainer.total_epochs >= {fit_epochs} or trainer.total_training_steps <= {per_epoch * epochs}" in text
    # both fixes it names are accepted, and verl then trains every step asked for
    check_steps_fit_epochs(rows, config(batch, fit_epochs, steps))
    check_steps_fit_epochs(rows, config(batch, epochs, per_epoch * epochs))
    assert verl_v1_steps(rows, batch, fit_epochs, steps) == steps
    assert verl_v1_steps(rows, batch, fit_epochs - 1, steps) < steps  # and no fewer epochs would do


def test_the_natural_study_s_eight_question_cell():
    """demo_train8_nokl_const: 8 rows, one batch of 8 per epoch, 50 steps: verl's default 30 epochs
    would stop at step 30; the grid sets trainer.total_epochs 50."""
    with pytest.raises(
        ValueError, match=r"= 30 steps, .*trainer\.total_epochs >= 50 or trainer\.total_training_steps <= 30$"
    ):
        check_steps_fit_epochs(8, config(8, 30, 50))
    check_steps_fit_epochs(8, config(8, 50, 50))
    check_steps_fit_epochs(1490, config(8, 30, 300))  # the 1,490-question grids: 186 batches per epoch


def test_the_trainer_checks_the_training_set_verl_built_before_any_worker(monkeypatch):
    built = []

    def verl_dataloader(self):  # stands in for verl's _init_dataloader: the dataset it would build
        built.append(True)
        self.train_dataset = list(range(8))

    monkeypatch.setattr(PPOTrainer, "_init_dataloader", verl_dataloader)
    trainer = object.__new__(SORLTrainerSync)
    trainer.config = config(8, 30, 50)
    with pytest.raises(ValueError, match="trainer.total_epochs >= 50"):
        trainer._init_dataloader()
    assert built == [True]
    trainer.config = config(8, 50, 50)
    trainer._init_dataloader()
