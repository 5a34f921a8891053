"""The one tiny-Qwen2 builder: the embedded default's warm-start model and the random models of tests.

``build_tiny_qwen2(tokenizer, spec)`` is a randomly initialised ``Qwen2ForCausalLM`` sized to a
locally trained tokenizer. The default :class:`TinyModelSpec` (hidden 128, 4 layers, 4 heads / 2
KV heads, MLP 512, tied embeddings) gives about 1.2 M parameters: small enough for verl's trainer
and a transformers rollout on 2 CPU cores. :func:`write_random_model` writes a still smaller random
model (:data:`SMOKE_SPEC`) with :func:`sorl_verl.embedded.tokenizer.smoke_tokenizer` to a
transformers-loadable directory, for tests and smoke runs of the rollout engines.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture knobs of the tiny model (everything else is Qwen2's default)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    #: one matrix for input and output embeddings (Qwen2.5's small models) or two (its 7B)
    tie_word_embeddings: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def stamp(self) -> dict[str, Any]:
        """What a build stamp records: :meth:`as_dict` without ``tie_word_embeddings`` while it is the
        default, so builds stamped before the field existed are still recognised."""
        d = self.as_dict()
        if d["tie_word_embeddings"]:
            del d["tie_word_embeddings"]
        return d


#: the random models of tests: hidden 64, 2 layers, MLP 128
SMOKE_SPEC = TinyModelSpec(hidden_size=64, num_hidden_layers=2, intermediate_size=128, max_position_embeddings=512)


def build_tiny_qwen2(tokenizer, spec: TinyModelSpec | None = None, seed: int = 0, initializer_range: float = 0.02):
    """Fresh ``Qwen2ForCausalLM`` whose vocabulary, EOS and pad match ``tokenizer``.

    Weights are drawn after ``torch.manual_seed(seed)`` with std ``initializer_range`` (Qwen2's 0.02
    by default).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        initializer_range=initializer_range,
        **spec.as_dict(),
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def save_model(model, tokenizer, out_dir: str | Path, max_new_tokens: int = 256) -> Path:
    """``save_pretrained`` model + tokenizer + generation_config (greedy by default) to ``out_dir``."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    with _library_bars_only_on_a_terminal():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextlib.contextmanager
def _library_bars_only_on_a_terminal() -> Iterator[None]:
    """transformers' own bars ("Writing model shards") only when stderr is a terminal; restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def write_random_model(out_dir: str | Path, *, seed: int = 0, initializer_range: float = 0.3, **spec: Any) -> Path:
    """Write a random tiny Qwen2 (:data:`SMOKE_SPEC` with ``spec`` overrides) and the smoke tokenizer to ``out_dir``.

    The large default ``initializer_range`` gives peaked next-token distributions (varied greedy
    outputs, no near-ties), unlike the near-uniform ones of a 0.02 init.
    """
    from sorl_verl.embedded.tokenizer import smoke_tokenizer

    tokenizer = smoke_tokenizer()
    model = build_tiny_qwen2(tokenizer, replace(SMOKE_SPEC, **spec), seed=seed, initializer_range=initializer_range)
    return save_model(model, tokenizer, out_dir)
