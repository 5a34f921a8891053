"""A pinned warm-start: packed by content, unpacked once, refused when its weights are not what its name says."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sorl_verl.study.grid import GridError, load_grid
from sorl_verl.study.pinned_warmstart import PinError, model_digest, pin_digest, pinned_model, write_pin

REPO = Path(__file__).resolve().parents[2]


def _model(folder: Path, value: float) -> Path:
    folder.mkdir(parents=True)
    save_file({"w": torch.full((4, 4), value)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "tiny"}')
    (folder / ".stamp.json").write_text("{}")  # build bookkeeping: not part of a pin
    return folder


def test_pin_round_trip_gives_the_same_weights_and_is_reused(tmp_path):
    src = _model(tmp_path / "built", 1.0)
    pin = write_pin(src, tmp_path / "pins")
    assert pin.name == f"warmstart-{model_digest(src)}.tar.xz" and pin_digest(pin) == model_digest(src)
    with tarfile.open(pin) as tar:
        assert sorted(tar.getnames()) == ["config.json", "model.safetensors"]
    out = pinned_model(pin, tmp_path / "cache")
    assert out.name == f"model-{model_digest(src)}" and model_digest(out) == model_digest(src)
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert pinned_model(pin, tmp_path / "cache") == out  # unpacked once
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_pin_whose_weights_differ_from_its_name_is_refused_and_leaves_nothing(tmp_path):
    pin = write_pin(_model(tmp_path / "a", 1.0), tmp_path / "pins")
    other = model_digest(_model(tmp_path / "b", 2.0))
    forged = pin.with_name(f"warmstart-{other}.tar.xz")
    pin.rename(forged)
    with pytest.raises(PinError, match=f"not {other}"):
        pinned_model(forged, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_pin_name_and_presence_are_checked(tmp_path):
    with pytest.raises(PinError, match="16 hex digits"):
        pin_digest(tmp_path / "warmstart.tar.xz")
    with pytest.raises(PinError, match="not found"):
        pinned_model(tmp_path / "warmstart-0123456789abcdef.tar.xz", tmp_path / "cache")


def test_natural_grid_pins_a_committed_warmstart_and_a_bad_pin_fails_at_load(tmp_path):
    grid = load_grid(REPO / "recipe/sorl/study/natural.yaml")
    assert grid.warmstart_pin is not None and grid.warmstart_pin.is_file()
    assert grid.warmstart == "early-stop-50"
    text = (REPO / "recipe/sorl/study/natural.yaml").read_text()
    bad = tmp_path / "natural.yaml"
    (tmp_path / "presets.yaml").write_text((REPO / "recipe/sorl/study/presets.yaml").read_text())
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "sorl_trainer.yaml").write_text("")
    bad.write_text(
        text.replace("../../../docs/results/study/warmstart-early-stop-50-", "missing/warmstart-early-stop-50-")
        + "config_dir: config\n"
    )
    with pytest.raises(GridError, match="warmstart_pin"):
        load_grid(bad)


def test_a_build_of_other_weights_is_refused_naming_both_digests(tmp_path):
    from sorl_verl.study.pinned_warmstart import check_built

    built = _model(tmp_path / "built", 3.0)
    check_built(built, model_digest(built))
    with pytest.raises(PinError, match="0123456789abcdef.*warmstart_digest"):
        check_built(built, "0123456789abcdef")


def test_learning_grid_names_the_digest_its_runs_started_from():
    grid = load_grid(REPO / "recipe/sorl/study/learning.yaml")
    assert grid.warmstart_digest == "4a317b47011afc65" and grid.warmstart_pin is None
