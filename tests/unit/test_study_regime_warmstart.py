"""A regime's own pinned warm-start (grid ``regimes.<name>.warmstart`` + ``warmstart_pin``): its cells carry
the name and the pin, the runner loads the pin's weights for them alone (the grid's data, retrieval
server and model for every other cell), and a bad setting fails at load naming the regime and key."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sorl_verl.study import runner
from sorl_verl.study.grid import GridError, load_grid
from sorl_verl.study.pinned_warmstart import model_digest, write_pin
from sorl_verl.study.runner import Inputs, run_grid


def _pin(folder: Path, value: float, prefix: str) -> Path:
    """A pin of a one-tensor model folder whose weights are all ``value``."""
    model = folder / f"built-{value}"
    model.mkdir(parents=True)
    save_file({"w": torch.full((2, 2), value)}, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    return write_pin(model, folder / "pins", prefix=prefix)


def grid_text(regime_keys: str) -> str:
    return f"""\
        name: g
        warmstart: early-stop-50
        steps: 2
        seed_keys: [data.seed]
        regimes:
          demo: {{}}
          es: {{{regime_keys}}}
        algorithms: {{grpo: {{}}}}
        cells: [{{regimes: [demo, es], algorithms: [grpo], seeds: [1]}}]
        """


@pytest.fixture
def es_pin(tmp_path: Path) -> Path:
    return _pin(tmp_path / "study", 2.0, "warmstart-early-stop")


def test_the_regimes_cells_carry_its_warmstart_and_pin(tmp_path, write_grid, es_pin):
    grid = load_grid(write_grid(tmp_path, grid_text(f"warmstart: early-stop, warmstart_pin: pins/{es_pin.name}")))
    cells = {c.regime: c for c in grid.cells}
    assert (cells["es"].warmstart, cells["es"].warmstart_pin) == ("early-stop", es_pin.resolve())
    assert (cells["demo"].warmstart, cells["demo"].warmstart_pin) == ("early-stop-50", None)
    assert cells["es"].overrides == cells["demo"].overrides  # the same hydra arguments: only the model differs


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ("warmstart: early-stop", "regimes.es: a regime's own warmstart needs its warmstart_pin"),
        ("warmstart_pin: pins/PIN", "regimes.es: a regime's own warmstart needs its warmstart_pin"),
        ("warmstart: late-stop, warmstart_pin: pins/PIN", "regimes.es.warmstart: unknown warm-start 'late-stop'"),
        ("warmstart: expert, warmstart_pin: pins/PIN", "trains on other questions than the grid's 'early-stop-50'"),
        ("warmstart: early-stop, warmstart_pin: pins/missing-0123456789abcdef.tar.xz", "not found"),
        ("warmstart: early-stop, warmstart_pin: pins/nodigest.tar.xz", "16 hex digits"),
    ],
)
def test_a_bad_regime_warmstart_fails_at_load(tmp_path, write_grid, es_pin, keys, words):
    path = write_grid(tmp_path, grid_text(keys.replace("PIN", es_pin.name)))
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}:") and words in str(err.value), str(err.value)


def test_run_grid_loads_the_regimes_pin_for_its_cells_alone(tmp_path, write_grid, es_pin, monkeypatch):
    grid = load_grid(write_grid(tmp_path, grid_text(f"warmstart: early-stop, warmstart_pin: pins/{es_pin.name}")))
    built = tmp_path / "cache" / "model"
    built.mkdir(parents=True)
    inputs = Inputs(Path("/t.parquet"), Path("/v.parquet"), built, "http://127.0.0.1:9/retrieve")
    models: dict[str, Path] = {}

    def fake_run_cell(grid, cell, directory, inputs, *, tag, timeout_s, out, pass_fds):
        models[cell.key] = inputs.model
        record = {"status": "done", "wall_s": 1.0, "exit_code": 0, "overrides": dict(cell.overrides)}
        runner.write_record(directory, record)
        return record

    monkeypatch.setattr(runner, "run_cell", fake_run_cell)
    log = io.StringIO()
    run_grid(grid, tmp_path / "out", list(grid.cells), lock=None, log=log, inputs=inputs)
    assert models["demo/grpo/seed1"] == built
    es_model = models["es/grpo/seed1"]
    digest = es_pin.name.removesuffix(".tar.xz").rsplit("-", 1)[1]
    assert es_model == tmp_path / "cache" / f"model-{digest}" and model_digest(es_model) == digest
    assert "es/grpo/seed1: the regime's own pinned warm-start early-stop" in log.getvalue()


def test_a_protocol_twin_must_start_from_its_bases_warmstart(tmp_path, write_grid, es_pin):
    pinned = f"warmstart: early-stop, warmstart_pin: pins/{es_pin.name}"
    text = grid_text(pinned).replace("          es: {", "          es_p5: {protocol_of: es, test_freq: 1}\n          es: {")
    path = write_grid(tmp_path, text)
    with pytest.raises(GridError, match="a protocol twin trains as its base: warm-start the grid's here but early-stop's"):
        load_grid(path)
    twin = f"es_p5: {{protocol_of: es, test_freq: 1, {pinned}}}"
    ok = grid_text(pinned).replace("          es: {", f"          {twin}\n          es: {{")
    grid = load_grid(write_grid(tmp_path, ok, name="ok.yaml"))
    assert grid.regimes["es_p5"].warmstart_pin == grid.regimes["es"].warmstart_pin
