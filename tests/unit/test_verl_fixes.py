"""Fixes of verl bugs on the SORL trainers' path, installed on every platform (not only CPU)."""

from __future__ import annotations

import logging

import pytest


def test_separate_async_logger_accepts_prints_flush_keyword_and_still_logs(caplog) -> None:
    """verl 0.9.1's PPOTrainerSeparateAsync._setup calls ``logger.info(..., flush=True)`` when
    hybrid_engine=False; the fix makes that call log instead of raising TypeError."""
    import sorl_verl.plugin as plugin
    from sorl_verl.trainer.verl_compat import FIX_MARK, SEPARATE_ASYNC_LOGGER, apply_verl_fixes

    assert plugin.REGISTERED["verl_fixes"] == [f"{SEPARATE_ASYNC_LOGGER}.logger"]
    assert apply_verl_fixes() == plugin.REGISTERED["verl_fixes"], "idempotent"
    import verl.trainer.ppo.v1.trainer_separate_async as mod

    assert mod.logger is logging.getLogger(SEPARATE_ASYNC_LOGGER) and getattr(mod.logger, FIX_MARK)
    with caplog.at_level(logging.INFO, logger=SEPARATE_ASYNC_LOGGER):
        mod.logger.info("[V1SepAsync] %d standalone replicas", 2, flush=True)
    assert "[V1SepAsync] 2 standalone replicas" in caplog.text
    other = logging.getLogger("sorl_verl.tests.unfixed")
    other.setLevel(logging.INFO)
    with pytest.raises(TypeError, match="flush"):  # what verl's call did before the fix: scoped to its logger
        other.info("x", flush=True)
