"""verl integration: the trainers that hand critic values to the turn-level GAE estimator.

The package's names load on first use (PEP 562), so that the torch-free modules under it
(:mod:`sorl_verl.trainer.guard_rule`, which the study replays) import without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["current_values", "provide_values"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from sorl_verl.trainer import values_context

        return getattr(values_context, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
