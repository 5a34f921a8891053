"""The locally trained tokenizer: round trip, whole-token tags, compact prompts, chat template."""

from __future__ import annotations

import pytest

from sorl_verl.agent import prompts
from sorl_verl.embedded.qa_world import generate_world
from sorl_verl.embedded.tokenizer import ASSISTANT, EOS, PAD, TAG_TOKENS, USER, train_tokenizer


@pytest.fixture(scope="module")
def world():
    return generate_world(seed=5, num_entities=40)


@pytest.fixture(scope="module")
def tokenizer(world, tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    texts = [d["contents"] for d in world.corpus] + [prompts.qa_prompt(q["question"]) for q in world.questions["train"]]
    train_tokenizer(texts, out, vocab_size=1500)
    return AutoTokenizer.from_pretrained(out)  # what verl loads: the saved files, not the trainer's object


def test_round_trip_of_agent_text(tokenizer, world) -> None:
    doc = world.corpus[3]["contents"]
    text = (f"{prompts.THINK_OPEN} I need to search Zyx Qor. {prompts.THINK_CLOSE}\n<search> Zyx Qor </search>"
            + prompts.information_block(doc) + "<answer> 1907 </answer> ünïcode ✓")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tags_are_single_tokens_and_special_tokens_set(tokenizer) -> None:
    for tag in TAG_TOKENS:
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tokenizer.decode(ids) == tag
    assert tokenizer.eos_token == EOS and tokenizer.pad_token == PAD
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=True) == ""


def test_chat_template_and_compact_prompt(tokenizer, world) -> None:
    q = world.questions["val"][0]["question"]
    messages = [{"role": "user", "content": prompts.qa_prompt(q)}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"{USER}{prompts.qa_prompt(q)}{ASSISTANT}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) <= len(q.split()) * 3 + 8, "the fixed instruction must encode compactly"
    assert ids[0] == tokenizer.convert_tokens_to_ids(USER) and ids[-1] == tokenizer.convert_tokens_to_ids(ASSISTANT)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "<answer> x </answer>"}],
                                         tokenize=False)
    assert full == f"{USER}{prompts.qa_prompt(q)}{ASSISTANT}<answer> x </answer>{EOS}\n"
    assert EOS == "<|im_end|>" and len(tokenizer("\n", add_special_tokens=False)["input_ids"]) == 1  # verl Qwen builder


def test_names_encode_in_few_tokens(tokenizer, world) -> None:
    people = [e.name for e in world.entities.values() if e.kind == "person"]
    lengths = [len(tokenizer(" " + n, add_special_tokens=False)["input_ids"]) for n in people]
    assert sum(lengths) / len(lengths) <= 3.0



def test_model_directory_loads_the_same_tokenization(tokenizer, world, tmp_path_factory) -> None:
    """transformers loads a qwen2 model dir's tokenizer as Qwen2Tokenizer; ids must not change."""
    from transformers import AutoTokenizer, Qwen2Config

    model_dir = tmp_path_factory.mktemp("model")
    tokenizer.save_pretrained(model_dir)
    Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(model_dir)
    as_model = AutoTokenizer.from_pretrained(model_dir)
    text = (prompts.qa_prompt(world.questions["val"][0]["question"]) + "<think> born in 1907 </think>"
            + prompts.information_block(world.corpus[0]["contents"] + " Doc 1(Title: x) 2024, 3.5 ü"))
    assert as_model(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert as_model.eos_token_id == tokenizer.eos_token_id and as_model.pad_token_id == tokenizer.pad_token_id


def test_extra_tokens_make_each_option_marker_one_token(tokenizer, world, tmp_path) -> None:
    """``extra_tokens`` (the medical option markers ``\\nA.``..): each marker of an MCQ prompt is one
    token that no other line shares, the option text is encoded as without them, and text round-trips."""
    from transformers import AutoTokenizer

    # the option markers of an MCQ prompt (prompts.mcq_prompt), as whole tokens
    OPTION_MARKERS = tuple(f"\n{letter}." for letter in "ABCDE")  # noqa: N806

    texts = [d["contents"] for d in world.corpus] + [prompts.qa_prompt(q["question"]) for q in world.questions["train"]]
    train_tokenizer(texts, tmp_path, vocab_size=1500, extra_tokens=OPTION_MARKERS)
    marked = AutoTokenizer.from_pretrained(tmp_path)
    names = [e.name for e in world.entities.values()][:5]
    options = dict(zip("ABCDE", names, strict=True))
    text = prompts.mcq_prompt("Which one?", options)
    ids = marked(text, add_special_tokens=False)["input_ids"]
    assert marked.decode(ids) == text
    marker_ids = [marked.convert_tokens_to_ids(m) for m in OPTION_MARKERS]
    assert len(set(marker_ids)) == 5 and all(ids.count(m) == 1 for m in marker_ids)
    for marker, (letter, name) in zip(marker_ids, options.items(), strict=True):
        after = ids[ids.index(marker) + 1 :][: len(marked(" " + name, add_special_tokens=False)["input_ids"])]
        assert marked.decode(after) == " " + name, letter
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(plain) - 5 * (len(tokenizer("\nA.", add_special_tokens=False)["input_ids"]) - 1)
