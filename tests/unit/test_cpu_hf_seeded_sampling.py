"""The ``hf`` rollout engine samples a request from its own seed: what it draws does not depend on
which other requests share its decode batch, in what order they arrive, or when they join.

Real engine, real tiny Qwen2 (built locally). Two regimes:

- batched (default): tokens equal; log-probs equal up to float32 reduction-order noise (a padded
  row's attention sums run over a different layout than the same row alone);
- ``max_batch_size=1``: every row is computed alone, so tokens AND log-probs are bitwise equal.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from transformers import Qwen2ForCausalLM

from sorl_verl.cpu.hf_engine import HFGenerationEngine, SamplingOptions
from sorl_verl.embedded.tiny_model import write_random_model
from sorl_verl.trainer.reproducible import episode_seed, turn_seed

FP32_UNIT_ROUNDOFF = 2.0**-24
MAX_TOKENS = 16
N_REQUESTS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Qwen2ForCausalLM:
    path = write_random_model(tmp_path_factory.mktemp("tiny_qwen2_seeds"), initializer_range=0.05)
    return Qwen2ForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))] for _ in range(N_REQUESTS)]


def seeds() -> list[int]:
    return [episode_seed(42, f"s{1:08d}p{i // 2:06d}", i % 2) for i in range(N_REQUESTS)]


def options(seed: int) -> SamplingOptions:
    return SamplingOptions(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True, seed=seed)


def engine(model: Qwen2ForCausalLM, **kwargs) -> HFGenerationEngine:
    return HFGenerationEngine(model, eos_token_ids=[2], max_model_len=512, **kwargs)


async def one_at_a_time(eng: HFGenerationEngine, prompts: list[list[int]]) -> list:
    return [await eng.generate(p, options(s)) for p, s in zip(prompts, seeds(), strict=True)]


async def concurrently(eng: HFGenerationEngine, prompts: list[list[int]], order: list[int], stagger_s: float) -> list:
    """Submit in ``order``, each ``stagger_s`` after the previous (later ones join rows already decoding)."""

    async def submit(rank: int, i: int):
        await asyncio.sleep(rank * stagger_s)
        return i, await eng.generate(prompts[i], options(seeds()[i]))

    done = await asyncio.gather(*(submit(rank, i) for rank, i in enumerate(order)))
    return [out for _, out in sorted(done, key=lambda pair: pair[0])]


def reduction_noise_bound(model: Qwen2ForCausalLM, seq_len: int, logit_scale: float) -> float:
    """Largest log-prob difference two float32 evaluations of one row can show when their sums run
    in different orders: per layer the longest reduction chain is ~5 hidden + intermediate + head_dim
    + 2 seq_len terms (norms, projections, attention), plus final norm and lm_head; each evaluation is
    within chain * u * scale of the exact logit (Higham 3.1), a log-prob moves by twice the logit
    error plus the vocabulary-long log-sum-exp."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    chain = cfg.num_hidden_layers * (5 * cfg.hidden_size + cfg.intermediate_size + head_dim + 2 * seq_len)
    chain += 2 * cfg.hidden_size
    return 2 * (2 * chain * FP32_UNIT_ROUNDOFF * max(1.0, logit_scale)) + 2 * cfg.vocab_size * FP32_UNIT_ROUNDOFF


@torch.no_grad()
def logit_scale(model: Qwen2ForCausalLM, prompts: list[list[int]]) -> float:
    return max(float(model(input_ids=torch.tensor([p])).logits.abs().max()) for p in prompts)


@pytest.mark.parametrize("stagger_s", [0.0, 0.01])
def test_batched_samples_do_not_depend_on_batch_composition_or_arrival_order(model, prompts, stagger_s):
    alone = asyncio.run(one_at_a_time(engine(model, batch_wait_s=0.0), prompts))
    bound = reduction_noise_bound(model, max(map(len, prompts)) + MAX_TOKENS, logit_scale(model, prompts))
    for order in ([4, 1, 5, 0, 3, 2], list(range(N_REQUESTS))[::-1]):
        eng = engine(model, batch_wait_s=0.005)
        together = asyncio.run(concurrently(eng, prompts, order, stagger_s))
        assert eng.peak_rows > 1, "requests must actually share decode batches"
        for a, b in zip(alone, together, strict=True):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= bound


def test_one_row_at_a_time_is_bitwise_invariant_to_arrival_order(model, prompts):
    reference = asyncio.run(one_at_a_time(engine(model, max_batch_size=1), prompts))
    for order in ([3, 0, 5, 1, 4, 2],):
        eng = engine(model, max_batch_size=1, batch_wait_s=0.005)
        outs = asyncio.run(concurrently(eng, prompts, order, stagger_s=0.0))
        assert set(eng.batch_sizes) == {1}
        for a, b in zip(reference, outs, strict=True):
            assert a.token_ids == b.token_ids and a.log_probs == b.log_probs  # bitwise


def test_seeds_of_an_episode_differ_per_sample_and_per_turn(model, prompts):
    """Two samples of one prompt draw different streams; one episode's turns (longer prompts) too."""
    prompt = prompts[0]
    eng = engine(model, max_batch_size=1)
    first, second = (
        asyncio.run(eng.generate(prompt, options(episode_seed(42, "s00000001p000000", k)))) for k in (0, 1)
    )
    assert first.token_ids != second.token_ids
    seed = episode_seed(42, "s00000001p000000", 0)
    assert turn_seed(seed, len(prompt)) != turn_seed(seed, len(prompt) + 1)
    assert math.isfinite(sum(first.log_probs))
