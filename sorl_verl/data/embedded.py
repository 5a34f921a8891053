"""The embedded default: everything a CPU-only, offline machine needs to run the search agent.

``ensure_embedded_default(root)`` builds what is missing under ``root`` (default
``data_home()/"embedded"``); each step is skipped when its ``.stamp.json`` matches a hash of
its inputs (its parameters and the stamps of the steps it reads), so changing a parameter
rebuilds that step and everything downstream::

    world/      corpus.jsonl, {train,val,test}.jsonl         (synthetic_world.generate_world)
    data/       {split}.parquet and {split}_{k}hop.parquet    (verl rows, data_source synthetic_{k}hop)
    index/      BM25 index of the corpus                      (sorl_verl.retrieval.build.build_index)
    tokenizer/  byte-level BPE + chat template                (tiny_tokenizer.train_tokenizer)
    model/      tiny Qwen2ForCausalLM, SFT warm-started on expert search trajectories,
                plus tokenizer files and warmstart.json (losses, timings, greedy EM on val)
    report.json build seconds of each step and the warm-start evaluation
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sorl_verl.data.tiny_model import TinyModelSpec
from sorl_verl.data.warmstart import Observer, SFTConfig, warmstart_report

#: bump when the content a step produces changes for the same parameters
BUILD_VERSION = 3  # 2: EOS named <|im_end|>; 3: Qwen2 pre-tokenization
TOPK = 3


@dataclass(frozen=True)
class EmbeddedConfig:
    """Parameters of every build step (all enter the stamps)."""

    seed: int = 0
    num_entities: int = 200
    num_val_per_hop: int = 100
    num_test_per_hop: int = 100
    vocab_size: int = 3000
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sft_max_hops: int = 2
    eval_per_hop: int = 100
    eval_hops: tuple[int, ...] = (1, 2)
    topk: int = TOPK
    #: torch threads for SFT and evaluation; 1 is fastest on a shared 2-core machine (10x under load)
    num_threads: int = 1


@dataclass(frozen=True)
class EmbeddedPaths:
    """Where the built artefacts are."""

    root: Path
    corpus: Path
    questions: dict[str, Path]  # split -> jsonl
    parquet: dict[str, Path]  # "train", "val", "test", "train_1hop", ... -> parquet
    index_dir: Path
    tokenizer_dir: Path
    model_dir: Path
    report: Path


def default_root() -> Path:
    from sorl_verl.paths import data_home

    return data_home() / "embedded"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _stamp_of(path: Path) -> str | None:
    f = path / ".stamp.json"
    return json.loads(f.read_text())["inputs"] if f.is_file() else None


def _run_step(name: str, out: Path, inputs: dict[str, Any], build: Callable[[Path], None], force: bool,
              timings: dict[str, float]) -> str:
    """Run ``build(tmp_dir)`` unless ``out`` holds a stamp of the same inputs; returns the stamp."""
    stamp = _digest({"step": name, "version": BUILD_VERSION, **inputs})
    if not force and _stamp_of(out) == stamp:
        return stamp
    print(f"[embedded] building {name} -> {out}", flush=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # concurrent builders never share a tmp dir
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    build(tmp)
    timings[name] = round(time.perf_counter() - t0, 2)
    (tmp / ".stamp.json").write_text(json.dumps({"inputs": stamp, "seconds": timings[name]}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[embedded] {name} done in {timings[name]:.1f}s", flush=True)
    return stamp


def make_observer(index_dir: str | Path, topk: int = TOPK) -> Observer:
    """In-process retrieval giving exactly the observation text the retrieval client produces."""
    from sorl_verl.retrieval.client import format_documents
    from sorl_verl.retrieval.index import load_searcher

    searcher = load_searcher(index_dir)

    def observe(queries: list[str]) -> list[str]:
        return [format_documents(hits) for hits in searcher.search(list(queries), topk)] if queries else []

    return observe


def _paths(root: Path) -> EmbeddedPaths:
    splits = ("train", "val", "test")
    parquet = {s: root / "data" / f"{s}.parquet" for s in splits}
    parquet.update({f"{s}_{k}hop": root / "data" / f"{s}_{k}hop.parquet" for s in splits for k in (1, 2, 3)})
    return EmbeddedPaths(
        root=root, corpus=root / "world" / "corpus.jsonl",
        questions={s: root / "world" / f"{s}.jsonl" for s in splits},
        parquet=parquet, index_dir=root / "index", tokenizer_dir=root / "tokenizer",
        model_dir=root / "model", report=root / "report.json",
    )


def ensure_embedded_default(root: str | Path | None = None, force: bool = False,
                            config: EmbeddedConfig | None = None, progress: bool = True) -> EmbeddedPaths:
    """Build (or reuse) the embedded default under ``root``; ``force`` rebuilds every step."""
    from sorl_verl.data.synthetic_world import generate_world, questions_to_parquet, read_jsonl, write_world

    cfg = config or EmbeddedConfig()
    root = Path(root) if root is not None else default_root()
    root.mkdir(parents=True, exist_ok=True)
    paths = _paths(root)
    timings: dict[str, float] = {}

    def build_world(tmp: Path) -> None:
        world = generate_world(cfg.seed, cfg.num_entities, cfg.num_val_per_hop, cfg.num_test_per_hop)
        write_world(world, tmp)

    world_stamp = _run_step("world", root / "world",
                            {"seed": cfg.seed, "n": cfg.num_entities, "val": cfg.num_val_per_hop,
                             "test": cfg.num_test_per_hop}, build_world, force, timings)
    questions = {s: read_jsonl(p) for s, p in paths.questions.items()}

    def build_data(tmp: Path) -> None:
        for split, qs in questions.items():
            questions_to_parquet(qs, tmp / f"{split}.parquet", split)
            for k in (1, 2, 3):
                questions_to_parquet([q for q in qs if q["hops"] == k], tmp / f"{split}_{k}hop.parquet", split)

    _run_step("data", root / "data", {"world": world_stamp}, build_data, force, timings)

    def build_index_step(tmp: Path) -> None:
        from sorl_verl.retrieval.build import build_index

        build_index(paths.corpus, tmp / "bm25", overwrite=True, show_progress=progress)
        for f in (tmp / "bm25").iterdir():
            f.rename(tmp / f.name)
        (tmp / "bm25").rmdir()

    index_stamp = _run_step("index", paths.index_dir, {"world": world_stamp}, build_index_step, force, timings)

    def build_tokenizer(tmp: Path) -> None:
        from sorl_verl.agent.prompts import qa_prompt
        from sorl_verl.data.tiny_tokenizer import train_tokenizer

        corpus = read_jsonl(paths.corpus)
        texts = [d["contents"] for d in corpus] + [qa_prompt(q["question"]) for q in questions["train"]]
        train_tokenizer(texts, tmp, vocab_size=cfg.vocab_size)

    tok_stamp = _run_step("tokenizer", paths.tokenizer_dir, {"world": world_stamp, "vocab": cfg.vocab_size},
                          build_tokenizer, force, timings)

    def build_model(tmp: Path) -> None:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.num_threads)
        try:
            _build_model(tmp)
        finally:
            torch.set_num_threads(threads)

    def _build_model(tmp: Path) -> None:
        from transformers import AutoTokenizer

        from sorl_verl.data.tiny_model import build_tiny_qwen2, save_model
        from sorl_verl.data.warmstart import build_sft_examples, evaluate_em, train_sft

        tok = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
        observe = make_observer(paths.index_dir, cfg.topk)
        t0 = time.perf_counter()
        examples = build_sft_examples(tok, [q for q in questions["train"] if q["hops"] <= cfg.sft_max_hops],
                                      observe, progress=progress)
        t_data = time.perf_counter() - t0
        model = build_tiny_qwen2(tok, cfg.model, seed=cfg.seed)
        t0 = time.perf_counter()
        losses = train_sft(model, examples, tok.pad_token_id, cfg.sft, progress=progress)
        t_train = time.perf_counter() - t0
        evalset = [q for k in cfg.eval_hops for q in [q for q in questions["val"] if q["hops"] == k][: cfg.eval_per_hop]]
        ev = evaluate_em(model, tok, evalset, observe)
        save_model(model, tok, tmp)
        report = warmstart_report(model, examples, t_data, t_train, losses, ev)
        (tmp / "warmstart.json").write_text(json.dumps(report, indent=1))
        print(f"[embedded] warm-start: loss {report['loss_first10']:.3f} -> {report['loss_last10']:.3f}; greedy EM "
              + ", ".join(f"{k}={v:.2f}" for k, v in ev.items() if k.startswith("em")), flush=True)

    _run_step("model", paths.model_dir,
              {"tokenizer": tok_stamp, "index": index_stamp, "spec": asdict(cfg.model), "sft": asdict(cfg.sft),
               "max_hops": cfg.sft_max_hops, "eval": [cfg.eval_per_hop, list(cfg.eval_hops)], "topk": cfg.topk},
              build_model, force, timings)

    if timings:
        old = json.loads(paths.report.read_text()) if paths.report.is_file() else {}
        old.setdefault("build_seconds", {}).update(timings)
        ws = paths.model_dir / "warmstart.json"
        if ws.is_file():
            old["warmstart"] = json.loads(ws.read_text())
        paths.report.write_text(json.dumps(old, indent=1))
    return paths
