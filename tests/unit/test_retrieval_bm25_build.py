"""Bounded-memory BM25 build: byte-identical to an in-memory build, whatever the budget; clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from sorl_verl.retrieval import bm25_build
from sorl_verl.retrieval.bm25 import BM25_FILES, DATA_FILE, INDICES_FILE, INDPTR_FILE, VOCAB_FILE, bm25_params
from sorl_verl.retrieval.build import _show_progress, build_index, main
from sorl_verl.retrieval.corpus import CorpusFormatError

WORDS = [f"t{i}q" for i in range(400)] + ["river", "rivers", "the", "of", "mountain"]


def _corpus(path: Path, n: int = 900, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    with open(path, "w") as f:
        for i in range(n):
            words = rng.choices(WORDS, weights=[1 / (r + 1) for r in range(len(WORDS))], k=rng.randint(0, 60))
            docs.append(f'"Doc {i}"\n' + " ".join(words))
            f.write(json.dumps({"id": str(i), "contents": docs[-1]}) + "\n")
    return docs


def in_memory_reference(docs: list[str], params: dict) -> dict[str, bytes]:
    """The index arrays computed with every posting in memory at once (the build before runs existed)."""
    stems, lengths, keys, tf = bm25_build.analyze_chunk(docs, params["stopwords"], params["stemmer"])
    terms, doc_ids = (keys & 0xFFFFFFFF).astype(np.int32), (keys >> 32).astype(np.int32)
    n, v = len(docs), len(stems)
    tf, lengths = tf.astype(np.float32), lengths.astype(np.float32)
    df = np.bincount(terms, minlength=v).astype(np.float64)
    idf = np.log1p((n - df + 0.5) / (df + 0.5)).astype(np.float32)
    avgdl = float(lengths.mean()) if n and lengths.sum() > 0 else 1.0
    norm = (params["k1"] * (1.0 - params["b"] + params["b"] * lengths / avgdl)).astype(np.float32)
    scores = idf[terms] * tf / (tf + norm[doc_ids])
    order = np.argsort(terms, kind="stable")
    indptr = np.zeros(v + 1, dtype=np.int64)
    np.cumsum(df.astype(np.int64), out=indptr[1:])
    return {"data": scores[order].astype(np.float32).tobytes(), "indices": doc_ids[order].tobytes(),
            "indptr": indptr.tobytes(), "vocab": json.dumps(dict(zip(stems, range(v), strict=True)))}  # fmt: skip


def _arrays(index: Path) -> dict[str, bytes]:
    return {"data": np.load(index / DATA_FILE).tobytes(), "indices": np.load(index / INDICES_FILE).tobytes(),
            "indptr": np.load(index / INDPTR_FILE).tobytes(), "vocab": (index / VOCAB_FILE).read_text()}  # fmt: skip


@pytest.mark.parametrize(("memory_mb", "workers"), [(None, 1), (0.01, 1), (0.05, 2)])
def test_any_budget_gives_the_in_memory_index_byte_for_byte(
    tmp_path: Path, memory_mb: float | None, workers: int
) -> None:
    docs = _corpus(tmp_path / "c.jsonl")
    index = build_index(tmp_path / "c.jsonl", tmp_path / "i", show_progress=False, memory_mb=memory_mb, workers=workers)
    assert _arrays(index) == in_memory_reference(docs, bm25_params())
    assert not list(index.rglob("*.docs")) and not (index / bm25_build.RUNS_DIR).exists()  # runs are removed


def test_small_budget_writes_many_runs_and_blocks(tmp_path: Path) -> None:
    docs = _corpus(tmp_path / "c.jsonl", n=300)
    merged: list[int] = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.total, self.desc = total, desc

        def update(self, k: int) -> None:
            merged.append(k)

        def close(self) -> None:
            merged.append(-self.total)

    runs_seen: list[int] = []
    original = bm25_build.BM25Builder._merge

    def spy(self: bm25_build.BM25Builder, out_dir: Path, progress: object) -> None:
        runs_seen.append(len(self.runs))
        original(self, out_dir, progress)

    out = tmp_path / "i"
    out.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bm25_build.BM25Builder, "_merge", spy)
        n = bm25_build.build_bm25(docs, out, bm25_params(), memory_mb=0.005, progress_factory=Bar)
    total = int(np.load(out / INDPTR_FILE)[-1])
    assert n == 300 and runs_seen[0] > 5
    assert len(merged) > 3 and sum(merged[:-1]) == total and merged[-1] == -total  # progress covers every posting


def test_counts_over_65535_in_one_passage(tmp_path: Path) -> None:
    docs = ['"Big"\n' + "river " * 70_000 + "mountain", '"Small"\nriver mountain the', '"None"\nof the']
    with open(tmp_path / "c.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"contents": d}) + "\n")
    index = build_index(tmp_path / "c.jsonl", tmp_path / "i", show_progress=False, memory_mb=0.0001)
    assert _arrays(index) == in_memory_reference(docs, bm25_params())


def test_lone_surrogate_is_one_clear_error_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"contents": "fine"}\n{"contents": "broken \\ud83d here"}\n')
    with pytest.raises(CorpusFormatError, match=r"bad\.jsonl line 2: 'contents' has a lone surrogate.*ud83d"):
        build_index(corpus, tmp_path / "i", show_progress=False)
    with pytest.raises(SystemExit) as e:
        main(["--corpus", str(corpus), "--out", str(tmp_path / "cli"), "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl line 2" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no index, no temporary directory
    corpus.write_bytes(b'{"contents": "ok"}\n{"contents": "caf\xe9"}\n')
    with pytest.raises(CorpusFormatError, match=r"bad\.jsonl line 2: invalid JSON"):
        build_index(corpus, tmp_path / "i", show_progress=False)


def test_files_are_the_bm25s_set(tmp_path: Path) -> None:
    _corpus(tmp_path / "c.jsonl", n=50)
    index = build_index(tmp_path / "c.jsonl", tmp_path / "i", show_progress=False, memory_mb=0.001)
    assert set(BM25_FILES) <= {p.name for p in index.iterdir()}
    with pytest.raises(ValueError, match="memory_mb"):
        build_index(tmp_path / "c.jsonl", tmp_path / "j", show_progress=False, memory_mb=-1)


def test_cli_draws_progress_bars_only_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No flag: bars only when stderr is a TTY (capsys's is not), so redirected logs hold no ``\\r``."""
    _corpus(tmp_path / "c.jsonl", n=50)
    main(["--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "quiet")])
    assert "\r" not in capsys.readouterr().err
    main(["--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "bars"), "--progress"])
    assert "index bm25" in capsys.readouterr().err  # asked for: drawn even off a terminal


def test_show_progress_follows_the_flag_then_the_stream() -> None:
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    assert _show_progress(None, Stream(True)) and not _show_progress(None, Stream(False))
    assert _show_progress(True, Stream(False)) and not _show_progress(False, Stream(True))
