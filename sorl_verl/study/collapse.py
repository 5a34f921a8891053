"""The collapse rule of the stability study, fixed before any run and written into stability.json.

A run is judged from its validation scores ``v_0, ..., v_m`` (mean over data sources, step 0
first, see :mod:`sorl_verl.study.metrics`), its training metrics and main_ppo's exit code.
With the running peak ``p_j = max(v_0, ..., v_j)`` it **collapsed** when any of:

(a) *score collapse*: ``v_m < f * p_m`` (``f = 1/2``). Since ``p`` never decreases and a
    score that sets a new peak is above ``f`` times it, this is the same as "fell below half
    its running peak and stayed below it at every later validation, the last included"; the
    onset is the first validation of that final run of low scores. A recovery above
    ``f * p_j`` at any later validation clears it; with a single validation it cannot hold.
(b) *divergence*: an actor/critic loss or grad norm is NaN or infinite at some step.
(c) *death*: main_ppo exited with a non-zero code after step 1 completed. Killed by a signal
    (negative code, or 128 + SIGINT/SIGKILL/SIGTERM) means interrupted, not a result; a run that
    died before step 1 is a failed run, not a result either (``judged`` false).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Sequence
from dataclasses import dataclass

#: the fraction of the running peak below which the score has collapsed
FRACTION = 0.5

CRITERION = (
    "A run collapsed if (a) its validation score (mean over the validation data sources of verl's "
    "val-core/<source>/reward/mean@N) at the last validation is below half of its running peak, the "
    "maximum over all validations so far including the one before training (equivalently: it fell "
    "below half its running peak and stayed below it at every later validation, the last included; "
    "the onset is the first validation of that final low stretch), or (b) any actor/critic loss or "
    "grad norm logged is NaN or infinite, or (c) verl main_ppo exited with a non-zero code after "
    "training step 1 completed. A run killed by a signal, or that died before step 1, is not a "
    "result (judged false) and is not counted."
)

_KILLED = {128 + int(s) for s in (signal.SIGINT, signal.SIGKILL, signal.SIGTERM)}


@dataclass(frozen=True)
class Verdict:
    """``collapsed`` and why; ``judged`` false when the run is no result (killed, died early)."""

    collapsed: bool
    judged: bool
    reason: str
    onset_step: int | None = None


def killed(exit_code: int | None) -> bool:
    """True for a run ended by a signal (``subprocess`` gives -N, a shell 128 + N)."""
    return exit_code is not None and (exit_code < 0 or exit_code in _KILLED)


def score_collapse_onset(val_scores: Sequence[tuple[int, float]], fraction: float = FRACTION) -> int | None:
    """Step of the first validation of the final stretch below ``fraction`` x running peak, or None.

    Non-finite scores (no validation sample scored) are skipped.
    """
    peak = -math.inf
    onset: int | None = None
    for step, score in val_scores:
        if not math.isfinite(score):
            continue
        peak = max(peak, score)
        low = score < fraction * peak
        onset = (step if onset is None else onset) if low else None
    return onset


def judge(
    val_scores: Sequence[tuple[int, float]],
    nonfinite: tuple[int, str] | None,
    exit_code: int | None,
    last_step: int,
    fraction: float = FRACTION,
) -> Verdict:
    """Apply the rule (see the module docstring) to one finished run.

    ``val_scores``: (step, validation score) in step order; ``nonfinite``: (step, key) of the first
    non-finite loss/grad norm or None; ``exit_code``: main_ppo's; ``last_step``: last training step logged.
    """
    if killed(exit_code):
        return Verdict(False, False, f"interrupted by a signal (exit code {exit_code})")
    if nonfinite is not None:
        step, key = nonfinite
        return Verdict(True, True, f"non-finite {key} at step {step}", step)
    died = exit_code not in (None, 0)
    if died and last_step < 1:
        return Verdict(False, False, f"failed before training step 1 (exit code {exit_code})")
    onset = score_collapse_onset(val_scores, fraction)
    if onset is not None:
        return Verdict(True, True, f"validation score below {fraction:g} x running peak from step {onset} on", onset)
    if died:
        return Verdict(True, True, f"main_ppo exited with code {exit_code} after step {last_step}", last_step)
    return Verdict(False, True, "")
