"""Model turns from a Hugging Face causal LM, batched, for the episode core
(:mod:`sorl_verl.agent.episode`): ``sorl-verl eval --model`` and the warm-start rollouts.

Rows are left-padded into one ``model.generate`` call of ``max(budgets)`` new tokens, greedy at
temperature 0, else plain sampling at that temperature (no top-k / top-p, as an RL rollout
samples). Generation stops at EOS (the tokenizer's and the model's generation config's) and at
the stop tags: as token ids where a tag is one token, else by a text check of each row. Each
row's new tokens are cut after its first stop id (pad tokens before any other token skipped) and
to its budget; cutting at the first stop tag written over several tokens is the episode's job.
"""

from __future__ import annotations

from typing import Any

from sorl_verl.agent.actions import first_stop
from sorl_verl.agent.episode import GenerateBatch
from sorl_verl.agent.prompts import STOP_SEQUENCES


def stop_token_ids(tokenizer: Any, model: Any = None) -> set[int]:
    """EOS ids and the ids of the stop tags that are single tokens of ``tokenizer``."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops |= set(model_eos if isinstance(model_eos, list) else [model_eos] if model_eos is not None else [])
    for tag in STOP_SEQUENCES:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1:
            stops.add(ids[0])
    return stops


def multi_token_tags(tokenizer: Any) -> bool:
    """Whether some stop tag takes more than one token (then a text check must stop generation)."""
    return any(len(tokenizer.encode(tag, add_special_tokens=False)) > 1 for tag in STOP_SEQUENCES)


def turn_tokens(new: list[int], stops: set[int], pad_id: int | None) -> list[int]:
    """A row's generated tokens up to and including its first stop id; pads before any token skipped."""
    out: list[int] = []
    for t in new:
        if t == pad_id and not out:
            continue
        out.append(t)
        if t in stops:
            break
    return out


def hf_generate(model: Any, tokenizer: Any, temperature: float = 0.0) -> GenerateBatch:
    """A :data:`~sorl_verl.agent.episode.GenerateBatch` running ``model.generate`` (module docstring)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    stops = stop_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    by_text = multi_token_tags(tokenizer)

    class StopAtTag(StoppingCriteria):
        """Per row: a stop tag in the text generated after ``start``."""

        def __init__(self, start: int) -> None:
            self.start = start

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:  # noqa: ARG002 - transformers' API
            rows = input_ids[:, self.start :].tolist()
            hit = [first_stop(tokenizer.decode(r, skip_special_tokens=False)) is not None for r in rows]
            return torch.tensor(hit, dtype=torch.bool, device=input_ids.device)

    def generate(rows: list[list[int]], budgets: list[int]) -> list[list[int]]:
        width = max(map(len, rows))
        device = next(model.parameters()).device
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        criteria = StoppingCriteriaList([StopAtTag(width)] if by_text else [])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max(budgets),
                eos_token_id=sorted(stops),
                pad_token_id=pad,
                stopping_criteria=criteria,
                **sampling,
            )
        return [turn_tokens(out[row, width:].tolist(), stops, pad)[:budget] for row, budget in enumerate(budgets)]

    return generate
