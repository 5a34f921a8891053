"""The CPU generation engine behind the ``hf`` rollout, checked against direct forward passes of a
tiny random Qwen2 (built locally, no download)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from sorl_verl.cpu.hf_engine import HFGenerationEngine, SamplingOptions, _top_k_top_p
from sorl_verl.embedded.tiny_model import write_random_model

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33], [40, 41], [50, 51, 52, 53, 54], [60], [70, 71]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def model(model_dir):
    return Qwen2ForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def make_engine(model, tokenizer=None, **kwargs):
    kwargs.setdefault("eos_token_ids", [2])
    kwargs.setdefault("max_model_len", 512)
    return HFGenerationEngine(model, tokenizer, **kwargs)


def run(coro):
    return asyncio.run(coro)


def greedy(max_tokens, **kw):
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@torch.no_grad()
def full_logits(model, prompt, generated):
    ids = torch.tensor([prompt + generated])
    logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]  # logits that produced each token


def logprob_tolerance(fp32, model, prompt, generated, temperature=1.0):
    """The engine's token log-probs against a second float32 evaluation whose reductions run in
    another order (KV-cached decode vs full forward, padded batch vs alone, AVX2 vs AVX-512):
    ``fp32.logprob`` (tests/conftest.py) with the logits' magnitude of this sequence as the scale."""
    scale = float(full_logits(model, prompt, generated).abs().max())
    return fp32.logprob(model.config, len(prompt) + len(generated), scale, temperature)


def test_greedy_tokens_and_logprobs_equal_a_direct_forward_pass(model, fp32):
    prompt = PROMPTS[1]
    out = run(make_engine(model).generate(prompt, greedy(16)))
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    logits = full_logits(model, prompt, out.token_ids)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    atol = logprob_tolerance(fp32, model, prompt, out.token_ids)
    torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_sampled_logprobs_follow_temperature_top_k_top_p(model, mode, fp32):
    prompt, temperature, top_k, top_p = PROMPTS[0], 0.7, 20, 0.9
    options = SamplingOptions(max_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, seed=3, ignore_eos=True)
    out = run(make_engine(model, logprobs_mode=mode).generate(prompt, options))
    logits = full_logits(model, prompt, out.token_ids)
    atol = logprob_tolerance(fp32, model, prompt, out.token_ids, temperature if mode == "processed_logprobs" else 1.0)
    for t, (token, lp) in enumerate(zip(out.token_ids, out.log_probs, strict=True)):
        scaled = logits[t] / temperature
        order = scaled.argsort(descending=True)[:top_k]
        probs = torch.softmax(scaled[order], -1)
        n_keep = int(((probs.cumsum(-1) - probs) < top_p).sum())  # smallest prefix with mass >= top_p
        kept = order[:n_keep]
        assert token in kept.tolist(), f"step {t}: sampled token outside the top-k/top-p set"
        if mode == "processed_logprobs":
            expected = torch.log_softmax(scaled[kept], -1)[kept.tolist().index(token)]
        else:
            expected = torch.log_softmax(logits[t], -1)[token]
        assert lp == pytest.approx(float(expected), abs=atol)


def first_new_token_index(seq):
    return next(k for k in range(1, len(seq)) if seq[k] not in seq[:k])


def test_stops_at_eos_and_at_stop_token_ids_keeping_the_stop_token(model):
    prompt = PROMPTS[3]
    seq = run(make_engine(model).generate(prompt, greedy(20))).token_ids
    k = first_new_token_index(seq)
    out = run(
        make_engine(model, eos_token_ids=[seq[k]]).generate(prompt, SamplingOptions(max_tokens=20, temperature=0))
    )
    assert out.token_ids == seq[: k + 1] and out.finish_reason == "stop"
    out = run(
        make_engine(model).generate(prompt, SamplingOptions(max_tokens=20, temperature=0, stop_token_ids=(seq[k],)))
    )
    assert out.token_ids == seq[: k + 1] and out.finish_reason == "stop"
    ignored = run(make_engine(model, eos_token_ids=[seq[k]]).generate(prompt, greedy(20)))
    assert ignored.token_ids == seq and ignored.finish_reason == "length"
    # min_tokens forbids the EOS before that many tokens exist
    late = run(
        make_engine(model, eos_token_ids=[seq[k]]).generate(
            prompt, SamplingOptions(max_tokens=20, temperature=0, min_tokens=k + 2)
        )
    )
    assert len(late.token_ids) >= k + 2 and seq[k] not in late.token_ids[: k + 1]


def test_stop_string_ends_generation_at_the_token_that_completes_it(model, tokenizer):
    prompt = PROMPTS[5]
    seq = run(make_engine(model).generate(prompt, greedy(30))).token_ids
    texts = [tokenizer.decode([t]) for t in seq]
    k = next(i for i in range(2, len(seq)) if texts[i].isascii() and texts[i].strip() and texts[i] not in texts[:i])
    stop = texts[k]
    end = next(i for i in range(len(seq)) if stop in tokenizer.decode(seq[: i + 1]))
    engine = make_engine(model, tokenizer, eos_token_ids=[])  # only the stop string ends these rows
    out = run(engine.generate(prompt, SamplingOptions(max_tokens=30, temperature=0, stop=(stop,))))
    assert out.token_ids == seq[: end + 1] and out.finish_reason == "stop"
    # as in vLLM, stop strings count only once min_tokens tokens exist
    late = run(engine.generate(prompt, SamplingOptions(max_tokens=30, temperature=0, stop=(stop,), min_tokens=end + 2)))
    assert late.token_ids[: end + 2] == seq[: end + 2] and len(late.token_ids) >= end + 2
    with pytest.raises(ValueError, match="tokenizer"):
        run(make_engine(model).generate(prompt, SamplingOptions(max_tokens=5, stop=("x",))))


def test_max_tokens_is_bounded_by_the_context(model):
    engine = make_engine(model, max_model_len=40)
    assert len(run(engine.generate(PROMPTS[0], greedy(5))).token_ids) == 5
    out = run(engine.generate(list(range(5, 42)), greedy(10)))  # 37 prompt tokens leave room for 3
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="no room"):
        run(engine.generate(list(range(5, 45)), greedy(10)))


def test_eight_concurrent_requests_batch_together_and_match_one_at_a_time(model, fp32):
    single = make_engine(model)
    alone = [run(single.generate(p, greedy(12))) for p in PROMPTS]
    sampled_alone = [
        run(single.generate(p, SamplingOptions(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True)))
        for i, p in enumerate(PROMPTS)
    ]
    batched_engine = make_engine(model)

    async def together(make_options):
        return await asyncio.gather(*[batched_engine.generate(p, make_options(i)) for i, p in enumerate(PROMPTS)])

    batched = run(together(lambda i: greedy(12)))
    assert batched_engine.batch_sizes == [8]
    for prompt, a, b in zip(PROMPTS, alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        atol = logprob_tolerance(fp32, model, prompt, a.token_ids)
        torch.testing.assert_close(torch.tensor(b.log_probs), torch.tensor(a.log_probs), atol=atol, rtol=0)
    # seeded sampling draws from each request's own generator: batching does not change it
    sampled = run(together(lambda i: SamplingOptions(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True)))
    assert [s.token_ids for s in sampled] == [s.token_ids for s in sampled_alone]


@pytest.mark.parametrize("short_prompt, long_prompt", [(PROMPTS[0], PROMPTS[1]), (PROMPTS[1], PROMPTS[0])])
def test_rows_of_different_lengths_finish_independently(model, short_prompt, long_prompt, fp32):
    # when the longer prompt leaves first, the padding columns left by it are trimmed from the cache
    engine = make_engine(model)

    async def both():
        return await asyncio.gather(engine.generate(short_prompt, greedy(3)), engine.generate(long_prompt, greedy(15)))

    short, long = run(both())
    assert (len(short.token_ids), len(long.token_ids)) == (3, 15)
    alone = run(make_engine(model).generate(long_prompt, greedy(15)))
    assert long.token_ids == alone.token_ids
    atol = logprob_tolerance(fp32, model, long_prompt, alone.token_ids)
    torch.testing.assert_close(torch.tensor(long.log_probs), torch.tensor(alone.log_probs), atol=atol, rtol=0)


def test_a_request_joins_rows_already_decoding_and_leaves_before_them(model, fp32):
    long_alone = run(make_engine(model).generate(PROMPTS[1], greedy(150)))
    short_alone = run(make_engine(model).generate(PROMPTS[4], greedy(8)))
    engine = make_engine(model)
    done_order = []

    async def timed(prompt, options, tag):
        out = await engine.generate(prompt, options)
        done_order.append(tag)
        return out

    async def staggered():
        long_task = asyncio.ensure_future(timed(PROMPTS[1], greedy(150), "long"))
        while not engine.batch_sizes:  # wait until the long row is decoding
            await asyncio.sleep(0.01)
        short = await timed(PROMPTS[4], greedy(8), "short")
        return await long_task, short

    long, short = run(staggered())
    assert engine.batch_sizes == [1, 1] and engine.peak_rows == 2 and done_order == ["short", "long"]
    assert long.token_ids == long_alone.token_ids and short.token_ids == short_alone.token_ids
    for got, alone, prompt in ((long, long_alone, PROMPTS[1]), (short, short_alone, PROMPTS[4])):
        atol = logprob_tolerance(fp32, model, prompt, alone.token_ids)
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(alone.log_probs), atol=atol, rtol=0)


def test_seed_makes_sampling_reproducible(model):
    engine = make_engine(model)
    opts = [SamplingOptions(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in (7, 7, 8)]
    a, b, c = (run(engine.generate(PROMPTS[0], o)).token_ids for o in opts)
    assert a == b and a != c
    # without a request seed the engine's seed decides, request by request
    e1, e2 = make_engine(model, seed=1), make_engine(model, seed=1)
    unseeded = SamplingOptions(max_tokens=20, temperature=1.0, ignore_eos=True)
    assert run(e1.generate(PROMPTS[0], unseeded)).token_ids == run(e2.generate(PROMPTS[0], unseeded)).token_ids


def test_weight_update_changes_outputs_to_the_new_models(model_dir, fp32):
    engine_model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    engine = make_engine(engine_model)
    before = run(engine.generate(PROMPTS[1], greedy(12)))
    torch.manual_seed(11)
    trained = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.2 * torch.randn_like(p))
    assert engine.load_weights(trained.state_dict().items()) == len(trained.state_dict())
    after = run(engine.generate(PROMPTS[1], greedy(12)))
    assert after.token_ids != before.token_ids
    reference = run(make_engine(trained).generate(PROMPTS[1], greedy(12)))
    assert after.token_ids == reference.token_ids
    atol = logprob_tolerance(fp32, trained, PROMPTS[1], reference.token_ids)
    torch.testing.assert_close(torch.tensor(after.log_probs), torch.tensor(reference.log_probs), atol=atol, rtol=0)
    with pytest.raises(KeyError, match="not_a_weight"):
        engine.load_weights([("not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_abort_ends_running_requests_and_holds_new_ones_until_resume(model):
    engine = make_engine(model, max_model_len=512)

    async def scenario():
        running = asyncio.ensure_future(engine.generate(PROMPTS[0], greedy(500)))
        await asyncio.sleep(0.3)
        assert await engine.abort_all() == 1
        aborted = await running
        parked = asyncio.ensure_future(engine.generate(PROMPTS[0], greedy(2)))
        await asyncio.sleep(0.05)
        assert not parked.done()
        engine.resume()
        return aborted, await parked

    aborted, later = run(scenario())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 500
    assert len(later.token_ids) == 2 and later.finish_reason == "length"


def test_sampling_options_from_verl_params():
    opts = SamplingOptions.from_vllm_params(
        {"temperature": 0.5, "top_p": 0.8, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True, "stop": "</a>"},
        max_tokens=9,
    )
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.stop, opts.greedy) == (9, 0.5, 0.8, ("</a>",), False)
    assert SamplingOptions.from_vllm_params({"temperature": 0}, max_tokens=1).greedy
    with pytest.raises(ValueError, match="best_of"):
        SamplingOptions.from_vllm_params({"best_of": 2}, max_tokens=4)
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingOptions.from_vllm_params({"n": 2}, max_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        SamplingOptions(max_tokens=3, top_p=0.0)


def test_top_k_top_p_filter_keeps_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    out = _top_k_top_p(logits, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.7, 1.0]))
    kept = torch.isfinite(out).tolist()
    assert kept == [[True, True, False, False], [True, True, False, False], [True, True, True, True]]
    torch.testing.assert_close(out[torch.isfinite(out)], logits[torch.isfinite(out)])
