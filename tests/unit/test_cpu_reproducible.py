"""Seed-reproducible rollouts: prompt uids, episode/turn seeds, and the dispatch order of batch rows."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transfer_queue.metadata import KVBatchMeta

from sorl_verl.trainer.reproducible import (
    DispatchOrderedSampler,
    derive_seed,
    episode_seed,
    ordered_keys,
    prompt_identity,
    prompt_uid,
    turn_seed,
)


def test_prompt_uid_is_unique_ordered_and_has_a_stable_identity():
    a, b = prompt_uid(3, 7), prompt_uid(3, 7)
    assert a != b and "_" not in a  # verl splits TransferQueue keys on "_"
    assert prompt_identity(a) == prompt_identity(b) == "s00000003p000007"
    assert prompt_uid(3, 7) < prompt_uid(3, 8) < prompt_uid(4, 0) < prompt_uid(12, 0)
    with pytest.raises(ValueError):
        prompt_uid(-1, 0)


def test_random_uids_fall_back_to_step_and_dataset_index():
    assert prompt_identity("0b7e6c1e-8d0b-4a6e-9a57-5e1f3f1f0a00", dataset_index=17, step=2) == "step2-index17"


def test_seeds_are_pinned_across_machines_and_python_hash_seeds():
    """BLAKE2b of the parts: the same number on any machine (never Python's salted ``hash``)."""
    assert episode_seed(42, "s00000001p000000", 0) == 8757013529207761543
    assert turn_seed(5, 10) == 6633218544286399006
    assert 0 <= derive_seed("anything", 1) < 2**63


@given(st.integers(0, 2**31), st.integers(0, 63), st.integers(1, 4096))
def test_distinct_episodes_and_turns_get_distinct_seeds(run_seed, position, prompt_length):
    identity = prompt_identity(prompt_uid(1, position))
    seeds = {episode_seed(run_seed, identity, k) for k in range(4)}
    seeds.add(episode_seed(run_seed + 1, identity, 0))
    assert len(seeds) == 5
    assert turn_seed(seeds.pop(), prompt_length) != turn_seed(seeds.pop(), prompt_length)


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 300)), min_size=1, max_size=12, unique=True),
    st.integers(1, 5),
    st.integers(1, 3),
    st.randoms(),
)
def test_rows_come_back_in_dispatch_order_whatever_order_they_finished_in(prompts, n, outputs, rnd):
    uids = [prompt_uid(step, pos) for step, pos in sorted(prompts)]
    expected = [f"{uid}_{s}_{i}" for uid in uids for s in range(n) for i in range(outputs)]
    finished = list(expected)
    rnd.shuffle(finished)
    assert ordered_keys(finished) == expected


def test_session_ids_sort_as_numbers():
    uid = prompt_uid(1, 0)
    assert ordered_keys([f"{uid}_10_0", f"{uid}_2_0", f"{uid}_2_10", f"{uid}_2_9"]) == [
        f"{uid}_2_0",
        f"{uid}_2_9",
        f"{uid}_2_10",
        f"{uid}_10_0",
    ]


class FinishOrderBuffer:
    """Stand-in for verl's ReplayBuffer (which needs a TransferQueue): returns rows in finish order."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.poll_interval = 2.0

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        tags = [{"key": k, "seq_len": i} for i, k in enumerate(self.keys)]
        return KVBatchMeta(keys=list(self.keys), tags=tags, partition_id=partition_id), {"m": 1.0}


def test_sampler_proxy_reorders_keys_with_their_tags_and_forwards_the_rest():
    uids = [prompt_uid(1, i) for i in range(3)]
    keys = [f"{u}_{s}_0" for u in uids for s in range(2)]
    shuffled = random.Random(0).sample(keys, len(keys))
    proxy = DispatchOrderedSampler(FinishOrderBuffer(shuffled))
    batch, metrics = proxy.sample(global_steps=1, partition_id="train", batch_size=3)
    assert batch.keys == keys and [t["key"] for t in batch.tags] == keys
    assert batch.partition_id == "train" and metrics == {"m": 1.0}
    proxy.poll_interval = 0.5
    assert proxy._buffer.poll_interval == 0.5 and proxy.poll_interval == 0.5
