"""The QA embedded default: everything a CPU-only, offline machine needs to run the search agent.

``ensure_embedded_default(root)`` builds what is missing under ``root`` (default
``data_home()/"embedded"``); each step is skipped when its ``.stamp.json`` matches a hash of
its inputs (its parameters and the stamps of the steps it reads), so changing a parameter
rebuilds that step and everything downstream (:mod:`sorl_verl.embedded.steps`)::

    world/      corpus.jsonl, {train,val,test}.jsonl         (qa_world.generate_world)
    data/       {split}.parquet and {split}_{k}hop.parquet    (verl rows, data_source synthetic_{k}hop)
    index/      BM25 index of the corpus                      (sorl_verl.retrieval.build.build_index)
    tokenizer/  byte-level BPE + chat template                (tokenizer.train_tokenizer)
    model/      tiny Qwen2ForCausalLM, SFT warm-started on expert search trajectories,
                plus tokenizer files and warmstart.json (losses, timings, greedy EM on val)
    report.json build seconds of each step and the warm-start evaluation

Progress goes to stderr.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sorl_verl.embedded.steps import (
    EmbeddedPaths,
    build_bm25_step,
    build_lock,
    build_tokenizer_step,
    log,
    named_warmstart,
    record_build,
    run_step,
    task_paths,
    torch_threads,
    warmstart_root,
)
from sorl_verl.embedded.tiny_model import TinyModelSpec
from sorl_verl.embedded.warmstart import TOPK, SFTConfig

#: bump when the content a step produces changes for the same parameters
BUILD_VERSION = 3  # 2: EOS named <|im_end|>; 3: Qwen2 pre-tokenization
TAG = "embedded"
SPLITS = ("train", "val", "test")
HOP_GROUPS = ("1hop", "2hop", "3hop")


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
    #: share of multi-hop demonstrations that stop after the first search (qa_trajectories.early_stop_segments)
    early_stop_rate: float = 0.0
    eval_per_hop: int = 100
    eval_hops: tuple[int, ...] = (1, 2)
    topk: int = TOPK
    #: torch threads for SFT and evaluation; 1 is fastest on a shared 2-core machine (10x under load)
    num_threads: int = 1


#: named warm-starts of the QA embedded default -> ``early_stop_rate`` of their demonstrations.
#: ``expert`` (default): every demonstration is the expert's (the demo's, the study's, the tests');
#: ``early-stop``: 60 % of the multi-hop ones stop after one search, so that RL has one decision
#: to learn (search again; the demo gained in 3 of 3 seeds on AVX-512, 0 of 3 on AVX2 kernels);
#: ``early-stop-50`` (the QA demo's default): 50 %, which samples a second-search success on 2-hop
#: questions 2.5-3x as often at T = 1 while greedy still stops (the demo gained in 6 of 6 seeds on
#: both; docs/results.md, "The main job learns")
WARM_STARTS: dict[str, float] = {"expert": 0.0, "early-stop": 0.6, "early-stop-50": 0.5}


def default_root(warmstart: str = "expert") -> Path:
    """``data_home()/embedded`` for the expert warm-start, ``embedded-<name>`` for another one."""
    return warmstart_root("embedded", WARM_STARTS, warmstart)


def warmstart_config(warmstart: str) -> EmbeddedConfig:
    """The build parameters of a named warm-start (the defaults but ``early_stop_rate``)."""
    return EmbeddedConfig(early_stop_rate=named_warmstart(WARM_STARTS, warmstart))


def qa_paths(root: str | Path) -> EmbeddedPaths:
    """The layout under ``root`` (whether built or not)."""
    return task_paths(root, SPLITS, HOP_GROUPS)


def ensure_embedded_default(
    root: str | Path | None = None, force: bool = False, config: EmbeddedConfig | None = None, progress: bool = True
) -> EmbeddedPaths:
    """Build (or reuse) the embedded default under ``root``; ``force`` rebuilds every step.

    Holds ``root``'s build lock (:func:`~sorl_verl.embedded.steps.build_lock`) throughout, so a caller
    that comes while another process builds waits for that build and then reuses it.
    """
    cfg = config or EmbeddedConfig()
    root = Path(root) if root is not None else default_root()
    with build_lock(root):
        return _build(root, cfg, force, progress)


def _build(root: Path, cfg: EmbeddedConfig, force: bool, progress: bool) -> EmbeddedPaths:
    from sorl_verl.embedded.qa_world import generate_world, questions_to_parquet
    from sorl_verl.embedded.world import read_jsonl, write_world

    paths = qa_paths(root)
    timings: dict[str, float] = {}

    def step(name: str, out: Path, inputs: dict[str, Any], build) -> str:
        return run_step(name, out, {"version": BUILD_VERSION, **inputs}, build, force=force, timings=timings, tag=TAG)

    def build_world(tmp: Path) -> None:
        write_world(generate_world(cfg.seed, cfg.num_entities, cfg.num_val_per_hop, cfg.num_test_per_hop), tmp)

    world_stamp = step("world", root / "world", {"seed": cfg.seed, "n": cfg.num_entities, "val": cfg.num_val_per_hop,
                                                 "test": cfg.num_test_per_hop}, build_world)  # fmt: skip
    questions = {s: read_jsonl(p) for s, p in paths.questions.items()}

    def build_data(tmp: Path) -> None:
        for split, qs in questions.items():
            questions_to_parquet(qs, tmp / f"{split}.parquet", split)
            for k in (1, 2, 3):
                questions_to_parquet([q for q in qs if q["hops"] == k], tmp / f"{split}_{k}hop.parquet", split)

    step("data", root / "data", {"world": world_stamp}, build_data)
    index_stamp = step("index", paths.index_dir, {"world": world_stamp}, build_bm25_step(paths.corpus, progress))

    def prompts() -> list[str]:
        from sorl_verl.agent.prompts import qa_prompt

        return [qa_prompt(q["question"]) for q in questions["train"]]

    tok_stamp = step("tokenizer", paths.tokenizer_dir, {"world": world_stamp, "vocab": cfg.vocab_size},
                     build_tokenizer_step(paths.corpus, prompts, cfg.vocab_size))  # fmt: skip

    def build_model(tmp: Path) -> None:
        with torch_threads(cfg.num_threads):
            _warm_start(cfg, paths, questions, tmp, progress)

    # early_stop enters the stamp only when set, so the expert builds made before it existed stay valid
    step("model", paths.model_dir,
         {"tokenizer": tok_stamp, "index": index_stamp, "spec": cfg.model.stamp(), "sft": asdict(cfg.sft),
          "max_hops": cfg.sft_max_hops, **({"early_stop": cfg.early_stop_rate} if cfg.early_stop_rate else {}), "eval": [cfg.eval_per_hop, list(cfg.eval_hops)], "topk": cfg.topk},
         build_model)  # fmt: skip
    record_build(paths, timings)
    return paths


def _warm_start(
    cfg: EmbeddedConfig, paths: EmbeddedPaths, questions: dict[str, list[dict[str, Any]]], out: Path, progress: bool
) -> None:
    from transformers import AutoTokenizer

    from sorl_verl.embedded.qa_trajectories import build_qa_sft_examples, evaluate_em
    from sorl_verl.embedded.tiny_model import build_tiny_qwen2, save_model
    from sorl_verl.embedded.warmstart import make_observer, train_sft, warmstart_report

    tok = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
    observe = make_observer(paths.index_dir, cfg.topk)
    t0 = time.perf_counter()
    examples = build_qa_sft_examples(tok, [q for q in questions["train"] if q["hops"] <= cfg.sft_max_hops], observe,
                                     progress=progress, early_stop_rate=cfg.early_stop_rate, seed=cfg.seed)  # fmt: skip
    t_data = time.perf_counter() - t0
    model = build_tiny_qwen2(tok, cfg.model, seed=cfg.seed)
    t0 = time.perf_counter()
    losses = train_sft(model, examples, tok.pad_token_id, cfg.sft, progress=progress)
    t_train = time.perf_counter() - t0
    evalset = [q for k in cfg.eval_hops for q in [q for q in questions["val"] if q["hops"] == k][: cfg.eval_per_hop]]
    ev = evaluate_em(model, tok, evalset, observe)
    save_model(model, tok, out)
    report = warmstart_report(model, examples, t_data, t_train, losses, ev)
    (out / "warmstart.json").write_text(json.dumps(report, indent=1))
    log(TAG, f"warm-start: loss {report['loss_first10']:.3f} -> {report['loss_last10']:.3f}; greedy EM "
        + ", ".join(f"{k}={v:.2f}" for k, v in ev.items() if k.startswith("em")))  # fmt: skip
