"""The embedded medical multiple-choice default: world, BM25 index, verl parquet, warm-started tiny model.

``ensure_embedded_medical(root)`` builds what is missing under ``root`` (default
``data_home()/"embedded_medical"``), lazily on first use, under a lock (concurrent first uses
wait for one builder); each step is skipped when its ``.stamp.json`` matches a hash of its
inputs, so changing a parameter rebuilds that step and everything downstream::

    world/      corpus.jsonl, {train,val,test}.jsonl (MedQA-keyed)  (medical_world.generate_medical_world)
    data/       {split}.parquet, {split}_{type}.parquet             (rows of records.mcq_record)
    index/      BM25 index of the corpus                            (sorl_verl.retrieval.build.build_index)
    tokenizer/  byte-level BPE + chat template                      (tokenizer.train_tokenizer)
    model/      tiny Qwen2ForCausalLM SFT warm-started on expert trajectories that answer with the gold
                option's text, tokenizer files and warmstart.json (losses, timings, greedy
                and T=1 success)
    report.json build seconds of each step and the warm-start report

Progress goes to stderr.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sorl_verl.embedded.medical_world import QUESTION_TYPES, MedicalWorldConfig
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
from sorl_verl.embedded.warmstart import TOPK, Observer, SFTConfig

#: bump when the content a step produces changes for the same parameters
BUILD_VERSION = 3  # 2: trajectories check the options in letter order up to the gold one; 3: twin worlds
TAG = "embedded-medical"
SPLITS = ("train", "val", "test")


#: SFT steps of every medical warm-start. The copy skill (answering with a name read in a retrieved
#: passage) appears at a CPU-dependent point past 450 steps: after 600 an AVX-512 build had it (greedy
#: 0.82) and an AVX2 one (AMD EPYC) had not (greedy 0.18, loss 0.28); after 1000 both kinds copy (AVX2
#: greedy 0.95, loss 0.003; the AVX-512 early-stop build 0.87, loss 0.011; docs/embedded-default.md)
MEDICAL_SFT_STEPS = 1000


@dataclass(frozen=True)
class MedicalEmbeddedConfig:
    """Parameters of every build step (all enter the stamps)."""

    world: MedicalWorldConfig = field(default_factory=MedicalWorldConfig)
    vocab_size: int = 3000
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=MEDICAL_SFT_STEPS))
    #: SFT trajectories per question type of the world itself (small types get extra option draws)
    sft_per_type: int = 300
    #: share of the two-hop demonstrations that stop after the first search and answer the bridge entity
    #: (``medical_trajectories.early_stop_segments``, scored 0); in the model's stamp when > 0
    early_stop_rate: float = 0.0
    #: validation questions per type evaluated after the warm-start, greedy and sampled at temperature 1
    eval_per_type: int = 25
    eval_temperatures: tuple[float, ...] = (0.0, 1.0)
    topk: int = TOPK
    max_turns: int = 4
    #: torch threads for SFT and evaluation (1 is fastest on a shared 2-core machine)
    num_threads: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.early_stop_rate <= 1.0:
            raise ValueError(f"MedicalEmbeddedConfig.early_stop_rate must be in [0, 1], got {self.early_stop_rate}")


#: named warm-starts of the medical default -> ``early_stop_rate`` of their demonstrations: ``expert``
#: (default) answers every question; ``early-stop``: 60 % of the two-hop ones answer the bridge entity
#: after one search (as the QA default's ``early-stop``), so that RL has one decision to learn
WARM_STARTS: dict[str, float] = {"expert": 0.0, "early-stop": 0.6}


def default_root(warmstart: str = "expert") -> Path:
    """``data_home()/embedded_medical`` for the expert warm-start, ``embedded_medical-<name>`` for another one."""
    return warmstart_root("embedded_medical", WARM_STARTS, warmstart)


def warmstart_config(warmstart: str) -> MedicalEmbeddedConfig:
    """The build parameters of a named warm-start: the defaults but ``early_stop_rate``."""
    return MedicalEmbeddedConfig(early_stop_rate=named_warmstart(WARM_STARTS, warmstart))


def medical_paths(root: str | Path) -> EmbeddedPaths:
    """The layout under ``root`` (whether built or not): the QA default's, one parquet per question type."""
    return task_paths(root, SPLITS, tuple(QUESTION_TYPES))


def evaluate_mcq(
    model,
    tokenizer,
    questions: Sequence[dict[str, Any]],
    observe: Observer,
    temperature: float = 0.0,
    max_turns: int = 4,
) -> dict[str, Any]:
    """Success rate (the project's ``compute_score`` on each row's ground truth) overall, per type and per hop count.

    Rollouts are multi-turn with retrieval in the loop (:func:`sorl_verl.embedded.warmstart.greedy_rollouts`),
    greedy at temperature 0, else plain sampling.
    """
    from sorl_verl.embedded.medical_trajectories import user_message
    from sorl_verl.embedded.medical_world import data_source
    from sorl_verl.embedded.warmstart import greedy_rollouts, grouped_rates
    from sorl_verl.rewards.score import compute_score

    t0 = time.perf_counter()
    responses = greedy_rollouts(
        model, tokenizer, questions, observe, max_turns=max_turns, temperature=temperature, prompt_of=user_message
    )
    scores = [
        compute_score(data_source(q["type"]), r, {"target": [q["answer_idx"]], "options": q["options"]})["score"]
        for q, r in zip(questions, responses, strict=True)
    ]
    result: dict[str, Any] = {
        "temperature": temperature,
        "success": sum(scores) / max(1, len(scores)),
        "n": len(scores),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    for key, label in (("hops", "{}hop"), ("type", "{}")):
        result |= grouped_rates(questions, scores, key, "success", label)
    result["samples"] = [
        {"question": q["question"], "gold": q["answer_idx"], "response": r}
        for q, r in list(zip(questions, responses, strict=True))[:2]
    ]
    return result


def eval_questions(val: Sequence[dict[str, Any]], per_type: int) -> list[dict[str, Any]]:
    """The first ``per_type`` validation questions of each type, types in declaration order."""
    return [q for t in QUESTION_TYPES for q in [q for q in val if q["type"] == t][:per_type]]


def ensure_embedded_medical(
    root: str | Path | None = None,
    force: bool = False,
    config: MedicalEmbeddedConfig | None = None,
    progress: bool = True,
) -> EmbeddedPaths:
    """Build (or reuse) the embedded medical default under ``root``; ``force`` rebuilds every step."""
    cfg = config or MedicalEmbeddedConfig()
    root = Path(root) if root is not None else default_root()
    with build_lock(root):
        return _build(root, cfg, force, progress)


def _build(root: Path, cfg: MedicalEmbeddedConfig, force: bool, progress: bool) -> EmbeddedPaths:
    from sorl_verl.embedded.medical_world import generate_medical_world, medical_to_parquet
    from sorl_verl.embedded.world import read_jsonl, write_world

    paths = medical_paths(root)
    timings: dict[str, float] = {}
    version = {"version": BUILD_VERSION}

    def step(name: str, out: Path, inputs: dict[str, Any], build) -> str:
        return run_step(name, out, {**version, **inputs}, build, force=force, timings=timings, tag=TAG)

    world_stamp = step(
        "world",
        root / "world",
        {"world": asdict(cfg.world)},
        lambda tmp: write_world(generate_medical_world(cfg.world), tmp),
    )
    questions = {s: read_jsonl(p) for s, p in paths.questions.items()}

    def build_data(tmp: Path) -> None:
        for split, qs in questions.items():
            medical_to_parquet(qs, tmp / f"{split}.parquet", split)
            for t in QUESTION_TYPES:
                medical_to_parquet([q for q in qs if q["type"] == t], tmp / f"{split}_{t}.parquet", split)

    step("data", root / "data", {"world": world_stamp}, build_data)

    index_stamp = step("index", paths.index_dir, {"world": world_stamp}, build_bm25_step(paths.corpus, progress))

    def prompts() -> list[str]:
        from sorl_verl.embedded.medical_trajectories import user_message

        return [user_message(q) for q in questions["train"]]

    tok_stamp = step("tokenizer", paths.tokenizer_dir, {"world": world_stamp, "vocab": cfg.vocab_size},
                     build_tokenizer_step(paths.corpus, prompts, cfg.vocab_size))  # fmt: skip

    def build_model(tmp: Path) -> None:
        with torch_threads(cfg.num_threads):
            _warm_start(cfg, paths, questions, tmp, progress)

    # "twins": 0 and "checks": "text" name the SFT data of every build since the experiments' knobs
    # (twin worlds, letter styles) were removed; kept so that the stamps of existing builds still match
    step("model", paths.model_dir,
         {"tokenizer": tok_stamp, "index": index_stamp, "spec": cfg.model.stamp(), "sft": asdict(cfg.sft),
          "per_type": cfg.sft_per_type, "twins": 0, "checks": "text", "eval": [cfg.eval_per_type, list(cfg.eval_temperatures)], "topk": cfg.topk,
          "max_turns": cfg.max_turns, **({"early_stop": cfg.early_stop_rate} if cfg.early_stop_rate else {})},
         build_model)  # fmt: skip

    record_build(paths, timings)
    return paths


def _warm_start(
    cfg: MedicalEmbeddedConfig,
    paths: EmbeddedPaths,
    questions: dict[str, list[dict[str, Any]]],
    out: Path,
    progress: bool,
) -> None:
    from transformers import AutoTokenizer

    from sorl_verl.embedded.medical_trajectories import build_medical_sft_examples, sft_questions
    from sorl_verl.embedded.medical_world import generate_medical_world
    from sorl_verl.embedded.tiny_model import build_tiny_qwen2, save_model
    from sorl_verl.embedded.warmstart import make_observer, train_sft, warmstart_report

    tok = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
    observe = make_observer(paths.index_dir, cfg.topk)
    t0 = time.perf_counter()
    world = generate_medical_world(cfg.world)  # the pools for extra option draws (deterministic, < 1 s)
    sft_qs = sft_questions(world, questions["train"], cfg.sft_per_type, seed=cfg.sft.seed)
    examples = build_medical_sft_examples(tok, sft_qs, observe, progress=progress,
                                          early_stop_rate=cfg.early_stop_rate, seed=cfg.sft.seed)  # fmt: skip
    t_data = time.perf_counter() - t0
    model = build_tiny_qwen2(tok, cfg.model, seed=cfg.world.seed)
    t0 = time.perf_counter()
    losses = train_sft(model, examples, tok.pad_token_id, cfg.sft, progress=progress)
    t_train = time.perf_counter() - t0
    evalset = eval_questions(questions["val"], cfg.eval_per_type)
    evals = {f"T{t:g}": evaluate_mcq(model, tok, evalset, observe, t, cfg.max_turns) for t in cfg.eval_temperatures}
    save_model(model, tok, out)
    report = warmstart_report(model, examples, t_data, t_train, losses, evals)
    (out / "warmstart.json").write_text(json.dumps(report, indent=1))
    log(
        TAG,
        f"warm-start: loss {report['loss_first10']:.3f} -> {report['loss_last10']:.3f}; success "
        + ", ".join(f"{k}={v['success']:.2f}" for k, v in evals.items()),
    )
