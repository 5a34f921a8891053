"""The SORL ratio extrema logged as the max / min over all micro-batches and ranks of an update.

verl's actor loss (``verl.workers.utils.losses.ppo_loss``) wraps every metric the policy loss
returns in a ``Metric`` with MEAN aggregation, so ``sorl/turn_ratio_max`` would be the mean of the
micro-batches' maxima. verl's ``Metric`` knows MAX and MIN (``Metric.aggregate_dp`` takes them over
every micro-batch of every rank); :class:`ExtremaAggregatingLoss` re-labels the entries of
:data:`~sorl_verl.algorithms.losses.RATIO_EXTREMA` after the actor's loss function has run. The SORL
trainers install it in the actor workers (:func:`install_extrema_aggregation`, through Ray's
``__ray_call__``, after the workers are built); no verl function is patched.
"""

from __future__ import annotations

from typing import Any

from verl.utils.metric import AggregationType, Metric

from sorl_verl.algorithms.losses import RATIO_EXTREMA
from sorl_verl.trainer.guard_worker import _roles


def with_extrema(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with each :data:`RATIO_EXTREMA` entry as a ``Metric`` of its own aggregation."""
    for key, end in RATIO_EXTREMA.items():
        if key in metrics:
            value = metrics[key]
            values = value.values if isinstance(value, Metric) else [value]
            metrics[key] = Metric(aggregation=AggregationType(end))
            metrics[key].extend(list(values))
    return metrics


class ExtremaAggregatingLoss:
    """verl's actor loss function (``partial(ppo_loss, config=...)``) with :func:`with_extrema` applied to
    its metrics; ``keywords`` are the wrapped partial's (the guard reads the loss config there)."""

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn

    @property
    def keywords(self) -> dict[str, Any]:
        return getattr(self.loss_fn, "keywords", {})

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        loss, metrics = self.loss_fn(*args, **kwargs)
        return loss, with_extrema(metrics)


def install_extrema_aggregation(worker: Any) -> int:
    """``__ray_call__`` target: wrap the loss function of every actor role of ``worker`` once; returns
    how many it wrapped (0 on a second call)."""
    wrapped = 0
    for role in _roles(worker):
        actor = getattr(role, "actor", None)
        loss_fn = getattr(actor, "loss_fn", None)
        if loss_fn is None or isinstance(loss_fn, ExtremaAggregatingLoss) or not hasattr(actor, "set_loss_fn"):
            continue
        actor.set_loss_fn(ExtremaAggregatingLoss(loss_fn))
        wrapped += 1
    return wrapped
