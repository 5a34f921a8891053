"""EM / F1 per data source for a search agent, written as a markdown and a CSV table
(``sorl-verl eval``).

Three ways in, one table out (``<out-dir>/eval.md``, ``<out-dir>/eval.csv``):

* ``--metrics FILE.jsonl`` (the main path): tabulate what verl's own validation logged with the
  ``file`` logger, during training (every ``trainer.test_freq`` steps) or in a validation-only run
  (``trainer.val_only=True``, which the run scripts start with ``VAL_ONLY=1``): the
  ``val-aux/<source>/{em,f1,substring_em}/mean@N`` values of the **last** validated step and of
  the **best** one (highest macro-average EM over data sources; the earliest step on a tie).
  ``--print-step best|last`` prints only that step number (``--checkpoints DIR``: only steps with
  a saved ``global_step_N``), which the run scripts use to pick the checkpoint to evaluate.
* ``--generations FILE.jsonl``: rescore existing generations; one JSON object per line with
  ``data_source``, ``response`` and ``ground_truth`` (the parquet ``reward_model.ground_truth``).
* ``--model CKPT --data TEST.parquet ...``: the slow fallback. Greedy generation with Hugging
  Face transformers, one episode at a time (no batching, no vLLM: hours for 7 x 500 episodes of a
  3B model; meant for small models and spot checks) running the ``search_r1`` agent's turn logic
  (:mod:`sorl_verl.agent.episode`: stop tags, observation escaping and truncation, feedback,
  turn limits), with the project's retrieval client against the server at ``--retrieval-url``
  (default ``$SORL_RETRIEVAL_URL``). Generations are saved to ``<out-dir>/generations.jsonl``.

Scores come from the project's reward function (``sorl_verl.rewards.score.compute_score``): EM
and F1 on the last ``<answer>`` for open-domain QA, letter match (reported as EM and F1) for
multiple choice. The ``average`` row is the unweighted mean over data sources.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sorl_verl.agent.episode import Episode, EpisodeFormat, EpisodeLimits, GenerateBatch, Search, run_episode
from sorl_verl.agent.settings import DEFAULT_RETRIEVAL_URL, URL_ENV
from sorl_verl.rewards.score import compute_score
from sorl_verl.study.metrics import parse_val_key, read_records

METRICS = ("em", "f1", "substring_em")
#: the QA and medical test sets in the order papers report them; others follow alphabetically
SOURCE_ORDER = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "medqa", "medmcqa")


# --- scoring and the table ------------------------------------------------------------------


def score_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """data_source -> metric -> per-example scores, via the project's ``compute_score``."""
    table: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        result = compute_score(
            data_source=row["data_source"], solution_str=row["response"], ground_truth=row["ground_truth"]
        )
        for metric in METRICS:
            table[row["data_source"]][metric].append(float(result[metric]))
    return table


def _ordered(sources: Iterable[str]) -> list[str]:
    rank = {s: i for i, s in enumerate(SOURCE_ORDER)}
    return sorted(sources, key=lambda s: (rank.get(s, len(rank)), s))


def summarize(per_source: Mapping[str, Mapping[str, Sequence[float]]]) -> list[dict[str, Any]]:
    """One row per data source (n, mean of each metric) plus the unweighted ``average`` row."""
    rows = []
    for source in _ordered(per_source):
        scores = per_source[source]
        n = len(next(iter(scores.values()))) if scores else 0
        rows.append(
            {"data_source": source, "n": n, **{m: sum(scores[m]) / len(scores[m]) for m in METRICS if scores.get(m)}}
        )
    return with_average(rows, n=sum(r["n"] for r in rows))


def with_average(rows: list[dict[str, Any]], n: Any) -> list[dict[str, Any]]:
    """``rows`` plus, when there are several data sources, their macro-average row (``n`` as given)."""
    if len(rows) > 1:
        average: dict[str, Any] = {"data_source": "average", "n": n}
        for metric in METRICS:
            values = [r[metric] for r in rows if metric in r]
            if values:
                average[metric] = sum(values) / len(values)
        rows.append(average)
    return rows


@dataclass(frozen=True)
class Table:
    """One evaluation table: ``which`` says where it comes from (``last`` / ``best`` validated step
    of a verl run, ``generated``, ``rescored``), ``step`` the training step of a validation table."""

    which: str
    step: int | None
    rows: list[dict[str, Any]]

    @property
    def average_em(self) -> float:
        """Macro-average EM over data sources (the ``average`` row; the only row when there is one)."""
        ems = [r["em"] for r in self.rows if r["data_source"] == "average" and "em" in r]
        ems = ems or [r["em"] for r in self.rows if "em" in r]
        return ems[-1] if ems else float("nan")

    def heading(self) -> str:
        if self.step is None:
            return self.which
        return f"{self.which} validated step: {self.step} (macro-average EM {self.average_em:.3f})"


def write_tables(tables: Sequence[Table], out_dir: str | Path, title: str) -> tuple[Path, Path]:
    """``eval.csv`` (full precision, one ``which,step`` prefix per row) and ``eval.md`` (3 decimals,
    one section per table) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    columns = ["which", "step", "data_source", "n", *METRICS]
    csv_path, md_path = out / "eval.csv", out / "eval.md"
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, restval="")
        writer.writeheader()
        for table in tables:
            step = "" if table.step is None else table.step
            writer.writerows({"which": table.which, "step": step, **row} for row in table.rows)
    lines = [f"# {title}"]
    for table in tables:
        lines += ["", f"## {table.heading()}", ""] if len(tables) > 1 or table.step is not None else [""]
        lines += ["| " + " | ".join(columns[2:]) + " |", "|" + "---|" * len(columns[2:])]
        for row in table.rows:
            cells = [str(row["data_source"]), str(row["n"])]
            cells += [f"{row[m]:.3f}" if m in row else "-" for m in METRICS]
            lines.append("| " + " | ".join(cells) + " |")
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, csv_path


# --- inputs ---------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """numpy arrays / pandas scalars from parquet -> lists, dicts and str."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def read_parquet_rows(paths: Sequence[str | Path], max_per_source: int | None = None) -> list[dict[str, Any]]:
    """Rows of verl parquet files (prompt, data_source, reward_model.ground_truth)."""
    import pandas as pd

    rows, seen = [], defaultdict(int)
    for path in paths:
        for record in pd.read_parquet(path).to_dict("records"):
            source = str(record["data_source"])
            if max_per_source is not None and seen[source] >= max_per_source:
                continue
            seen[source] += 1
            rows.append(
                {
                    "data_source": source,
                    "prompt": _plain(record["prompt"]),
                    "ground_truth": _plain(record["reward_model"])["ground_truth"],
                }
            )
    return rows


def read_generations(path: str | Path) -> list[dict[str, Any]]:
    """``--generations`` input: JSON lines with data_source, response, ground_truth."""
    rows = []
    with Path(path).open() as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"data_source", "response", "ground_truth"} - set(row)
            if missing:
                raise ValueError(f"{path}:{line_no}: missing {sorted(missing)}")
            rows.append(row)
    return rows


def metrics_files(path: str | Path) -> list[Path]:
    """A metrics file, or the ``metrics*.jsonl`` of a run directory in launch order (the run scripts
    give every launch its own file, named by launch time, because verl's file logger truncates)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("metrics*.jsonl"))
        if not files:
            raise ValueError(f"{path}: no metrics*.jsonl (verl's file logger output) in this directory")
        return files
    if not path.is_file():
        raise ValueError(f"{path}: no such metrics file or run directory")
    return [path]


def read_val_steps(path: str | Path) -> dict[int, list[dict[str, Any]]]:
    """step -> table rows of every validation a verl ``file`` logger recorded (files read in launch
    order; a step validated again, e.g. on resume, keeps its latest values)."""
    per_step: dict[int, dict[str, dict[str, float]]] = {}
    for file in metrics_files(path):
        for step, data in read_records(file, strict=True):
            values: dict[str, dict[str, float]] = defaultdict(dict)
            for key, value in data.items():
                val = parse_val_key(key)
                if val is not None and val.var in METRICS:
                    values[val.source][val.var] = float(value)
            if values:
                per_step[step] = dict(values)
    if not per_step:
        raise ValueError(
            f"{path}: no val-aux <source>/<metric>/mean@N metrics (run verl validation with the file logger)"
        )
    return {
        step: with_average([{"data_source": s, "n": "-", **values[s]} for s in _ordered(values)], n="-")
        for step, values in sorted(per_step.items())
    }


def select_steps(per_step: Mapping[int, list[dict[str, Any]]], steps: Iterable[int] | None = None) -> list[Table]:
    """The ``last`` validated step and the ``best`` one (highest macro-average EM, earliest on a
    tie), among ``steps`` when given (e.g. those with a saved checkpoint)."""
    candidates = sorted(set(per_step) & set(steps)) if steps is not None else sorted(per_step)
    if not candidates:
        raise ValueError(f"none of the validated steps {sorted(per_step)} is among {sorted(steps or [])}")
    tables = {step: Table("", step, per_step[step]) for step in candidates}
    best = max(candidates, key=lambda s: (tables[s].average_em, -s))
    last = candidates[-1]
    return [Table("last", last, per_step[last]), Table("best", best, per_step[best])]


def read_val_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of the last validated step in ``path`` (a metrics file or a run directory)."""
    return select_steps(read_val_steps(path))[0].rows


def checkpoint_steps(directory: str | Path) -> list[int]:
    """Steps N with a ``global_step_N`` directory under verl's ``trainer.default_local_dir``."""
    directory = Path(directory)
    return sorted(int(p.name.removeprefix("global_step_")) for p in directory.glob("global_step_*")
                  if p.is_dir() and p.name.removeprefix("global_step_").isdigit())  # fmt: skip


# --- generation -----------------------------------------------------------------------------


class SearchAgent:
    """Episodes through the training loop's turn logic (:mod:`sorl_verl.agent.episode`): the
    context is prompt ids + each turn's generated ids (cut after the token that completes the first
    stop tag) + each observation encoded on its own, so the model sees exactly the token sequence it
    would see in training. ``generate_batch`` makes the turns (:meth:`from_pretrained`: greedy HF
    generation); searches go through the project's retrieval client at ``retrieval_url``
    (:func:`generate`). ``limits``: by default no response budget, ``max_turns`` turns of at most
    ``max_new_tokens`` tokens."""

    def __init__(
        self, tokenizer: Any, generate_batch: GenerateBatch, retrieval_url: str, topk: int, limits: EpisodeLimits
    ) -> None:
        self.tokenizer, self.generate_batch = tokenizer, generate_batch
        self.format = EpisodeFormat(tokenizer, limits)
        self.retrieval_url, self.topk = retrieval_url, topk

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        retrieval_url: str,
        topk: int = 3,
        max_turns: int = 4,
        max_new_tokens: int = 500,
        max_obs_tokens: int = 500,
        device: str = "cpu",
    ) -> SearchAgent:
        """Greedy generation with the HF checkpoint at ``model_path``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from sorl_verl.agent.hf_generate import hf_generate

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path).to(device).eval()
        limits = EpisodeLimits(max_turns, None, max_tokens_per_turn=max_new_tokens, max_obs_tokens=max_obs_tokens)
        return cls(tokenizer, hf_generate(model, tokenizer), retrieval_url, topk, limits)

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in messages) + "\n"
        return self.format.encode(text)

    async def episode(self, messages: Sequence[Mapping[str, str]], search: Search) -> Episode:
        """One :class:`~sorl_verl.agent.episode.Episode` (``search``: async query -> observation text)."""

        async def generate(context: list[int], budget: int) -> tuple[list[int], None]:
            return self.generate_batch([context], [budget])[0], None

        return await run_episode(Episode(self.format, self.prompt_ids(messages)), generate, search)

    async def run(self, messages: Sequence[Mapping[str, str]], search: Search) -> dict[str, Any]:
        """One episode's response text (model turns + observations) and its counters."""
        episode = await self.episode(messages, search)
        text = self.tokenizer.decode(episode.response_ids, skip_special_tokens=True)
        return {"response": text, "searches": episode.searches, "turns": episode.turns}


def generate(rows: Sequence[dict[str, Any]], agent: SearchAgent, out_path: Path) -> list[dict[str, Any]]:
    """Run ``agent`` on every row; write and return generations rows (rescorable later)."""
    from sorl_verl.retrieval.client import RetrievalClient

    out_path.parent.mkdir(parents=True, exist_ok=True)

    async def run_all(fh: Any) -> list[dict[str, Any]]:
        results = []
        async with RetrievalClient(agent.retrieval_url, topk=agent.topk) as client:
            for i, row in enumerate(rows):
                episode = await agent.run(row["prompt"], client.search)
                record = {"data_source": row["data_source"], "ground_truth": row["ground_truth"], **episode}
                fh.write(json.dumps(record) + "\n")
                results.append(record)
                if (i + 1) % 50 == 0:
                    print(f"generated {i + 1}/{len(rows)}", file=sys.stderr)
        return results

    with out_path.open("w") as fh:
        return asyncio.run(run_all(fh))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sorl-verl eval",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="The main path is --metrics on what verl's validation logged (VAL_ONLY=1 with a run script); "
        "--model is a slow fallback (one episode at a time with transformers).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--metrics", help="verl file-logger JSONL, or a run directory (all its metrics*.jsonl, in launch order)"
    )
    source.add_argument("--generations", help="JSONL of data_source/response/ground_truth to rescore")
    source.add_argument("--model", help="slow fallback: HF checkpoint dir (verl's merged huggingface/ dir)")
    parser.add_argument("--out-dir", help="where eval.md and eval.csv go (required unless --print-step)")
    parser.add_argument("--title", default="Evaluation")
    parser.add_argument(
        "--print-step",
        choices=("best", "last"),
        help="with --metrics: print only the best / last validated step number and write nothing",
    )
    parser.add_argument("--checkpoints", help="with --metrics: consider only steps with a global_step_N directory here")
    gen = parser.add_argument_group("--model (slow fallback)")
    gen.add_argument("--data", nargs="*", default=[], help="test parquet files")
    gen.add_argument("--max-per-source", type=int, help="evaluate at most N rows per data source")
    gen.add_argument("--retrieval-url", default=os.environ.get(URL_ENV, DEFAULT_RETRIEVAL_URL))
    gen.add_argument("--topk", type=int, default=3)
    gen.add_argument("--max-turns", type=int, default=4)
    gen.add_argument("--max-new-tokens", type=int, default=500, help="per model turn")
    gen.add_argument("--max-obs-tokens", type=int, default=500)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy small machine)")
    return parser


def _tables(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Table]:
    if args.metrics:
        steps = checkpoint_steps(args.checkpoints) if args.checkpoints else None
        return select_steps(read_val_steps(args.metrics), steps)
    if args.model:
        if not args.data:
            parser.error("--model needs --data TEST.parquet [...]")
        rows = read_parquet_rows(args.data, args.max_per_source)
        import torch

        torch.set_num_threads(args.threads)
        agent = SearchAgent.from_pretrained(
            args.model,
            args.retrieval_url,
            args.topk,
            args.max_turns,
            args.max_new_tokens,
            args.max_obs_tokens,
            args.device,
        )
        return [
            Table(
                "generated",
                None,
                summarize(score_rows(generate(rows, agent, Path(args.out_dir) / "generations.jsonl"))),
            )
        ]
    return [Table("rescored", None, summarize(score_rows(read_generations(args.generations))))]


def main(argv: list[str] | None = None) -> int:
    """Exit 0 with the tables written; 2 with one message on bad input (nothing written)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.print_step and not args.metrics:
        parser.error("--print-step needs --metrics")
    if args.checkpoints and not args.metrics:
        parser.error("--checkpoints needs --metrics")
    if not args.print_step and not args.out_dir:
        parser.error("--out-dir is required")
    try:
        tables = _tables(args, parser)
    except (ValueError, FileNotFoundError) as exc:
        print(f"sorl-verl eval: error: {exc}", file=sys.stderr)
        return 2
    if args.print_step:
        print(next(t.step for t in tables if t.which == args.print_step))
        return 0
    md_path, csv_path = write_tables(tables, args.out_dir, args.title)
    print(md_path.read_text())
    print(f"wrote {md_path} and {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
