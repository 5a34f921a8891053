"""verl v1 trainers that hand critic values to the ``so_ppo`` turn-level GAE estimator.

verl 0.9.x (the range of :mod:`sorl_verl.verl_version`, checked at registration) computes critic values into
TransferQueue under ``"values"`` but calls registered advantage estimators without them. Each
trainer here subclasses verl's trainer for one mode and, when ``algorithm.adv_estimator ==
"so_ppo"``, wraps ``_compute_advantage``: it reads ``"values"`` and ``"response_mask"`` for the
same ``batch.keys`` from TransferQueue, pads them the way the base method pads its batch
(``TensorDict.to_padded_tensor``: row order = ``batch.keys``, width = longest response), and
runs verl's own ``_compute_advantage`` inside :func:`provide_values`. Every other estimator
takes verl's path untouched.

Importing this module imports verl's v1 trainers (a few seconds); the plugin registers these
classes lazily, when verl's ``verl.trainer.ppo.v1`` package is first imported (see
:func:`sorl_verl.plugin.register_trainers`).

Selected with ``trainer.v1.trainer_mode=sorl_sync`` (or ``sorl_colocate_async``,
``sorl_separate_async``). Inside the trainer ``self.trainer_mode`` reports verl's base mode
(``sync`` ...), so verl's own mode switches and its ``trainer.v1.<base mode>`` settings apply.

verl enables the critic by itself only for ``gae``; ``so_ppo`` needs ``critic.enable=True``
and these trainers refuse to start without it.

They carry the collapse guard (:mod:`sorl_verl.trainer.guard`, ``sorl.guard.enable=true``: keep the
best validation checkpoint, restore it and back off on a collapse).

After the workers are built they give the actor's loss function MAX / MIN aggregation for the ratio
extrema (:mod:`sorl_verl.trainer.metric_aggregation`).

They also make a run reproducible from its seed (:class:`~sorl_verl.trainer.reproducible.ReproducibleRollouts`):
prompts get ordered, stable uids instead of random ones, and a sampled batch's rows are trained
in prompt dispatch order rather than in the order their episodes finished.
"""

from __future__ import annotations

from typing import Any, ClassVar

import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from sorl_verl.agent.metrics import EPISODE_METRICS, episode_metrics
from sorl_verl.algorithms.losses import NORMALIZING_LOSSES
from sorl_verl.algorithms.optim import check_step_scaling
from sorl_verl.cpu.platform.cpu_platform import check_cpu_device_selected
from sorl_verl.trainer.guard import CollapseGuard
from sorl_verl.trainer.metric_aggregation import install_extrema_aggregation
from sorl_verl.trainer.reproducible import ReproducibleRollouts
from sorl_verl.trainer.values_context import provide_values

#: advantage estimator that needs critic values
SO_PPO = "so_ppo"


def needs_values(config: DictConfig) -> bool:
    """True when ``algorithm.adv_estimator`` is the critic-based turn-level GAE."""
    return str(config.algorithm.adv_estimator) == SO_PPO


def check_critic_enabled(config: DictConfig) -> None:
    """Fail at start-up when ``so_ppo`` is selected without a critic (verl enables it only for gae)."""
    if needs_values(config) and not config.critic.get("enable", None):
        raise ValueError(
            "algorithm.adv_estimator=so_ppo needs critic values, but the critic is off "
            f"(critic.enable={config.critic.get('enable', None)}; verl turns the critic on by itself only "
            "for adv_estimator=gae). Set critic.enable=True."
        )


def check_update_step(config: DictConfig) -> None:
    """Fail at start-up, before any worker is built, where ``clip_norm_apply=update`` has no step to
    scale right (``strategy=megatron``, or an actor ``optimizer_impl`` other than the SORL optimizer's):
    :func:`~sorl_verl.algorithms.optim.check_step_scaling` for the actor's SORL loss."""
    actor = config.actor_rollout_ref.actor
    loss_mode = str(actor.policy_loss.get("loss_mode", "vanilla"))
    check_step_scaling(actor, normalizes=loss_mode in NORMALIZING_LOSSES)


def check_agent_settings(config: DictConfig) -> None:
    """Fail at start-up, before any worker is built, on ``search_r1`` settings that are invalid or
    that the trainer cannot serve (:func:`~sorl_verl.agent.settings.check_observation_masking`); the
    loop checks again on the workers, for runs that use it through verl's own trainer."""
    from sorl_verl.agent.settings import check_observation_masking, search_agent_settings

    settings = search_agent_settings(config)
    if settings is not None:
        check_observation_masking(settings.mask_observations, config)


def check_steps_fit_epochs(train_rows: int, config: DictConfig) -> None:
    """Fail before any worker is built where verl's v1 loop would end the run short of its length.

    verl trains ``train_rows // data.train_batch_size`` batches per epoch (the last partial batch
    dropped) and stops after ``trainer.total_epochs`` epochs even when ``trainer.total_training_steps``
    asks for more, while the actor's lr schedule (warm-up share, decay) spans
    ``trainer.total_training_steps``: a run would stop part-way through its schedule without a word.
    A training set smaller than one batch trains no step at all.
    """
    batch = int(config.data.train_batch_size)
    epochs = int(config.trainer.total_epochs)
    per_epoch = train_rows // batch
    if per_epoch == 0:
        raise ValueError(
            f"the training set has {train_rows} rows, fewer than one batch (data.train_batch_size={batch}): "
            "verl would train no step; lower data.train_batch_size or add training rows "
            "(data.train_files, data.train_max_samples)"
        )
    asked = config.trainer.get("total_training_steps")
    if asked is None:
        return
    steps, trained = int(asked), per_epoch * epochs
    if trained >= steps:
        return
    raise ValueError(
        f"trainer.total_training_steps={steps}, but verl stops after trainer.total_epochs={epochs} epochs of "
        f"{per_epoch} batches ({train_rows} training rows // data.train_batch_size={batch}) = {trained} steps, "
        f"while the lr schedule spans {steps}: set trainer.total_epochs >= {-(-steps // per_epoch)} "
        f"or trainer.total_training_steps <= {trained}"
    )


def fetch_padded_values(keys: list[str], partition_id: str) -> torch.Tensor | None:
    """Critic values for ``keys`` from TransferQueue as ``(len(keys), max_response_len)``.

    Padded exactly like verl's ``_compute_advantage`` pads its batch; ``None`` when the
    critic has not written ``"values"`` for these keys.
    """
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["values", "response_mask"])
    if "values" not in data.keys():  # noqa: SIM118 - TensorDict refuses `in` on itself
        return None
    padded = data.to_padded_tensor()
    values, mask = padded["values"], padded["response_mask"]
    if values.shape != mask.shape:
        raise RuntimeError(
            f"critic values {tuple(values.shape)} and response_mask {tuple(mask.shape)} disagree in shape"
        )
    return values


def fetch_episode_metrics(keys: list[str], partition_id: str, tags: list[dict]) -> dict[str, float]:
    """``agent/*`` batch means of the search_r1 per-episode statistics in the rows' ``extra_fields``.

    verl 0.9.x stores each row's ``extra_fields`` in TransferQueue but logs none of them; padding
    rows (``tag["is_padding"]``) and rows of other agent loops (no such keys) are left out.
    """
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])
    rows = [getattr(value, "data", value) for value in data["extra_fields"]]
    kept = [row for row, tag in zip(rows, tags, strict=True) if isinstance(row, dict) and not tag.get("is_padding")]
    return episode_metrics({key: [row.get(key) for row in kept] for key in EPISODE_METRICS})


class SORLValuesHook:
    """Mixin for a verl ``PPOTrainer`` subclass: the critic-value hook, the base-mode alias, and
    the ``agent/*`` episode metrics verl does not log by itself."""

    #: verl's own trainer mode this trainer extends ("sync", "colocate_async", "separate_async")
    base_trainer_mode: ClassVar[str]
    #: the name the user selected (``trainer.v1.trainer_mode``), kept for logs
    requested_trainer_mode: str | None = None

    @property
    def trainer_mode(self) -> str:
        """verl's base mode: every ``trainer_mode == "sync"`` switch in verl behaves as for the base."""
        return self.base_trainer_mode

    @trainer_mode.setter
    def trainer_mode(self, requested: str) -> None:
        self.requested_trainer_mode = requested

    def __init__(self, config: DictConfig) -> None:
        check_critic_enabled(config)
        check_update_step(config)
        check_cpu_device_selected(config.trainer.get("device", "cuda"))
        check_agent_settings(config)
        # one real search before any worker starts: a dead or wrong retrieval URL stops the run here
        from sorl_verl.agent.retrieval_guard import preflight_from_config

        preflight_from_config(config)
        super().__init__(config)  # type: ignore[call-arg]

    def _init_dataloader(self) -> None:
        """verl's dataloaders, then :func:`check_steps_fit_epochs` on the training set it built, before
        any resource pool or worker starts."""
        super()._init_dataloader()  # type: ignore[misc]
        check_steps_fit_epochs(len(self.train_dataset), self.config)  # type: ignore[attr-defined]

    def on_init_end(self) -> None:
        """After the workers are built: the actor's loss logs the ratio extrema as MAX / MIN
        (:mod:`sorl_verl.trainer.metric_aggregation`)."""
        super().on_init_end()  # type: ignore[misc]
        workers = self.actor_rollout_wg.workers  # type: ignore[attr-defined]
        ray.get([w.__ray_call__.remote(install_extrema_aggregation) for w in workers])

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        if not needs_values(self.config):  # type: ignore[attr-defined]
            return super()._compute_advantage(batch, metrics)  # type: ignore[misc]
        values = fetch_padded_values(list(batch.keys), batch.partition_id)
        with provide_values(values):
            return super()._compute_advantage(batch, metrics)  # type: ignore[misc]

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)  # type: ignore[misc]
        metrics.update(fetch_episode_metrics(list(batch.keys), batch.partition_id, list(batch.tags)))


class SORLTrainerSync(SORLValuesHook, CollapseGuard, ReproducibleRollouts, PPOTrainerSync):
    """verl's ``sync`` trainer with the so_ppo critic-value hook (``trainer_mode=sorl_sync``)."""

    base_trainer_mode = "sync"


class SORLTrainerColocateAsync(SORLValuesHook, CollapseGuard, ReproducibleRollouts, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` trainer with the hook (``trainer_mode=sorl_colocate_async``)."""

    base_trainer_mode = "colocate_async"


class SORLTrainerSeparateAsync(SORLValuesHook, CollapseGuard, ReproducibleRollouts, PPOTrainerSeparateAsync):
    """verl's ``separate_async`` trainer with the hook (``trainer_mode=sorl_separate_async``)."""

    base_trainer_mode = "separate_async"


#: registry name -> class, as registered into verl's ``TRAINER_REGISTRY``
SORL_TRAINERS: dict[str, type[PPOTrainer]] = {
    "sorl_sync": SORLTrainerSync,
    "sorl_colocate_async": SORLTrainerColocateAsync,
    "sorl_separate_async": SORLTrainerSeparateAsync,
}
