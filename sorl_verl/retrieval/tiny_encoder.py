"""The project's tiny local dense encoder: a real SentenceTransformer made on this machine, no download.

A randomly initialised BERT (``layers`` layers, ``hidden`` wide) over a word-level vocabulary of
the given words, with mean pooling. Untrained: its embeddings carry word overlap only through
the random word vectors, which is enough to exercise and benchmark the dense plumbing (prefixes,
normalization, faiss, server batching) where e5 cannot be downloaded. Deterministic for a seed.
Needs the ``dense`` extra (sentence-transformers).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def make_tiny_encoder(
    out_dir: str | Path,
    words: Iterable[str],
    *,
    hidden: int = 32,
    layers: int = 1,
    max_seq_length: int = 48,
    seed: int = 0,
) -> Path:
    """Save a tiny SentenceTransformer to ``out_dir/st`` and return that path.

    ``words``: the vocabulary (lower-cased; ``query``, ``passage`` and ``:`` are added for the
    e5 prefixes); any other word maps to ``[UNK]``.
    """
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out_dir = Path(out_dir)
    vocab = sorted({w.lower() for w in words} | {"query", "passage", ":"} - set(SPECIAL_TOKENS))
    bert_dir = out_dir / "bert"
    bert_dir.mkdir(parents=True, exist_ok=True)
    (bert_dir / "vocab.txt").write_text("\n".join([*SPECIAL_TOKENS, *vocab]) + "\n", encoding="utf-8")
    vocab_arg = "vocab" if "vocab" in inspect.signature(BertTokenizerFast.__init__).parameters else "vocab_file"
    tokenizer = BertTokenizerFast(**{vocab_arg: str(bert_dir / "vocab.txt")}, do_lower_case=True)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab) + len(SPECIAL_TOKENS), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=max(64, max_seq_length),
    )  # fmt: skip
    BertModel(config).save_pretrained(bert_dir)
    tokenizer.save_pretrained(bert_dir)
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer
    word = Transformer(str(bert_dir), max_seq_length=max_seq_length)
    dim = (
        word.get_embedding_dimension()
        if hasattr(word, "get_embedding_dimension")
        else word.get_word_embedding_dimension()
    )
    SentenceTransformer(modules=[word, Pooling(dim, pooling_mode="mean")], device="cpu").save(str(out_dir / "st"))
    return out_dir / "st"
