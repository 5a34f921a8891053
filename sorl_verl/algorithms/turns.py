"""Turn segmentation of a response from verl's ``response_mask``, fully vectorized.

A *turn* is a maximal run of consecutive positions with ``m = 1`` in a row. With
``start = m & ~shift_right(m)`` the turn id of a position is ``cumsum(start) * m``:
``1..K`` on policy tokens, ``0`` on everything the environment injected and on padding.

Per-turn reductions use a ``[B, K + 1]`` table indexed by turn id; column 0 collects the
``m = 0`` positions, whose values are replaced by zeros first, so it always holds 0. No Python loop
over rows or turns is used anywhere.

The policy losses use a run-length form instead (:class:`Runs`): the row-major flattened mask cut
into maximal runs of equal value that never cross a row, so every turn and every gap is one
contiguous run. A per-turn sum is then one ``segment_reduce`` and a broadcast one
``repeat_interleave``; both add in token order from 0, as ``scatter_add`` does, so the sums are
the same bits as the table's (and deterministic on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Turns:
    """Turn structure of a ``[B, T]`` response mask.

    ``mask``: bool ``[B, T]``; ``turn_id``: long ``[B, T]`` (0 where ``m = 0``);
    ``start``: bool ``[B, T]``, True at the first token of each turn;
    ``count``: float ``[B, K + 1]`` tokens per turn (column 0 forced to 0);
    ``num_turns``: long ``[B]``; ``max_turns``: ``K`` (python int).
    """

    mask: torch.Tensor
    turn_id: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    num_turns: torch.Tensor
    max_turns: int

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[B, K + 1]``: True for columns that hold a real turn (``count > 0``)."""
        return self.count > 0


def segment_turns(response_mask: torch.Tensor) -> Turns:
    """Segment every row of ``response_mask`` (bool/int/float ``[B, T]``) into turns."""
    mask = response_mask.bool()
    previous = F.pad(mask[:, :-1], (1, 0), value=False)
    start = mask & ~previous
    turn_id = torch.cumsum(start, dim=-1) * mask
    num_turns = turn_id.max(dim=-1).values if mask.shape[-1] > 0 else mask.new_zeros(mask.shape[0], dtype=torch.long)
    max_turns = int(num_turns.max().item()) if num_turns.numel() > 0 else 0
    count = torch.zeros(mask.shape[0], max_turns + 1, dtype=torch.float32, device=mask.device)
    count.scatter_add_(1, turn_id, mask.to(torch.float32))
    count[:, 0] = 0.0
    return Turns(mask=mask, turn_id=turn_id, start=start, count=count, num_turns=num_turns, max_turns=max_turns)


def turn_sum(values: torch.Tensor, turns: Turns, zero_outside: bool = False) -> torch.Tensor:
    """``[B, K + 1]`` sum of ``values`` over the tokens of each turn (column 0 is 0).

    ``m = 0`` positions are excluded with ``torch.where``, so NaN/inf there cannot leak
    (``zero_outside=True``: the caller guarantees ``values`` is already 0 there; skips a pass).
    Differentiable: the gradient of a turn sum flows to every token of the turn.
    """
    if not zero_outside:
        values = torch.where(turns.mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    table = torch.zeros(values.shape[0], turns.max_turns + 1, dtype=values.dtype, device=values.device)
    return table.scatter_add(1, turns.turn_id, values)


def turn_mean(values: torch.Tensor, turns: Turns, zero_outside: bool = False) -> torch.Tensor:
    """``[B, K + 1]`` mean of ``values`` over the tokens of each turn (0 for empty columns)."""
    return turn_sum(values, turns, zero_outside) / turns.count.clamp_min(1.0).to(values.dtype)


def broadcast_turns(per_turn: torch.Tensor, turns: Turns) -> torch.Tensor:
    """Token tensor ``[B, T]`` holding the value of each token's turn (column 0 where ``m = 0``)."""
    return torch.gather(per_turn, 1, turns.turn_id)


def first_token_of_turn(values: torch.Tensor, turns: Turns) -> torch.Tensor:
    """``[B, K + 1]``: ``values`` at the first token of each turn (column 0 is 0)."""
    at_start = torch.where(turns.start, values, torch.zeros((), dtype=values.dtype, device=values.device))
    index = torch.where(turns.start, turns.turn_id, torch.zeros_like(turns.turn_id))
    table = torch.zeros(values.shape[0], turns.max_turns + 1, dtype=values.dtype, device=values.device)
    return table.scatter_add(1, index, at_start)


def owning_turn(turns: Turns) -> torch.Tensor:
    """long ``[B, T]``: the turn a position belongs to for reward attribution.

    Policy tokens belong to their own turn; an ``m = 0`` position belongs to the latest turn
    that started before it (an observation or the trailing padding follows the action that
    caused it); positions before a row's first turn belong to turn 1. Rows without turns get 0.
    """
    latest = torch.cummax(turns.turn_id, dim=-1).values
    has_turns = (turns.num_turns > 0).unsqueeze(-1)
    return torch.where(has_turns, latest.clamp_min(1), torch.zeros_like(latest))


@dataclass(frozen=True)
class Runs:
    """Run-length form of a ``[B, T]`` response mask (module docstring).

    ``lengths``: long ``[S]``, the runs in row-major order (each row starts a new run, so a run
    never crosses a row); ``is_turn``: bool ``[S]``, True for runs of policy tokens (turns);
    ``shape``: ``(B, T)``.
    """

    lengths: torch.Tensor
    is_turn: torch.Tensor
    shape: tuple[int, int]

    @property
    def num_turns(self) -> torch.Tensor:
        """long scalar: turns in the micro-batch."""
        return self.is_turn.sum()

    @property
    def rows_with_turns(self) -> torch.Tensor:
        """long scalar: rows with at least one policy token (a row without one is a single gap run)."""
        empty_rows = (~self.is_turn & (self.lengths == self.shape[1])).sum()
        return self.shape[0] - empty_rows


def segment_runs(response_mask: torch.Tensor) -> Runs:
    """Cut every row of ``response_mask`` (bool/int/float ``[B, T]``) into runs of equal value."""
    mask = response_mask.bool()
    rows, length = mask.shape
    flat = mask.reshape(-1)
    if flat.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=mask.device)
        return Runs(lengths=empty, is_turn=empty.bool(), shape=(rows, length))
    boundary = torch.empty_like(flat)
    torch.bitwise_xor(flat[1:], flat[:-1], out=boundary[1:])
    boundary.view(rows, length)[:, 0] = True
    starts = torch.nonzero(boundary).squeeze(-1)
    lengths = torch.diff(starts, append=starts.new_full((1,), flat.numel()))
    return Runs(lengths=lengths, is_turn=flat[starts], shape=(rows, length))


def run_sum(values: torch.Tensor, runs: Runs) -> torch.Tensor:
    """``[S]`` sum of ``values`` (``[B, T]``, float) over each run, added in token order from 0.

    Not differentiable; the SORL surrogate (:mod:`sorl_verl.algorithms.surrogate`) writes its gradient.
    """
    if runs.lengths.numel() == 0:
        return values.new_zeros(0)
    return torch.segment_reduce(values.reshape(-1), "sum", lengths=runs.lengths, unsafe=True)


def run_broadcast(per_run: torch.Tensor, runs: Runs) -> torch.Tensor:
    """``[B, T]`` tensor holding, at each position, the value of its run."""
    return torch.repeat_interleave(per_run, runs.lengths, output_size=runs.shape[0] * runs.shape[1]).view(runs.shape)
