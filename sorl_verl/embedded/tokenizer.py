"""Small byte-level BPE tokenizers trained locally (no download), as Hugging Face fast tokenizers.

:func:`train_tokenizer` is the embedded default's tokenizer (below); :func:`smoke_tokenizer` is a
320-token one trained on a few fixed sentences, with ``<pad>``=0, ``<unk>``=1, ``<eos>``=2, for
tests and smoke runs of the rollout engines on a random tiny model
(:func:`sorl_verl.embedded.tiny_model.write_random_model`).

The embedded default's tokenizer: normalizer and pre-tokenizer are Qwen2's (NFC; digits split one by one), because transformers
loads the tokenizer files of a ``qwen2`` model directory as ``Qwen2Tokenizer`` whatever
``tokenizer_config.json`` says, and that class re-imposes them: training with the same
pre-tokenization makes the tokenizer directory and the model directory encode identically.

Special tokens: ``<|pad|>`` (pad), ``<|im_end|>`` (EOS, closes an assistant message; named as
in ChatML because verl's Qwen2 token builder requires a token of that name), and the role
markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``. The agent tags of
:mod:`sorl_verl.agent.prompts` and the two fixed instruction paragraphs are added as whole
(non-special) tokens, so prompts stay short and every tag is one token that decodes back to itself.

Chat template: ``<|user|>{content}`` per user message, ``<|assistant|>{content}<|im_end|>\n`` per
assistant message (the newline after ``<|im_end|>`` is what verl's Qwen builder inserts between
turns), and ``<|assistant|>`` as the generation prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from sorl_verl.agent import prompts

PAD, EOS = "<|pad|>", "<|im_end|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, EOS, SYSTEM, USER, ASSISTANT)
TAG_TOKENS = (
    prompts.THINK_OPEN,
    prompts.THINK_CLOSE,
    prompts.SEARCH_OPEN,
    prompts.SEARCH_CLOSE,
    prompts.INFO_OPEN,
    prompts.INFO_CLOSE,
    prompts.ANSWER_OPEN,
    prompts.ANSWER_CLOSE,
)
PHRASE_TOKENS = (prompts.QA_INSTRUCTION, prompts.MCQ_INSTRUCTION)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + SYSTEM + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}" + EOS + "\n"
    "{% else %}" + USER + "{{ message['content'] }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str], out_dir: str | Path, vocab_size: int = 3000, extra_tokens: Sequence[str] = ()
):
    """Train byte-level BPE on ``texts`` and save a ``PreTrainedTokenizerFast`` to ``out_dir``.

    ``extra_tokens`` are added as whole (non-special) tokens after the agent tags, matched in any
    text before pre-tokenization (e.g. the medical world's option markers ``"\\nA."``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

    # transformers loads the tokenizer of a qwen2 model directory as Qwen2Tokenizer, which imposes
    # Qwen2's normalizer and pre-tokenizer; train with exactly those so both loaders agree
    qwen2 = Qwen2Tokenizer().backend_tokenizer
    tok = Tokenizer(models.BPE())
    tok.normalizer = qwen2.normalizer
    tok.pre_tokenizer = qwen2.pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    added = TAG_TOKENS + PHRASE_TOKENS + tuple(extra_tokens)
    tok.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        model_max_length=4096,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


SMOKE_CORPUS = (
    "the cat sat on the mat and looked at the dog",
    "a dog ran in the park with a red ball",
    "<search> who wrote the book </search>",
    "<information> the book was written by ana </information>",
    "<answer> paris </answer>",
    "question: what is the capital of france? answer: paris",
)
SMOKE_SPECIAL_TOKENS = ("<pad>", "<unk>", "<eos>")


def smoke_tokenizer(corpus: tuple[str, ...] = SMOKE_CORPUS, vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``<pad>``=0, ``<unk>``=1, ``<eos>``=2 (not saved)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SMOKE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
