"""Supervised warm-start on scripted expert search trajectories, and the rollout evaluation loop.

An expert trajectory of a question with ``hop_queries`` ``E0 .. E(k-1)`` over the relation chain
``R0 .. R(k-1)`` is, after the chat-templated prompt (:func:`expert_search_segments`)::

    <think> I need to search E0. </think>\n<search> E0 </search>   + information_block(top-k of E0)
    <think> {fact R0 of E0: E1} </think>\n<search> E1 </search>     + information_block(top-k of E1)
    ...
    <think> {conclusion} </think>\n<answer> {answer} </answer><|im_end|>

where each world states its facts in its own words (:mod:`sorl_verl.embedded.qa_trajectories`,
:mod:`sorl_verl.embedded.medical_trajectories`) and the observations come from the real
retriever (:func:`make_observer`). Policy segments have loss mask 1; prompt and observations 0,
as in RL. The SFT loss is the mean token cross-entropy over mask-1 tokens.

The evaluation loop (:func:`greedy_rollouts`) runs the training agent loop's turn logic
(:mod:`sorl_verl.agent.episode`) with the model generating and the same observer searching.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sorl_verl.agent.prompts import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    information_block,
    qa_prompt,
)

#: queries -> observation text per query (already formatted like the retrieval client does)
Observer = Callable[[list[str]], list[str]]
#: ``fact(relation, subject, value)`` -> the sentence a thought states about one hop
FactFn = Callable[[str, str, str], str]
#: top-k passages per search in the warm-start and its evaluation
TOPK = 3


def make_observer(index_dir: str | Path, topk: int = TOPK) -> Observer:
    """In-process retrieval giving exactly the observation text the retrieval client produces."""
    from sorl_verl.retrieval.client import format_documents
    from sorl_verl.retrieval.index import load_searcher

    searcher = load_searcher(index_dir)

    def observe(queries: list[str]) -> list[str]:
        return [format_documents(hits) for hits in searcher.search(list(queries), topk)] if queries else []

    return observe


def expert_search_segments(
    question: dict[str, Any], fact: FactFn, observe: Observer, conclusion: str, answer: str
) -> list[tuple[str, bool]]:
    """The scripted response of a question record as ``(text, is_policy)`` segments (EOS not included).

    One search per ``question["hop_queries"]``; the thought before hop i > 0 states the fact of hop i-1
    (``fact(chain[i-1], hop_queries[i-1], hop_queries[i])``); the last thought is ``conclusion``.
    """
    hops, chain = question["hop_queries"], question["chain"]
    observations = observe(list(hops))
    segs: list[tuple[str, bool]] = []
    for i, query in enumerate(hops):
        thought = f"I need to search {query}." if i == 0 else fact(chain[i - 1], hops[i - 1], query)
        segs.append((f"{THINK_OPEN} {thought} {THINK_CLOSE}\n{SEARCH_OPEN} {query} {SEARCH_CLOSE}", True))
        segs.append((information_block(observations[i]), False))
    segs.append((f"{THINK_OPEN} {conclusion} {THINK_CLOSE}\n{ANSWER_OPEN} {answer} {ANSWER_CLOSE}", True))
    return segs


def early_stop_search_segments(question: dict[str, Any], fact: FactFn, observe: Observer) -> list[tuple[str, bool]]:
    """One search, then the fact it found as conclusion and its value (the bridge entity, the second
    hop's query) as answer: a demonstration that stops before the multi-hop question is answered."""
    hops, chain = question["hop_queries"], question["chain"]
    if len(hops) < 2:
        raise ValueError(f"early stopping needs a multi-hop question, got {len(hops)} hop(s): {question['id']}")
    return expert_search_segments({**question, "hop_queries": hops[:1], "chain": chain[:1]}, fact, observe,
                                  fact(chain[0], hops[0], hops[1]), hops[1])  # fmt: skip


def stops_early(question: dict[str, Any], rate: float, seed: int = 0) -> bool:
    """Whether the demonstration of ``question`` stops early: a draw with probability ``rate`` per id
    (multi-hop questions only)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"early_stop_rate must be in [0, 1], got {rate}")
    return len(question["hop_queries"]) > 1 and random.Random(f"{seed}:{question['id']}").random() < rate


def prompt_ids(tokenizer, question: str, prompt: str | None = None) -> list[int]:
    """Token ids of the chat-templated user prompt with the assistant generation prompt.

    The user message is ``prompt`` when given (e.g. a multiple-choice prompt), else ``qa_prompt(question)``.
    """
    content = qa_prompt(question) if prompt is None else prompt
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_trajectory(
    tokenizer, question: str, segments: Sequence[tuple[str, bool]], prompt: str | None = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``: each segment encoded on its own (as the agent loop does), EOS last.

    ``prompt``: the user message, as in :func:`prompt_ids`.
    """
    ids = prompt_ids(tokenizer, question, prompt)
    mask = [0] * len(ids)
    for text, is_policy in segments:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [int(is_policy)] * len(seg)
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return ids, mask


def build_sft_examples(
    tokenizer,
    questions: Sequence[dict[str, Any]],
    segments_of: Callable[[dict[str, Any]], list[tuple[str, bool]]],
    prompt_of: Callable[[dict[str, Any]], str] | None = None,
    progress: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of each question's expert response ``segments_of(q)`` after its prompt.

    ``prompt_of(q)``: the user message (default ``qa_prompt(q["question"])``), as in :func:`prompt_ids`.
    """
    from tqdm.auto import tqdm

    return [
        tokenize_trajectory(tokenizer, q["question"], segments_of(q), prompt=prompt_of(q) if prompt_of else None)
        for q in tqdm(questions, desc="expert trajectories", disable=not progress, mininterval=2)
    ]


def demonstration_examples(
    tokenizer,
    questions: Sequence[dict[str, Any]],
    observe: Observer,
    expert: Callable[[dict[str, Any], Observer], list[tuple[str, bool]]],
    early_stop: Callable[[dict[str, Any], Observer], list[tuple[str, bool]]],
    early_stop_rate: float = 0.0,
    seed: int = 0,
    prompt_of: Callable[[dict[str, Any]], str] | None = None,
    progress: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """Demonstrations of ``questions``, tokenized as ``(input_ids, loss_mask)``: ``expert(q, observe)``,
    or with probability ``early_stop_rate`` per multi-hop question (:func:`stops_early`)
    ``early_stop(q, observe)``; ``prompt_of`` as in :func:`build_sft_examples`."""

    def segments(q: dict[str, Any]) -> list[tuple[str, bool]]:
        return early_stop(q, observe) if stops_early(q, early_stop_rate, seed) else expert(q, observe)

    return build_sft_examples(tokenizer, questions, segments, prompt_of, progress)


@dataclass(frozen=True)
class SFTConfig:
    """Optimiser settings of the warm-start."""

    steps: int = 600
    batch_size: int = 16
    lr: float = 5e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0


def _batch(examples: Sequence[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, m) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        mask[row, : len(m)] = torch.tensor(m, dtype=torch.float32)
        attn[row, : len(x)] = 1
    return ids, attn, mask


def _length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, rng: random.Random, bucket_batches: int = 8
) -> list[list[int]]:
    """One epoch of batches: shuffle, sort windows of ``bucket_batches`` batches by length, shuffle batches."""
    order = rng.sample(range(len(lengths)), len(lengths))
    window = batch_size * bucket_batches
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return [b for b in batches if len(b) == batch_size] or batches


def masked_nll(model, ids, attn, mask):
    """Mean next-token cross-entropy over positions whose TARGET token has mask 1."""
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1)
    return (nll * m).sum() / m.sum().clamp_min(1.0)


def train_sft(
    model,
    examples: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    cfg: SFTConfig = SFTConfig(),
    progress: bool = True,
) -> list[float]:
    """AdamW with linear warm-up and cosine decay; returns the loss of every step."""
    import torch
    from tqdm.auto import tqdm

    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    batches: list[list[int]] = []
    losses: list[float] = []
    bar = tqdm(range(cfg.steps), desc="warm-start SFT", disable=not progress, mininterval=2)
    for _ in bar:
        if not batches:
            batches = _length_bucketed_batches([len(ids) for ids, _ in examples], cfg.batch_size, rng)
        ids, attn, mask = _batch([examples[i] for i in batches.pop()], pad_id)
        loss = masked_nll(model, ids, attn, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


#: rows of token ids -> the new tokens of each row (a turn: up to and including a stop tag)
GenerateFn = Callable[[list[list[int]]], list[list[int]]]


def hf_greedy_generate(model, tokenizer, max_tokens_per_turn: int = 48, temperature: float = 0.0) -> GenerateFn:
    """Batched ``model.generate`` (:func:`sorl_verl.agent.hf_generate.hf_generate`) of up to
    ``max_tokens_per_turn`` tokens per row, stopping at ``</search>``, ``</answer>``, EOS; greedy
    when ``temperature`` is 0, else plain sampling at that temperature, as an RL rollout samples."""
    from sorl_verl.agent.hf_generate import hf_generate

    generate = hf_generate(model, tokenizer, temperature)
    return lambda rows: generate(rows, [max_tokens_per_turn] * len(rows))


def greedy_rollouts(
    model,
    tokenizer,
    questions: Sequence[dict[str, Any]],
    observe: Observer,
    max_turns: int = 4,
    max_tokens_per_turn: int = 48,
    max_response_tokens: int = 512,
    batch_size: int = 64,
    generate: GenerateFn | None = None,
    temperature: float = 0.0,
    prompt_of: Callable[[dict[str, Any]], str] | None = None,
    max_obs_tokens: int = 512,
) -> list[str]:
    """Multi-turn rollouts with retrieval in the loop; returns each decoded response.

    The turns follow the training agent loop (:mod:`sorl_verl.agent.episode`): a turn is cut at
    its first stop tag; ``</search>`` gets ``information_block(observe(query))`` (escaped, at
    most ``max_obs_tokens`` tokens), an invalid turn the corrective feedback; the episode ends at an
    answer, after ``max_turns`` turns (a search on the last turn is not run) or at
    ``max_response_tokens``. Turns come from ``generate`` (rows -> new tokens per row), by default
    ``model`` greedy, or sampled at ``temperature``, ``max_tokens_per_turn`` tokens at most.
    ``prompt_of(question)`` gives the user message (default ``qa_prompt(question["question"])``).
    """
    from sorl_verl.agent.episode import Episode, EpisodeFormat, EpisodeLimits, run_episodes

    generate = generate or hf_greedy_generate(model, tokenizer, max_tokens_per_turn, temperature)
    limits = EpisodeLimits(max_turns, max_response_tokens, max_tokens_per_turn, max_obs_tokens)
    fmt = EpisodeFormat(tokenizer, limits)
    responses: list[str] = []
    for start in range(0, len(questions), batch_size):
        chunk = questions[start : start + batch_size]
        episodes = [
            Episode(fmt, prompt_ids(tokenizer, q["question"], prompt_of(q) if prompt_of else None)) for q in chunk
        ]
        run_episodes(
            episodes, lambda rows, budgets: [new[:b] for new, b in zip(generate(rows), budgets, strict=True)], observe
        )
        responses += [tokenizer.decode(e.response_ids, skip_special_tokens=False) for e in episodes]
    return responses


def grouped_rates(
    questions: Sequence[dict[str, Any]], scores: Sequence[float], key: str, prefix: str, label: str = "{}"
) -> dict[str, float | int]:
    """Per-group mean score and count: ``{prefix}_{label(v)}`` and ``n_{label(v)}`` for each value ``v`` of
    ``question[key]``, groups in sorted order."""
    out: dict[str, float | int] = {}
    for value in sorted({q[key] for q in questions}):
        group = [s for q, s in zip(questions, scores, strict=True) if q[key] == value]
        out[f"{prefix}_{label.format(value)}"] = sum(group) / len(group)
        out[f"n_{label.format(value)}"] = len(group)
    return out


def warmstart_report(
    model: Any,
    examples: Sequence[tuple[list[int], list[int]]],
    t_data: float,
    t_train: float,
    losses: Sequence[float],
    evals: Any,
) -> dict[str, Any]:
    """The ``warmstart.json`` record of a build: size, token-length quantiles, timings, losses, eval."""
    lens = sorted(len(ids) for ids, _ in examples)
    resp = sorted(len(m) - m.index(1) for _, m in examples)
    return {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_examples": len(examples),
        "example_tokens_p50_max": [lens[len(lens) // 2], lens[-1]],
        "response_tokens_p50_p95_max": [resp[len(resp) // 2], resp[int(len(resp) * 0.95)], resp[-1]],
        "expert_data_seconds": round(t_data, 2),
        "sft_seconds": round(t_train, 2),
        "loss_first10": sum(losses[:10]) / len(losses[:10]),
        "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "eval": evals,
    }
