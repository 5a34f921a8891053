"""Warm-start pieces without data: masked loss and length-bucketed batching."""

from __future__ import annotations

import math
import random

import torch

from sorl_verl.embedded.warmstart import _batch, _length_bucketed_batches, masked_nll


class _FixedLogits(torch.nn.Module):
    """Returns the given logits whatever the input (a lookup table as a model)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": self.logits})()


def test_masked_nll_counts_only_mask_one_targets() -> None:
    torch.manual_seed(0)
    ids = torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.float32)
    logits = torch.randn(2, 5, 9)
    loss = masked_nll(_FixedLogits(logits), ids, torch.ones_like(ids), mask)
    logp = torch.log_softmax(logits, -1)
    # targets at positions (0,2), (0,3), (1,1), (1,2) are predicted from the position before
    expect = -(logp[0, 1, 4] + logp[0, 2, 1] + logp[1, 0, 7] + logp[1, 1, 1]) / 4
    # two float32 log-softmax paths over V classes and a mean of n terms: within 2 (V + n) eps32 max|logit|
    tol = 2 * (logits.shape[-1] + 4) * torch.finfo(torch.float32).eps * float(logits.abs().max())
    assert math.isclose(float(loss), float(expect), abs_tol=tol)
    logits2 = logits.clone()
    logits2[0, 3] += 5.0  # predicts the mask-0 target at (0,4): loss unchanged
    assert math.isclose(float(masked_nll(_FixedLogits(logits2), ids, torch.ones_like(ids), mask)), float(loss),
                        abs_tol=tol)


def test_batch_pads_right_and_masks_padding() -> None:
    ids, attn, mask = _batch([([5, 6, 7], [0, 1, 1]), ([8], [1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attn.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mask.tolist() == [[0, 1, 1], [1, 0, 0]]


def test_length_bucketed_batches_cover_each_example_once_with_similar_lengths() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(10, 400) for _ in range(256)]
    batches = _length_bucketed_batches(lengths, 8, random.Random(1), bucket_batches=8)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(256)) and all(len(b) == 8 for b in batches)

    def spread(bs: list[list[int]]) -> float:
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in bs) / len(bs)

    unbucketed = _length_bucketed_batches(lengths, 8, random.Random(1), bucket_batches=1)
    assert spread(batches) < 0.3 * spread(unbucketed), (spread(batches), spread(unbucketed))
