"""Seed-reproducible rollouts: stable prompt ids, per-episode sampling seeds, batch rows in dispatch order.

verl 0.9.x names every prompt with a random ``uuid4`` and trains on the rows of a batch in the order
its episodes *finished* (TransferQueue's insertion order), so two runs of one seed differ in
mini-batch composition and in which random stream each episode draws from. The SORL trainers
(:mod:`sorl_verl.trainer.trainers`) fix both with the pieces here:

- :func:`prompt_uid` names the ``k``-th prompt fetched from the dataloader at global step ``s``
  ``"s{s:08d}p{k:06d}-{nonce}"``: unique (the random nonce), ordered (zero-padded step and
  position sort lexicographically in dispatch order), and with a stable identity
  (:func:`prompt_identity`, the part before ``-``) that survives a resume.
- :func:`episode_seed` derives one sampling seed per episode from the run seed and the episode's
  identity ``(prompt identity, session id)``, never from batching, arrival order or the worker
  that runs it (:mod:`sorl_verl.cpu.seeded_agent_loop` injects it into the sampling params).
- :func:`ordered_keys` sorts a sampled batch's TransferQueue keys ``{uid}_{session}_{index}`` by
  ``(uid, session, index)``: prompt dispatch order, then sample index, then output index.

A training change as well as a reproducibility one: a GRPO group keeps one uid (its ``n`` samples
share it, as verl's uuid), but the rows that share a mini-batch change - each mini-batch holds
whole groups in dispatch order, where verl's finish order mixes groups (docs/algorithms.md, "What
else the SORL trainers change", with the measured reason).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterable
from typing import Any

#: ``s<step>p<position>-<nonce>``; verl splits TransferQueue keys on ``_``, so none may appear here
PROMPT_UID_RE = re.compile(r"^(s\d{8}p\d{6})-[0-9a-f]+$")
#: seeds fit a signed 64-bit integer (torch.Generator.manual_seed, vLLM, numpy all accept them)
SEED_BITS = 63


def prompt_uid(step: int, position: int, nonce: str | None = None) -> str:
    """uid of the ``position``-th prompt fetched at global step ``step`` (module docstring)."""
    if step < 0 or position < 0:
        raise ValueError(f"step and position must be >= 0, got {step}, {position}")
    return f"s{step:08d}p{position:06d}-{nonce or uuid.uuid4().hex[:12]}"


def prompt_identity(uid: str, dataset_index: Any = None, step: Any = None) -> str:
    """Stable identity of a prompt: the ``s..p..`` part of a :func:`prompt_uid`.

    verl's own trainers name prompts with random uuids; their identity falls back to the global
    step and the dataset row's ``extra_info.index`` (stable only when that index is unique).
    """
    match = PROMPT_UID_RE.match(str(uid))
    if match:
        return match.group(1)
    return f"step{step}-index{dataset_index}"


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` (BLAKE2b of their ``repr``): same parts, same seed, on any machine."""
    digest = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def episode_seed(run_seed: int, identity: str, session_id: int) -> int:
    """Sampling seed of sample ``session_id`` (0..n-1) of the prompt ``identity`` in a run seeded ``run_seed``."""
    return derive_seed("episode", int(run_seed), str(identity), int(session_id))


def turn_seed(seed: int, prompt_length: int) -> int:
    """Seed of one generation request of an episode: its turns are told apart by their prompt length.

    An agent loop resends the same sampling params at every turn, with the prompt grown by the
    previous turns (strictly longer each time), so ``(episode seed, prompt length)`` names a turn.
    """
    return derive_seed("turn", int(seed), int(prompt_length))


def key_order(key: str) -> tuple[str, int, int]:
    """Sort key of a TransferQueue trajectory key ``{uid}_{session}_{index}``."""
    uid, session, index = key.rsplit("_", 2)
    return uid, int(session), int(index)


def ordered_keys(keys: Iterable[str]) -> list[str]:
    """``keys`` in ``(uid, session, index)`` order: prompt dispatch order for :func:`prompt_uid` uids."""
    return sorted(keys, key=key_order)


class DispatchOrderedSampler:
    """Proxy for verl's replay buffer whose ``sample`` returns the batch's rows in :func:`ordered_keys` order.

    Every other attribute is the wrapped buffer's. verl materializes a batch in the order its
    trajectories reached TransferQueue, which depends on which episode finished first.
    """

    def __init__(self, buffer: Any) -> None:
        object.__setattr__(self, "_buffer", buffer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._buffer, name, value)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        batch, metrics = self._buffer.sample(*args, **kwargs)
        return batch.select_keys(ordered_keys(batch.keys)), metrics


class ReproducibleRollouts:
    """Mixin for a verl v1 ``PPOTrainer``: :func:`prompt_uid` uids and rows in dispatch order."""

    _uid_step: int = -1
    _uid_position: int = 0

    def _build_replay_buffer(self) -> Any:
        return DispatchOrderedSampler(super()._build_replay_buffer())  # type: ignore[misc]

    def _fetch_one_gen_batch(self) -> Any:
        batch = super()._fetch_one_gen_batch()  # type: ignore[misc]
        step = int(self.global_steps)  # type: ignore[attr-defined]
        if step != self._uid_step:
            self._uid_step, self._uid_position = step, 0
        uids = [prompt_uid(step, self._uid_position + i) for i in range(int(batch.batch_size[0]))]
        self._uid_position += len(uids)
        from verl.utils.tensordict_utils import assign_non_tensor_stack

        assign_non_tensor_stack(batch, "uid", uids)
        return batch
