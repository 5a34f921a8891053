"""The verl releases this integration was written against, and the runtime check for them.

The SORL trainers override ``PPOTrainer._compute_advantage`` of verl's v1 trainer and rely on
how it reads fields from TransferQueue and pads them; that is an internal contract, so the
supported range (:mod:`sorl_verl.verl_version`: pyproject.toml's verl requirement) is checked at
registration time.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from packaging.version import Version

from sorl_verl.verl_version import SUPPORTED_VERL, SUPPORTED_VERL_RANGE

#: set to 1 to register the SORL trainers on an unverified verl release anyway.
SKIP_CHECK_ENV = "SORL_VERL_SKIP_VERSION_CHECK"


def installed_verl_version() -> str:
    """``verl.__version__`` (importing verl if needed)."""
    import verl

    return str(verl.__version__)


def verl_version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed verl) lies in :data:`SUPPORTED_VERL`."""
    return Version(version or installed_verl_version()) in SUPPORTED_VERL


def check_verl_version(version: str | None = None) -> str:
    """Return the verl version, or raise ``RuntimeError`` naming the supported range and the override."""
    version = version or installed_verl_version()
    if not verl_version_supported(version) and os.environ.get(SKIP_CHECK_ENV) != "1":
        raise RuntimeError(
            f"sorl_verl's trainers support verl {SUPPORTED_VERL_RANGE}, found verl {version}. "
            f"Install a supported verl (pip install 'verl{SUPPORTED_VERL_RANGE}') or set {SKIP_CHECK_ENV}=1 "
            "to register them anyway (so_ppo's critic-value hook is then unverified)."
        )
    return version


#: verl's logger that is called with print()'s ``flush=True`` (see :func:`drop_flush_kwarg`)
SEPARATE_ASYNC_LOGGER = "verl.trainer.ppo.v1.trainer_separate_async"
#: the attribute that marks what :func:`apply_verl_fixes` installed (the doctor checks it)
FIX_MARK = "__sorl_verl_fix__"


def drop_flush_kwarg(logger_name: str) -> str:
    """Make ``logging.getLogger(logger_name).info`` accept and drop print()'s ``flush`` keyword.

    ``PPOTrainerSeparateAsync._setup`` (verl 0.9.1) logs ``logger.info(..., flush=True)`` when
    ``actor_rollout_ref.hybrid_engine=False`` (rollout served by the standalone pool only, which the
    GPU recipe's and the CPU overlay's separate-async settings both select); ``logging`` rejects
    ``flush`` with a ``TypeError`` whenever INFO is enabled (verl's default ``VERL_LOGGING_LEVEL``),
    so the trainer dies before its first step. Set on the logger object, which exists by name
    before verl's module is imported, so that module's ``logger.setLevel`` leaves it in place.
    Idempotent; returns ``"<logger_name>.logger"``, the module attribute the doctor resolves.
    """
    logger = logging.getLogger(logger_name)
    if not getattr(logger, FIX_MARK, False):
        info = logger.info

        @functools.wraps(info)
        def info_without_flush(msg: object, *args: Any, flush: bool | None = None, **kwargs: Any) -> None:
            info(msg, *args, **kwargs)

        logger.info = info_without_flush  # type: ignore[method-assign]
        setattr(logger, FIX_MARK, True)
    return f"{logger_name}.logger"


def apply_verl_fixes() -> list[str]:
    """Install the fixes for verl bugs on the SORL trainers' path, on every platform (idempotent)."""
    return [drop_flush_kwarg(SEPARATE_ASYNC_LOGGER)]
