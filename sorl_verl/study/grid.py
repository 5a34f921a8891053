"""The study grid: a YAML file of named algorithms and regimes (hydra overrides), seeds and run length.

A grid file (``recipe/sorl/study/<name>.yaml``)::

    name: stress                  # default output: $SORL_HOME/study/<name>
    task: search_qa               # search_qa (default) | medical_mcq: the task overlay (+task=...)
                                  # and whose embedded default the cells train and validate on
    warmstart: expert             # the task's named warm-start (demo_paths.warmstart_names) the
                                  # cells start from and the training set it implies
    warmstart_pin: ../../../docs/results/study/warmstart-<digest>.tar.xz   # optional: the warm-start's
                                  # weights pinned by content (sorl_verl/study/pinned_warmstart.py),
                                  # loaded instead of this machine's build (path relative to this file)
    warmstart_digest: 4a317b47011afc65   # optional, without a pin: run only where this machine's own
                                  # build of the warm-start has this digest (runs compare only then)
    include: presets.yaml         # library of algorithms/regimes (path relative to this file)
    steps: 20                     # trainer.total_training_steps of every cell (a regime may set its own)
    test_freq: 5                  # trainer.test_freq (validation also at step 0; a regime may set its own)
    val_max_samples: 96           # data.val_max_samples = data.val_batch_size (one greedy batch; a regime
                                  # may set its own)
    warning_fall_rule: false      # aggregate's warning table also by the fall-below-the-best rule
                                  # (sorl_verl/study/warning_signals.py; no effect on the runs)
    guard_controls: [demo]        # optional: the control regimes of the guard comparison, healthy
                                  # runs where any guard restore is a false one (aggregate's
                                  # <name>_guard.md, sorl_verl/study/guard_table.py; no effect on the
                                  # runs); names of this grid's regimes
    seed_keys: [data.seed, ...]   # every key set to the cell's seed
    common: {key: value}          # overrides of every cell
    regimes:
      many_updates:
        description: 16 updates per rollout
        overrides: {actor_rollout_ref.actor.ppo_epochs: 4, actor_rollout_ref.actor.optim.lr: 5.0e-4}
      long_run:
        steps: 100                # optional: this regime's cells run 100 steps (default: the grid's steps)
        test_freq: 5              # optional: and validate every 5 steps (default: the grid's test_freq)
        val_max_samples: 100      # optional: on 100 questions (default: the grid's val_max_samples)
      from_early_stop:
        warmstart: early-stop     # optional, with warmstart_pin: this regime's cells start from another
        warmstart_pin: ../../../docs/results/study/warmstart-early-stop-<digest>.tar.xz   # of the task's
                                  # warm-starts, pinned (the grid's data and retrieval server; see below)
      many_updates_p5:            # a protocol twin: many_updates' training (its overrides, equal: checked
        protocol_of: many_updates # at load) validated every 5 steps on 100 questions; in the analysis it
        test_freq: 5              # takes its base's role (optional; see below)
        val_max_samples: 100
        overrides: {actor_rollout_ref.actor.ppo_epochs: 4, actor_rollout_ref.actor.optim.lr: 5.0e-4}
    algorithms:
      grpo:
        overrides: {algorithm.adv_estimator: grpo, actor_rollout_ref.actor.policy_loss.loss_mode: vanilla}
      grpo_lowlr:                 # a per-regime parameter; "???" = not filled yet (cell not runnable)
        overrides: {...}
        per_regime: {many_updates: {actor_rollout_ref.actor.optim.lr: "???"}}
      so_grpo_abs:                # a sweep: so_grpo_abs_tau0.05, so_grpo_abs_tau0.1, ...
        overrides: {...}
        sweep: {key: actor_rollout_ref.actor.policy_loss.clip_norm_tau, label: tau, values: [0.05, 0.1]}
    cells:                        # union of products regimes x algorithms x seeds
      - {regimes: [many_updates], algorithms: [grpo, so_grpo], seeds: [1, 2, 3]}

``task`` is grid-level: every cell of a grid runs the same task (``search_qa``: the synthetic
multi-hop QA world, validation sources ``synthetic_{k}hop``; ``medical_mcq``: the synthetic
medical multiple-choice world, validation sources ``synthetic_med_<question type>``), so a study
of the other task is another grid file (and output directory). Entries of the grid file are merged over the included library key by key (an entry's
``overrides`` and ``per_regime`` dicts are updated, ``description`` replaced). A cell's
overrides, later winning: run length and validation size < ``common`` < regime < algorithm <
algorithm's ``per_regime[regime]`` < seed keys. Keys are plain hydra override keys (``+key`` to
add a key the config lacks). Every error names the file and line.

A cell's run length (:attr:`Cell.steps`) is its regime's ``steps`` where the regime sets one, else the
grid's: it is the cell's ``trainer.total_training_steps`` (so no override may set that key), its
progress (``step s/S``), its default wall limit and what "every step logged" (``done``) means. A
regime without ``steps`` gives its cells exactly the overrides they had before the key existed, so
their finished runs stay ``done``; setting or changing a regime's ``steps`` changes its cells'
``trainer.total_training_steps`` and makes its finished runs ``changed``.

The validation protocol is per regime the same way: a cell's validation interval
(:attr:`Cell.test_freq`, its ``trainer.test_freq``) and size (:attr:`Cell.val_max_samples`, its
``data.val_max_samples`` and ``data.val_batch_size``: one greedy batch) are its regime's
``test_freq`` / ``val_max_samples`` where set, else the grid's (the grid's ``test_freq`` defaults to
the grid's ``steps``, its ``val_max_samples`` to 96); no override or sweep may set those three keys. The
cell's ``test_freq`` is what its default wall limit counts validations by; the analysis reads each
run's own validations and its recorded ``data.val_max_samples``. A regime without the keys gives
its cells exactly the overrides they had before the keys existed (finished runs stay ``done``).
Which questions a size of N picks: verl 0.9.1 (``RLHFDataset``) takes a seeded random choice of N
rows, ``numpy.random.default_rng(data.seed).choice``, since ``data.shuffle`` is true; ``data.seed`` is
the platform overlay's 42 and no committed grid makes it a seed key, so every cell and seed of a
grid validates on the same N questions.

A regime with ``protocol_of: <base>`` is a *protocol twin* of another regime of the grid (or of the
included library): the base's training under another validation protocol (question 5 of
natural.yaml: the ``*_p5`` regimes). At load, the base must exist, must not be the twin itself and
must have no ``protocol_of`` of its own; the twin's overrides must equal the base's (as the cells
write them) and every algorithm's ``per_regime`` entry for the twin must equal its entry for the
base, and its ``steps`` must be the base's (the lr schedule spans the run), so the two differ only in
``test_freq``, ``val_max_samples`` and the description (a regime's own warm-start, below, must be the
base's too);
a twin may not be one of ``guard_controls``. The key changes no cell's overrides. The analysis reads
it through :meth:`Grid.base_regime`: a twin is neither an admission candidate nor a control of the
GUARD-default rule (guard_table.py), and in the rule table (rule_table.py) it takes its base's role.

A regime with its own ``warmstart`` (a name of the task's warm-starts) and ``warmstart_pin`` (both or
neither; the pin's path relative to the file that names it, checked by name and presence at load)
starts its cells from those pinned weights instead of the grid's model: :attr:`Cell.warmstart` is the
regime's name and :attr:`Cell.warmstart_pin` its pin, which the runner unpacks once next to the grid's
model folder and checks by digest. Everything else is the grid's (training and validation data,
retrieval server, overrides), so the warm-start must train on the grid's questions (``demo_paths.
train_files``; refused at load otherwise); the run record names the warm-start and the loaded
weights' digest.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: value of an override that must be filled before its cells can run (e.g. a calibrated lr)
PLACEHOLDER = "???"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
KEY_RE = re.compile(r"^(\+{1,2}|~)?[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_0-9][A-Za-z0-9_]*)*$")
#: the tasks a grid may run (hydra task overlays under recipe/sorl/config/task/ with an embedded default)
TASKS = ("search_qa", "medical_mcq")
#: grid task (hydra overlay) -> the embedded default's task name (``scripts/demo.sh --task``)
EMBEDDED_TASK = {"search_qa": "qa", "medical_mcq": "medical"}
DEFAULT_TASK = "search_qa"
DEFAULT_WARMSTART = "expert"
GRID_KEYS = {
    "name",
    "task",
    "warmstart",
    "warmstart_pin",
    "warmstart_digest",
    "description",
    "include",
    "config_dir",
    "steps",
    "test_freq",
    "val_max_samples",
    "warning_fall_rule",
    "guard_controls",
    "seed_keys",
    "common",
    "algorithms",
    "regimes",
    "cells",
}
LIBRARY_KEYS = {"description", "seed_keys", "common", "algorithms", "regimes"}
ENTRY_KEYS = {"description", "overrides", "per_regime", "sweep"}
REGIME_KEYS = {
    "description",
    "overrides",
    "steps",
    "test_freq",
    "val_max_samples",
    "protocol_of",
    "warmstart",
    "warmstart_pin",
}
#: the hydra key of a cell's run length: set from ``steps`` (the grid's or the regime's), never overridden
STEPS_KEY = "trainer.total_training_steps"
#: the hydra key of a cell's validation interval: set from ``test_freq`` (the grid's or the regime's)
TEST_FREQ_KEY = "trainer.test_freq"
#: the hydra keys of a cell's validation size (questions, and one batch of them): set from
#: ``val_max_samples`` (the grid's or the regime's)
VAL_SIZE_KEY = "data.val_max_samples"
VAL_BATCH_KEY = "data.val_batch_size"
#: hydra keys the grid sets from its own (or a regime's) keys, never from an override or sweep:
#: key -> (what it is of a cell, the grid / regime key that sets it)
SET_BY_GRID = {
    STEPS_KEY: ("run length", "steps"),
    TEST_FREQ_KEY: ("validation interval", "test_freq"),
    VAL_SIZE_KEY: ("validation size", "val_max_samples"),
    VAL_BATCH_KEY: ("validation size", "val_max_samples"),
}
#: a regime's own keys (positive ints, default the grid's): run length and validation protocol
REGIME_OWN = ("steps", "test_freq", "val_max_samples")
SWEEP_KEYS = {"key", "label", "values"}
CELL_KEYS = {"regimes", "algorithms", "seeds"}


class GridError(ValueError):
    """A bad grid file; the message names the file and line."""


@dataclass(frozen=True)
class Entry:
    """A named algorithm or regime: hydra overrides (+ per-regime ones for algorithms)."""

    name: str
    description: str = ""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    per_regime: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: a regime's own run length (None: the grid's ``steps``); algorithms have none
    steps: int | None = None
    #: a regime's own validation interval (None: the grid's ``test_freq``); algorithms have none
    test_freq: int | None = None
    #: a regime's own validation size (None: the grid's ``val_max_samples``); algorithms have none
    val_max_samples: int | None = None
    #: a protocol twin's base regime (None: not a twin; module docstring); algorithms have none
    protocol_of: str | None = None
    #: a regime's own warm-start (a name of the task's ``WARM_STARTS``; None: the grid's) and its pinned
    #: weights (set together: a regime starts from other weights only when they are pinned by content)
    warmstart: str | None = None
    warmstart_pin: Path | None = None


@dataclass(frozen=True)
class Cell:
    """One run: ``overrides`` are the hydra overrides this cell adds to the base command."""

    index: int
    regime: str
    algorithm: str
    seed: int
    overrides: Mapping[str, str]
    #: the grid's task (hydra ``+task=`` overlay); not part of the key: one task per grid
    task: str = DEFAULT_TASK
    #: the warm-start (a name of the task's ``WARM_STARTS``): the grid's, or its regime's own
    warmstart: str = DEFAULT_WARMSTART
    #: the cell's run length, its ``trainer.total_training_steps``: the regime's ``steps``, else the
    #: grid's (every cell of :func:`load_grid` has it; None only in a cell made by hand: the grid's)
    steps: int | None = None
    #: the cell's validation interval, its ``trainer.test_freq``: the regime's ``test_freq``, else the
    #: grid's (None only in a cell made by hand: the grid's)
    test_freq: int | None = None
    #: the cell's validation size, its ``data.val_max_samples`` = ``data.val_batch_size``: the regime's
    #: ``val_max_samples``, else the grid's (None only in a cell made by hand: the grid's)
    val_max_samples: int | None = None
    #: the regime's own pinned warm-start, which the cell loads instead of the grid's model (None: the grid's)
    warmstart_pin: Path | None = None

    @property
    def key(self) -> str:
        """``<regime>/<algorithm>/seed<k>``, also the run directory under the study's output."""
        return f"{self.regime}/{self.algorithm}/seed{self.seed}"

    @property
    def unfilled(self) -> tuple[str, ...]:
        """Override keys still set to the placeholder ``???`` (the cell cannot run)."""
        return tuple(k for k, v in self.overrides.items() if v == PLACEHOLDER)

    def hydra_args(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.overrides.items()]


@dataclass(frozen=True)
class Grid:
    name: str
    path: Path
    description: str
    task: str
    warmstart: str
    config_dir: Path
    steps: int
    test_freq: int
    val_max_samples: int
    seed_keys: tuple[str, ...]
    common: Mapping[str, Any]
    algorithms: Mapping[str, Entry]
    regimes: Mapping[str, Entry]
    cells: tuple[Cell, ...]
    warning_fall_rule: bool = False
    #: the pinned warm-start the cells load instead of this machine's build (None: the build)
    warmstart_pin: Path | None = None
    #: without a pin: the digest this machine's build must have (None: any)
    warmstart_digest: str | None = None
    #: the control regimes of the guard comparison (a guard restore there is a false one)
    guard_controls: tuple[str, ...] = ()

    def steps_of(self, cell: Cell) -> int:
        """The cell's run length: its own ``steps`` (its regime's, else the grid's), the grid's when unset."""
        return cell.steps if cell.steps is not None else self.steps

    def test_freq_of(self, cell: Cell) -> int:
        """The cell's validation interval: its own ``test_freq`` (its regime's, else the grid's), the grid's when unset."""
        return cell.test_freq if cell.test_freq is not None else self.test_freq

    def val_max_samples_of(self, cell: Cell) -> int:
        """The cell's validation size: its own ``val_max_samples`` (its regime's, else the grid's), the grid's when unset."""
        return cell.val_max_samples if cell.val_max_samples is not None else self.val_max_samples

    def base_regime(self, regime: str) -> str:
        """The regime whose training ``regime`` runs: its ``protocol_of`` for a protocol twin, else itself
        (a name the grid does not know is its own base)."""
        entry = self.regimes.get(regime)
        return entry.protocol_of if entry is not None and entry.protocol_of else regime

    @property
    def protocol_twins(self) -> frozenset[str]:
        """The regimes with a ``protocol_of`` (neither admission candidates nor controls of question 4)."""
        return frozenset(r for r in self.regimes if self.base_regime(r) != r)

    def select(self, patterns: Sequence[str] | None) -> list[Cell]:
        """Cells whose key matches any pattern (all cells when there is none); see :func:`matches`."""
        if not patterns:
            return list(self.cells)
        return [c for c in self.cells if any(matches(c.key, p) for p in patterns)]


def matches(key: str, pattern: str) -> bool:
    """A glob (``*?[``) is matched against the whole cell key, anything else is a substring of it.

    ``grpo`` selects every cell whose key contains ``grpo`` (so_grpo, grpo_lowlr too);
    ``many_updates/grpo/*`` only GRPO in that regime; ``*/seed1`` every first seed.
    """
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return pattern in key


def format_value(value: Any) -> str:
    """A YAML scalar or list as hydra override text (``true``, ``null``, ``0.0005``, ``[a,b]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int | str):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    raise TypeError(f"unsupported override value {value!r} (use a scalar or a list)")


# --- line numbers ---------------------------------------------------------------------------


class _Located:
    """The YAML node tree of one file, to name the line of a key path in error messages."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        try:
            self.root = yaml.compose(text)
        except yaml.YAMLError:
            self.root = None

    def line(self, keys: Sequence[Any]) -> int | None:
        node = self.root
        line = None
        for key in keys:
            if isinstance(node, yaml.MappingNode):
                found = next(((k, v) for k, v in node.value if getattr(k, "value", None) == str(key)), None)
                if found is None:
                    return line
                line = found[0].start_mark.line + 1
                node = found[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
                node = node.value[key]
                line = node.start_mark.line + 1
            else:
                return line
        return line

    def error(self, keys: Sequence[Any], message: str) -> GridError:
        line = self.line(keys)
        where = f"{self.path}:{line}" if line else str(self.path)
        dotted = ".".join(str(k) for k in keys)
        return GridError(f"{where}: {dotted + ': ' if dotted else ''}{message}")


def _read(path: Path) -> tuple[dict[str, Any], _Located]:
    if not path.is_file():
        raise GridError(f"{path}: grid file not found")
    text = path.read_text()
    loc = _Located(path, text)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise GridError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise GridError(f"{path}: the file must be a mapping (name, steps, algorithms, regimes, cells, ...)")
    return data, loc


# --- validation helpers ---------------------------------------------------------------------


def _check_keys(loc: _Located, keys: Sequence[Any], data: Mapping[str, Any], allowed: set[str]) -> None:
    for k in data:
        if k not in allowed:
            raise loc.error([*keys, k], f"unknown key (allowed: {', '.join(sorted(allowed))})")


def _mapping(loc: _Located, keys: Sequence[Any], value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise loc.error(keys, f"must be a mapping, got {type(value).__name__}")
    return value


def _overrides(loc: _Located, keys: Sequence[Any], value: Any) -> dict[str, Any]:
    out = _mapping(loc, keys, value)
    for k, v in out.items():
        if not isinstance(k, str) or not KEY_RE.match(k):
            raise loc.error([*keys, k], "not a hydra override key (dotted name, optional + / ++ / ~ prefix)")
        if k.lstrip("+~") in SET_BY_GRID:
            what, key = SET_BY_GRID[k.lstrip("+~")]
            raise loc.error(
                [*keys, k],
                f"a cell's {what} is set by `{key}` (the grid's, or a regime's `{key}:`), not an override",
            )
        if isinstance(v, dict):
            raise loc.error([*keys, k], "a mapping is not an override value; set its keys one by one")
        if isinstance(v, float) and not math.isfinite(v):
            raise loc.error([*keys, k], f"non-finite value {v}")
    return dict(out)


def _positive_int(loc: _Located, keys: Sequence[Any], value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise loc.error(keys, f"must be an integer >= 1, got {value!r}")
    return value


def _name(loc: _Located, keys: Sequence[Any], name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise loc.error(keys, f"{name!r} is not a valid name (letters, digits, _ . -; used as a directory name)")
    return name


# --- entries --------------------------------------------------------------------------------


def _raw_entries(loc: _Located, section: str, data: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, raw in _mapping(loc, [section], data).items():
        _name(loc, [section, name], name)
        raw = _mapping(loc, [section, name], raw)
        _check_keys(loc, [section, name], raw, ENTRY_KEYS if section == "algorithms" else REGIME_KEYS)
        entry: dict[str, Any] = {"_loc": loc}
        if "description" in raw:
            entry["description"] = str(raw["description"])
        for key in REGIME_OWN:
            if key in raw:
                entry[key] = _positive_int(loc, [section, name, key], raw[key])
        if "protocol_of" in raw:
            entry["protocol_of"] = _name(loc, [section, name, "protocol_of"], raw["protocol_of"])
            entry["_protocol_loc"] = loc
        if ("warmstart" in raw) != ("warmstart_pin" in raw):
            raise loc.error([section, name], "a regime's own warmstart needs its warmstart_pin, and the pin its name")
        if "warmstart" in raw:
            entry["warmstart"] = str(raw["warmstart"])
            entry["warmstart_pin"] = _pin(loc, [section, name, "warmstart_pin"], raw["warmstart_pin"])
        if "overrides" in raw:
            entry["overrides"] = _overrides(loc, [section, name, "overrides"], raw["overrides"])
        if "per_regime" in raw:
            per = _mapping(loc, [section, name, "per_regime"], raw["per_regime"])
            entry["per_regime"] = {
                _name(loc, [section, name, "per_regime", r], r): _overrides(loc, [section, name, "per_regime", r], o)
                for r, o in per.items()
            }
        if "sweep" in raw:
            entry["sweep"] = _sweep(loc, [section, name, "sweep"], raw["sweep"])
        out[name] = entry
    return out


def _sweep(loc: _Located, keys: list[Any], raw: Any) -> dict[str, Any]:
    sweep = _mapping(loc, keys, raw)
    _check_keys(loc, keys, sweep, SWEEP_KEYS)
    for k in ("key", "values"):
        if k not in sweep:
            raise loc.error(keys, f"a sweep needs '{k}'")
    if not isinstance(sweep["key"], str) or not KEY_RE.match(sweep["key"]):
        raise loc.error([*keys, "key"], "not a hydra override key")
    if sweep["key"].lstrip("+~") in SET_BY_GRID:
        what, key = SET_BY_GRID[sweep["key"].lstrip("+~")]
        raise loc.error([*keys, "key"], f"a cell's {what} is set by `{key}` (a regime's `{key}:`), not swept")
    values = sweep["values"]
    if not isinstance(values, list) or not values or any(isinstance(v, dict | list) for v in values):
        raise loc.error([*keys, "values"], "must be a non-empty list of scalars")
    label = sweep.get("label", sweep["key"].rsplit(".", 1)[-1])
    return {"key": sweep["key"], "label": str(label), "values": list(values)}


def _merge(base: dict[str, dict[str, Any]], top: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {name: dict(entry) for name, entry in base.items()}
    for name, entry in top.items():
        if name not in out:
            out[name] = dict(entry)
            continue
        merged = out[name]
        merged["_loc"] = entry["_loc"]
        if "description" in entry:
            merged["description"] = entry["description"]
        if "overrides" in entry:
            merged["overrides"] = {**merged.get("overrides", {}), **entry["overrides"]}
        if "per_regime" in entry:
            per = {r: dict(o) for r, o in merged.get("per_regime", {}).items()}
            for r, o in entry["per_regime"].items():
                per[r] = {**per.get(r, {}), **o}
            merged["per_regime"] = per
        if "sweep" in entry:
            merged["sweep"] = entry["sweep"]
        for key in REGIME_OWN:
            if key in entry:
                merged[key] = entry[key]
        if "protocol_of" in entry:
            merged["protocol_of"], merged["_protocol_loc"] = entry["protocol_of"], entry["_protocol_loc"]
        if "warmstart" in entry:
            merged["warmstart"], merged["warmstart_pin"] = entry["warmstart"], entry["warmstart_pin"]
    return out


def _expand(section: str, raw: dict[str, dict[str, Any]]) -> tuple[dict[str, Entry], dict[str, list[str]]]:
    """Entries by name (sweeps expanded into one entry per value) and the names each name stands for."""
    entries: dict[str, Entry] = {}
    groups: dict[str, list[str]] = {}
    for name, e in raw.items():
        base = {
            "description": e.get("description", ""),
            "overrides": e.get("overrides", {}),
            "per_regime": e.get("per_regime", {}),
            **{key: e.get(key) for key in REGIME_OWN},
            "protocol_of": e.get("protocol_of"),
            "warmstart": e.get("warmstart"),
            "warmstart_pin": e.get("warmstart_pin"),
        }
        sweep = e.get("sweep")
        if not sweep:
            entries[name] = Entry(name=name, **base)
            groups[name] = [name]
            continue
        members = []
        for v in sweep["values"]:
            member = f"{name}_{sweep['label']}{format_value(v)}"
            if not NAME_RE.match(member):
                raise e["_loc"].error([section, name, "sweep"], f"value {v!r} gives the invalid name {member!r}")
            desc = f"{base['description']} ({sweep['key'].rsplit('.', 1)[-1]}={format_value(v)})".strip()
            entries[member] = Entry(
                name=member,
                description=desc,
                overrides={**base["overrides"], sweep["key"]: v},
                per_regime=base["per_regime"],
                **{key: base[key] for key in REGIME_OWN},
                warmstart=base["warmstart"],
                warmstart_pin=base["warmstart_pin"],
            )
            members.append(member)
        groups[name] = members
    for name in groups:
        for member in groups[name]:
            if member != name and member in raw:
                raise raw[name]["_loc"].error([section, name], f"sweep member {member!r} clashes with an entry")
    return entries, groups


# --- the grid -------------------------------------------------------------------------------


def load_grid(path: str | Path) -> Grid:
    """Read, validate and expand a grid file; raises :class:`GridError` naming file and line."""
    path = Path(path).resolve()
    data, loc = _read(path)
    _check_keys(loc, [], data, GRID_KEYS)

    lib_alg: dict[str, dict[str, Any]] = {}
    lib_reg: dict[str, dict[str, Any]] = {}
    seed_keys: Any = None
    common: dict[str, Any] = {}
    if "include" in data:
        inc_path = (path.parent / str(data["include"])).resolve()
        if not inc_path.is_file():
            raise loc.error(["include"], f"{inc_path} not found")
        lib, lib_loc = _read(inc_path)
        _check_keys(lib_loc, [], lib, LIBRARY_KEYS)
        lib_alg = _raw_entries(lib_loc, "algorithms", lib.get("algorithms"))
        lib_reg = _raw_entries(lib_loc, "regimes", lib.get("regimes"))
        if "seed_keys" in lib:
            seed_keys, seed_loc = lib["seed_keys"], lib_loc
        common = _overrides(lib_loc, ["common"], lib.get("common"))
    if "seed_keys" in data:
        seed_keys, seed_loc = data["seed_keys"], loc
    if seed_keys is None:
        raise loc.error([], "seed_keys is missing (here or in the included library)")
    if (
        not isinstance(seed_keys, list)
        or not seed_keys
        or not all(isinstance(k, str) and KEY_RE.match(k) for k in seed_keys)
    ):
        raise seed_loc.error(["seed_keys"], "must be a non-empty list of hydra override keys")
    common = {**common, **_overrides(loc, ["common"], data.get("common"))}

    name = _name(loc, ["name"], data.get("name", path.stem))
    task = data.get("task", DEFAULT_TASK)
    if task not in TASKS:
        raise loc.error(["task"], f"unknown task {task!r} (known: {', '.join(TASKS)})")
    warmstart = data.get("warmstart", DEFAULT_WARMSTART)
    from sorl_verl.embedded.demo_paths import warmstart_names

    known = warmstart_names(EMBEDDED_TASK[task])
    _known_warmstart(loc, ["warmstart"], warmstart, task, known)
    steps = _positive_int(loc, ["steps"], data.get("steps"))
    test_freq = _positive_int(loc, ["test_freq"], data.get("test_freq", steps))
    val_max_samples = _positive_int(loc, ["val_max_samples"], data.get("val_max_samples", 96))
    warmstart_pin = None
    if data.get("warmstart_pin") is not None:
        warmstart_pin = _pin(loc, ["warmstart_pin"], data["warmstart_pin"])
    warmstart_digest = data.get("warmstart_digest")
    if warmstart_digest is not None:
        if warmstart_pin is not None:
            raise loc.error(["warmstart_digest"], "a grid with a warmstart_pin takes its digest from the pin's name")
        if not (isinstance(warmstart_digest, str) and len(warmstart_digest) == 16):
            raise loc.error(["warmstart_digest"], f"must be 16 hex digits (model_digest), got {warmstart_digest!r}")
        try:
            int(warmstart_digest, 16)
        except ValueError:
            raise loc.error(["warmstart_digest"], f"must be 16 hex digits, got {warmstart_digest!r}") from None
    warning_fall_rule = data.get("warning_fall_rule", False)
    if not isinstance(warning_fall_rule, bool):
        raise loc.error(["warning_fall_rule"], f"must be true or false, got {warning_fall_rule!r}")
    config_dir = (path.parent / str(data.get("config_dir", "../config"))).resolve()
    if not (config_dir / "sorl_trainer.yaml").is_file():
        raise loc.error(["config_dir"], f"{config_dir} has no sorl_trainer.yaml")

    raw_alg = _merge(lib_alg, _raw_entries(loc, "algorithms", data.get("algorithms")))
    raw_reg = _merge(lib_reg, _raw_entries(loc, "regimes", data.get("regimes")))
    algorithms, alg_groups = _expand("algorithms", raw_alg)
    regimes, _ = _expand("regimes", raw_reg)
    for r, e in raw_reg.items():
        if e.get("warmstart") is not None:
            _check_regime_warmstart(e["_loc"], ["regimes", r, "warmstart"], e["warmstart"], task, warmstart, known)
    for a in raw_alg.values():
        for r in a.get("per_regime", {}):
            if r not in regimes:
                name_of = next(n for n, v in raw_alg.items() if v is a)
                raise a["_loc"].error(["algorithms", name_of, "per_regime", r], f"unknown regime {r!r}")

    _protocol_twins(raw_reg, regimes, algorithms)
    guard_controls = _guard_controls(loc, data.get("guard_controls"), regimes)
    for i, c in enumerate(guard_controls):
        if regimes[c].protocol_of:
            raise loc.error(
                ["guard_controls", i],
                f"{c!r} is a protocol twin (protocol_of: {regimes[c].protocol_of}), not a control of its own; "
                f"name its base regime",
            )
    base = {
        STEPS_KEY: steps,
        TEST_FREQ_KEY: test_freq,
        VAL_SIZE_KEY: val_max_samples,
        VAL_BATCH_KEY: val_max_samples,
    }
    cells = _cells(
        loc, data.get("cells"), algorithms, alg_groups, regimes, base, common, tuple(seed_keys), task, warmstart
    )
    return Grid(
        name=name,
        path=path,
        description=str(data.get("description", "")).strip(),
        task=task,
        warmstart=warmstart,
        config_dir=config_dir,
        steps=steps,
        test_freq=test_freq,
        val_max_samples=val_max_samples,
        seed_keys=tuple(seed_keys),
        common=common,
        algorithms=algorithms,
        regimes=regimes,
        cells=tuple(cells),
        warning_fall_rule=warning_fall_rule,
        warmstart_pin=warmstart_pin,
        warmstart_digest=warmstart_digest,
        guard_controls=guard_controls,
    )


def _protocol_twins(
    raw: Mapping[str, Mapping[str, Any]], regimes: Mapping[str, Entry], algorithms: Mapping[str, Entry]
) -> None:
    """Every ``protocol_of``: an existing other regime without one of its own, whose overrides (as the
    cells write them) and algorithms' ``per_regime`` entries the twin shares (module docstring)."""

    def formatted(overrides: Mapping[str, Any]) -> dict[str, str]:
        return {k: format_value(v) for k, v in overrides.items()}

    for name, entry in regimes.items():
        base = entry.protocol_of
        if base is None:
            continue
        loc, keys = raw[name]["_protocol_loc"], ["regimes", name, "protocol_of"]
        if base == name:
            raise loc.error(keys, "a regime cannot be its own protocol twin")
        if base not in regimes:
            raise loc.error(keys, f"unknown regime {base!r} (known: {', '.join(regimes)})")
        if regimes[base].protocol_of:
            raise loc.error(
                keys,
                f"{base!r} is itself a protocol twin (protocol_of: {regimes[base].protocol_of}); "
                f"name the regime it is a twin of",
            )
        mine, theirs = formatted(entry.overrides), formatted(regimes[base].overrides)
        if mine != theirs:
            diff = sorted(set(mine) | set(theirs), key=str)
            what = ", ".join(
                f"{k} ({mine.get(k, 'unset')} here, {theirs.get(k, 'unset')} in {base})"
                for k in diff
                if mine.get(k) != theirs.get(k)
            )
            raise loc.error(
                keys,
                f"a protocol twin trains as its base: its overrides must equal {base!r}'s, which differ in {what} "
                f"(a twin may differ only in test_freq and val_max_samples)",
            )
        if entry.steps != regimes[base].steps:
            # the lr schedule (warm-up, cosine decay) spans trainer.total_training_steps: other steps, other training
            raise loc.error(
                keys,
                f"a protocol twin trains as its base: steps {entry.steps or 'the grid default'} here but "
                f"{regimes[base].steps or 'the grid default'} in {base!r} (the lr schedule spans the run's steps)",
            )
        if (entry.warmstart, entry.warmstart_pin) != (regimes[base].warmstart, regimes[base].warmstart_pin):
            raise loc.error(
                keys,
                f"a protocol twin trains as its base: warm-start {entry.warmstart or 'the grid'}'s here but "
                f"{regimes[base].warmstart or 'the grid'}'s in {base!r} (set the same warmstart and warmstart_pin)",
            )
        for alg in algorithms.values():
            mine, theirs = formatted(alg.per_regime.get(name, {})), formatted(alg.per_regime.get(base, {}))
            if mine != theirs:
                raise loc.error(
                    keys,
                    f"a protocol twin trains as its base: algorithm {alg.name!r} has per_regime {mine or 'none'} "
                    f"for {name!r} but {theirs or 'none'} for {base!r}",
                )


def _pin(loc: _Located, keys: list[Any], value: Any) -> Path:
    """A pinned warm-start's path (relative to the file that names it), checked by name and presence."""
    from sorl_verl.study.pinned_warmstart import PinError, pin_digest

    pin = (loc.path.parent / str(value)).resolve()
    try:
        pin_digest(pin)
    except PinError as e:
        raise loc.error(keys, str(e)) from None
    if not pin.is_file():
        raise loc.error(keys, f"{pin} not found")
    return pin


def _known_warmstart(loc: _Located, keys: list[Any], name: str, task: str, known: Sequence[str]) -> None:
    """Refuse a warm-start name (the grid's or a regime's) that is not one of the task's."""
    if name not in known:
        raise loc.error(keys, f"unknown warm-start {name!r} of task {task} (known: {', '.join(known)})")


def _check_regime_warmstart(
    loc: _Located, keys: list[Any], name: str, task: str, grid_warmstart: str, known: Sequence[str]
) -> None:
    """A regime's own warm-start must be one of the task's and train on the grid's questions (the cells
    share the grid's data and retrieval server; only the model differs)."""
    from sorl_verl.embedded.demo_paths import train_files

    _known_warmstart(loc, keys, name, task, known)
    probe = {"train": "train", "train_1hop": "train_1hop", "train_2hop": "train_2hop"}
    embedded = EMBEDDED_TASK[task]
    if train_files(embedded, name, probe) != train_files(embedded, grid_warmstart, probe):
        raise loc.error(
            keys, f"warm-start {name!r} trains on other questions than the grid's {grid_warmstart!r}: give it a grid"
        )


def _guard_controls(loc: _Located, value: Any, regimes: Mapping[str, Entry]) -> tuple[str, ...]:
    """The optional ``guard_controls`` list: names of the grid's regimes (an empty tuple when absent)."""
    if value is None:
        return ()
    return tuple(_names(loc, ["guard_controls"], value, regimes, "regime"))


def _names(loc: _Located, keys: list[Any], value: Any, known: Iterable[str], what: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise loc.error(keys, f"must be a non-empty list of {what} names")
    known = list(known)
    for i, v in enumerate(value):
        if v not in known:
            raise loc.error([*keys, i], f"unknown {what} {v!r} (known: {', '.join(known)})")
    return value


def _cells(
    loc: _Located,
    raw: Any,
    algorithms: Mapping[str, Entry],
    alg_groups: Mapping[str, list[str]],
    regimes: Mapping[str, Entry],
    base: Mapping[str, Any],
    common: Mapping[str, Any],
    seed_keys: tuple[str, ...],
    task: str,
    warmstart: str = DEFAULT_WARMSTART,
) -> list[Cell]:
    if not isinstance(raw, list) or not raw:
        raise loc.error(["cells"], "must be a non-empty list of {regimes, algorithms, seeds}")
    cells: list[Cell] = []
    seen: set[tuple[str, str, int]] = set()
    for i, block in enumerate(raw):
        block = _mapping(loc, ["cells", i], block)
        _check_keys(loc, ["cells", i], block, CELL_KEYS)
        for k in CELL_KEYS:
            if k not in block:
                raise loc.error(["cells", i], f"needs '{k}'")
        regs = _names(loc, ["cells", i, "regimes"], block["regimes"], regimes, "regime")
        algs = _names(loc, ["cells", i, "algorithms"], block["algorithms"], alg_groups, "algorithm")
        seeds = block["seeds"]
        if (
            not isinstance(seeds, list)
            or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        ):
            raise loc.error(["cells", i, "seeds"], "must be a non-empty list of integers >= 0")
        for r in regs:
            for group in algs:
                for a in alg_groups[group]:
                    for s in seeds:
                        if (r, a, s) in seen:
                            continue
                        seen.add((r, a, s))
                        # the regime's run length and validation protocol replace the grid's in place (the
                        # keys keep their order, so a regime without them gives the cells it gave before)
                        reg = regimes[r]
                        steps = reg.steps if reg.steps is not None else base[STEPS_KEY]
                        test_freq = reg.test_freq if reg.test_freq is not None else base[TEST_FREQ_KEY]
                        val_size = reg.val_max_samples if reg.val_max_samples is not None else base[VAL_SIZE_KEY]
                        own = {
                            STEPS_KEY: steps,
                            TEST_FREQ_KEY: test_freq,
                            VAL_SIZE_KEY: val_size,
                            VAL_BATCH_KEY: val_size,
                        }
                        merged: dict[str, Any] = {**base, **own, **common, **reg.overrides}
                        merged.update(algorithms[a].overrides)
                        merged.update(algorithms[a].per_regime.get(r, {}))
                        merged.update({k: s for k in seed_keys})
                        overrides = {k: format_value(v) for k, v in merged.items()}
                        cells.append(
                            Cell(
                                index=len(cells),
                                regime=r,
                                algorithm=a,
                                seed=s,
                                overrides=overrides,
                                task=task,
                                warmstart=reg.warmstart or warmstart,
                                steps=steps,
                                test_freq=test_freq,
                                val_max_samples=val_size,
                                warmstart_pin=reg.warmstart_pin,
                            )
                        )
    return cells
