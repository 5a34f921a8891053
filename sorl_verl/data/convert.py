"""Convert downloaded QA files into verl parquet rows (:mod:`sorl_verl.data.records`).

Inputs: ``.jsonl``, ``.json`` (a list of objects, TriviaQA's ``{"Data": [...]}``, or JSON
lines), ``.parquet``, ``.csv`` or ``.tsv`` (PopQA's and Bamboogle's original releases) files.

Open-domain QA (``nq triviaqa popqa hotpotqa 2wikimultihopqa musique bamboogle``): the question is
``question`` (or ``Question`` / ``query``); gold answers are the union of every answer field the
row has, in this order: ``golden_answers`` (FlashRAG / Search-R1), ``answers``, ``answer`` (a
string, a list, or TriviaQA's ``{"value", "aliases"}``), ``answer_aliases`` (Musique),
``possible_answers`` (PopQA; a list or its JSON string), ``Answer`` (Bamboogle CSV export).
Musique rows with ``answerable: false`` are bad rows. A gold that normalizes to the empty string
(``"A"``, ``"The"``, ``"?"``: the reward never matches it) is dropped, counted and reported; a row
left without a usable gold is a bad row.

Multiple choice: ``medqa`` rows have ``options`` (a dict letter -> text, or a list of
``{"key", "value"}``) and ``answer_idx`` (the letter); ``medmcqa`` rows have ``opa..opd`` and
``cop``, the correct option as a letter or an index: 0-based in the Hugging Face release,
1-based in the original JSON (``cop_base="auto"`` decides per file from the values present).

A bad row raises :class:`BadRowError` naming the file and line (row for parquet), unless
``skip_bad`` is set, in which case it is skipped and counted in the report. A bad file raises
:class:`BadFileError` whatever ``skip_bad`` says: a byte that is not UTF-8 (file and line), an
unreadable JSON or parquet file, medmcqa ``cop`` indices whose base cannot be told. The CLI prints
one ``error: ...`` line and exits 2 on either; the output parquet is written to a temporary file
next to it and renamed into place, so it is either complete or untouched.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sorl_verl.data.records import AGENT_NAME, mcq_record, qa_record
from sorl_verl.rewards.qa import normalize_answer

QA_DATASETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
MCQ_DATASETS = ("medqa", "medmcqa")
DATASETS = QA_DATASETS + MCQ_DATASETS
_ID_KEYS = ("id", "_id", "question_id", "QuestionId", "qid")


class BadRowError(ValueError):
    """A row that cannot be converted; the message names the file and line/row."""


class BadFileError(BadRowError):
    """A whole input file that cannot be converted (not skippable); the message names file and line."""


@dataclass
class ConvertReport:
    written: int = 0
    skipped: int = 0
    first_errors: list[str] = field(default_factory=list)
    #: golds dropped because they normalize to the empty string, and where the first ones were
    empty_golds: int = 0
    first_empty_golds: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"written {self.written} rows, skipped {self.skipped} bad rows"]
        lines += [f"  {e}" for e in self.first_errors]
        return "\n".join(lines)

    def warnings(self) -> list[str]:
        """Human-readable warnings (empty golds), empty when there is nothing to say."""
        if not self.empty_golds:
            return []
        where = "; ".join(self.first_empty_golds)
        return [
            f"warning: dropped {self.empty_golds} gold answer(s) that normalize to the empty string and could "
            f"never match (first: {where})"
        ]


# --- reading -----------------------------------------------------------------------------


def iter_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (location, row) with location ``"file:line N"`` (``"file:row N"`` for parquet/json list)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
            raise BadFileError(f"{path}: not a readable parquet file ({e})") from None
        for batch_start, batch in _parquet_batches(parquet):
            for offset, row in enumerate(batch):
                yield f"{path}:row {batch_start + offset + 1}", row
        return
    check_utf8(path)
    if path.suffix in (".csv", ".tsv"):
        import csv

        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
            for row in reader:
                yield f"{path}:line {reader.line_num}", row
        return
    with path.open(encoding="utf-8") as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        f.seek(0)
        if path.suffix == ".json" and first in "[{" and not _is_json_lines(path):
            try:
                items = json.load(f)
            except json.JSONDecodeError as e:
                raise BadFileError(f"{path}:line {e.lineno}: not valid JSON ({e.msg})") from None
            if isinstance(items, dict):  # TriviaQA's original release: {"Data": [...]}
                items = items.get("Data", items.get("data"))
                if not isinstance(items, list):
                    raise BadFileError(f"{path}: a JSON object without a 'Data' list")
            for i, item in enumerate(items, start=1):
                yield f"{path}:row {i}", item
            return
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:line {line_no}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:line {line_no}", BadRowError(f"{path}:line {line_no}: invalid JSON ({e.msg})")


def check_utf8(path: Path) -> None:
    """Raise :class:`BadFileError` at the first line that is not valid UTF-8 (a BOM is accepted)."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadFileError(
                    f"{path}:line {line_no}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
                ) from None


def _is_json_lines(path: Path) -> bool:
    """True when the first non-empty line is a complete JSON value (a .json file in JSON lines)."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    value = json.loads(line)
                except json.JSONDecodeError:
                    return False
                container = isinstance(value, dict) and isinstance(value.get("Data", value.get("data")), list)
                return isinstance(value, dict) and not container
    return False


def _parquet_batches(pf: Any) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    start = 0
    for batch in pf.iter_batches(batch_size=4096):
        rows = batch.to_pylist()
        yield start, rows
        start += len(rows)


# --- field extraction --------------------------------------------------------------------


def _question(row: dict[str, Any]) -> str:
    for key in ("question", "Question", "query"):
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise ValueError("no question (looked for question / Question / query)")


def _as_answers(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                return _as_answers(json.loads(text))
            except json.JSONDecodeError:
                pass
        return [text] if text else []
    if isinstance(value, dict):  # TriviaQA: {"value"/"Value": ..., "aliases"/"Aliases": [...], ...}
        keys = ("value", "Value", "aliases", "Aliases")
        return [a for key in keys for a in _as_answers(value.get(key))]
    if isinstance(value, list | tuple):
        return [a for item in value for a in _as_answers(item)]
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        return _as_answers(value.tolist())
    return [str(value)]


def qa_answers(row: dict[str, Any]) -> list[str]:
    if row.get("answerable") is False:
        raise ValueError("unanswerable question (answerable: false)")
    keys = ("golden_answers", "answers", "answer", "answer_aliases", "possible_answers", "Answer")
    golds = [a for key in keys for a in _as_answers(row.get(key))]
    unique = list(dict.fromkeys(golds))
    if not unique:
        raise ValueError(f"no gold answer (looked for {', '.join(keys)})")
    return unique


def _usable_golds(golds: list[str], location: str, report: ConvertReport) -> list[str]:
    """``golds`` without those that normalize to the empty string (counted in ``report``)."""
    usable = [g for g in golds if normalize_answer(g)]
    for gold in golds:
        if not normalize_answer(gold):
            report.empty_golds += 1
            if len(report.first_empty_golds) < 5:
                report.first_empty_golds.append(f"{gold!r} at {location}")
    if not usable:
        raise ValueError(f"every gold answer normalizes to the empty string: {golds!r}")
    return usable


def medqa_fields(row: dict[str, Any], cop_base: int | None) -> tuple[dict[str, str], str]:
    options = row.get("options")
    if isinstance(options, list | tuple):
        options = {str(o["key"]): o["value"] for o in options}
    if not isinstance(options, dict) or not options:
        raise ValueError("no options dict (medqa needs 'options')")
    options = {str(k).strip().upper(): str(v).strip() for k, v in options.items() if v is not None}
    letter = row.get("answer_idx")
    if not isinstance(letter, str) or not letter.strip():
        matches = [k for k, v in options.items() if v == str(row.get("answer", "")).strip()]
        if len(matches) != 1:
            raise ValueError("no answer_idx and the answer text matches no single option")
        letter = matches[0]
    return options, letter.strip().upper()


def medmcqa_fields(row: dict[str, Any], cop_base: int | None) -> tuple[dict[str, str], str]:
    options = {}
    for letter, key in zip("ABCD", ("opa", "opb", "opc", "opd"), strict=True):
        value = row.get(key)
        if value is None or not str(value).strip():
            raise ValueError(f"missing option {key}")
        options[letter] = str(value).strip()
    cop = row.get("cop")
    if isinstance(cop, str) and cop.strip().upper() in options:
        return options, cop.strip().upper()
    try:
        index = int(cop)
    except (TypeError, ValueError):
        raise ValueError(f"cop {cop!r} is neither a letter nor an index") from None
    if cop_base is None:
        raise ValueError("cannot tell whether cop is 0- or 1-based; pass cop_base=0 or 1")
    position = index - cop_base
    if not 0 <= position < 4:
        raise ValueError(f"cop {cop!r} out of range for {cop_base}-based indices")
    return options, "ABCD"[position]


def _detect_cop_base(path: Path) -> int:
    """0 if some cop is 0, 1 if some cop is 4; :class:`BadFileError` when both or neither occur."""
    seen: set[int] = set()
    first: str | None = None
    for location, row in iter_rows(path):
        if isinstance(row, dict) and not isinstance(row.get("cop"), str):
            try:
                seen.add(int(row.get("cop")))
            except (TypeError, ValueError):
                continue
            first = first or location
    where = first or str(path)
    if 0 in seen and 4 in seen:
        raise BadFileError(f"{where}: cop values span 0..4, so neither base fits; check the file's cop column")
    if 0 not in seen and 4 not in seen and seen:
        raise BadFileError(
            f"{where}: cannot tell whether cop is 0- or 1-based (values seen: {sorted(seen)}; a 0 means 0-based, "
            "a 4 means 1-based); pass --cop-base 0 (Hugging Face release) or --cop-base 1 (original JSON)"
        )
    return 0 if 0 in seen else 1


def _check_unicode(value: Any) -> None:
    """ValueError when a string in ``value`` cannot be written as UTF-8 (a lone surrogate from a JSON escape)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            snippet = value[max(0, e.start - 20) : e.end]
            raise ValueError(f"text that is not valid Unicode ({e.reason} at {snippet!r})") from None
    elif isinstance(value, dict):
        for item in value.values():
            _check_unicode(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_unicode(item)


# --- conversion --------------------------------------------------------------------------


def convert_rows(
    dataset: str,
    path: str | Path,
    split: str = "train",
    *,
    skip_bad: bool = False,
    limit: int | None = None,
    cop_base: str | int = "auto",
    data_source: str | None = None,
    agent_name: str = AGENT_NAME,
    report: ConvertReport | None = None,
) -> list[dict[str, Any]]:
    """verl records of one file; bad rows raise :class:`BadRowError` or, with ``skip_bad``, are counted."""
    dataset = dataset.lower()
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {list(DATASETS)}")
    path = Path(path)
    source = data_source or dataset
    report = report if report is not None else ConvertReport()
    base: int | None = None
    if dataset == "medmcqa" and cop_base not in ("auto", "0", "1", 0, 1):
        raise ValueError(f"cop_base must be 'auto', 0 or 1, got {cop_base!r}")
    if dataset == "medmcqa":
        base = _detect_cop_base(path) if cop_base == "auto" else int(cop_base)
    mcq_fields: Callable[[dict[str, Any], int | None], tuple[dict[str, str], str]] | None = {
        "medqa": medqa_fields,
        "medmcqa": medmcqa_fields,
    }.get(dataset)
    records: list[dict[str, Any]] = []
    for location, row in iter_rows(path):
        if limit is not None and len(records) >= limit:
            break
        try:
            if isinstance(row, BadRowError):
                raise row
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            row_id = next((str(row[k]) for k in _ID_KEYS if row.get(k) is not None), None)
            extra = {"id": row_id} if row_id is not None else {}
            index = len(records)
            question = _question(row)
            if mcq_fields is None:
                golds = _usable_golds(qa_answers(row), location, report)
                record = qa_record(question, golds, source, split, index, extra, agent_name)
            else:
                options, letter = mcq_fields(row, base)
                record = mcq_record(question, options, letter, source, split, index, extra, agent_name)
            _check_unicode(record)
            records.append(record)
        except BadFileError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            message = str(e) if isinstance(e, BadRowError) else f"{location}: {e}"
            if not skip_bad:
                raise BadRowError(message + " (pass --skip-bad to skip such rows)") from None
            report.skipped += 1
            if len(report.first_errors) < 5:
                report.first_errors.append(message)
    report.written += len(records)
    return records


def convert_files(
    dataset: str,
    inputs: list[str | Path],
    output: str | Path,
    split: str = "train",
    **kwargs: Any,
) -> ConvertReport:
    """Convert ``inputs`` (rows concatenated, ``index`` renumbered) into one parquet ``output``."""
    import pandas as pd

    report = ConvertReport()
    records: list[dict[str, Any]] = []
    for path in inputs:
        for rec in convert_rows(dataset, path, split, report=report, **kwargs):
            rec["extra_info"]["index"] = len(records)
            records.append(rec)
    if not records:
        raise BadRowError(f"no rows converted from {[str(p) for p in inputs]}")
    write_parquet_atomically(pd.DataFrame(records), Path(output))
    return report


def write_parquet_atomically(frame: Any, out: Path) -> None:
    """Write ``frame`` to a temporary file in ``out``'s directory, then rename it over ``out``."""
    import os
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m sorl_verl.data.convert", description="Convert downloaded QA files into verl parquet."
    )
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--input", required=True, nargs="+", help=".jsonl / .json / .parquet / .csv / .tsv file(s)")
    parser.add_argument("--output", required=True, help="output .parquet")
    parser.add_argument("--split", default="train")
    parser.add_argument("--skip-bad", action="store_true", help="skip bad rows (counted) instead of failing")
    parser.add_argument("--limit", type=int, default=None, help="at most this many rows per input file")
    parser.add_argument("--cop-base", default="auto", choices=["auto", "0", "1"], help="medmcqa: cop indexing")
    parser.add_argument("--data-source", default=None, help="data_source column (default: the dataset name)")
    parser.add_argument("--agent-name", default=AGENT_NAME)
    args = parser.parse_args(argv)
    try:
        report = convert_files(
            args.dataset,
            args.input,
            args.output,
            args.split,
            skip_bad=args.skip_bad,
            limit=args.limit,
            cop_base=args.cop_base,
            data_source=args.data_source,
            agent_name=args.agent_name,
        )
    except (BadRowError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for warning in report.warnings():
        print(warning, file=sys.stderr)
    print(f"{args.output}: {report}")


if __name__ == "__main__":
    main()
