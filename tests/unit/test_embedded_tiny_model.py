"""The tiny model's spec: tied (default) or untied embeddings, and what a build stamp records of it."""

from __future__ import annotations

from dataclasses import replace

from sorl_verl.embedded.tiny_model import SMOKE_SPEC, TinyModelSpec, build_tiny_qwen2
from sorl_verl.embedded.tokenizer import smoke_tokenizer


def test_untied_embeddings_are_two_matrices_and_add_vocab_times_hidden_parameters() -> None:
    tok = smoke_tokenizer()
    tied = build_tiny_qwen2(tok, SMOKE_SPEC)
    untied = build_tiny_qwen2(tok, replace(SMOKE_SPEC, tie_word_embeddings=False))
    assert tied.get_input_embeddings().weight is tied.get_output_embeddings().weight
    assert untied.get_input_embeddings().weight is not untied.get_output_embeddings().weight
    n_tied, n_untied = (sum(p.numel() for p in m.parameters()) for m in (tied, untied))
    assert n_untied - n_tied == len(tok) * SMOKE_SPEC.hidden_size
    assert untied.config.tie_word_embeddings is False and tied.config.tie_word_embeddings is True


def test_stamp_omits_the_tie_flag_only_while_it_is_the_default() -> None:
    spec = TinyModelSpec()
    assert "tie_word_embeddings" not in spec.stamp()
    assert spec.stamp() == {k: v for k, v in spec.as_dict().items() if k != "tie_word_embeddings"}
    untied = TinyModelSpec(tie_word_embeddings=False)
    assert untied.stamp() == untied.as_dict() and untied.stamp() != spec.stamp()


def test_saving_off_a_terminal_draws_no_library_bar_and_leaves_the_setting_as_it_was(tmp_path, capfd) -> None:
    """transformers' "Writing model shards" bar would put carriage returns into a redirected build log."""
    from transformers.utils import logging as hf_logging

    from sorl_verl.embedded.tiny_model import write_random_model

    assert hf_logging.is_progress_bar_enabled()
    out = write_random_model(tmp_path / "m")
    assert (out / "config.json").is_file()
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "\r" not in err
    assert hf_logging.is_progress_bar_enabled()  # restored for whatever runs next in the process
