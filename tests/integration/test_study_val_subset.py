"""The P5 regimes of natural.yaml validate every cell and seed on the same 100 questions, through verl's code.

verl 0.9.1 builds the validation set with ``create_rl_dataset(data.val_files, data, ..., max_samples=
data.val_max_samples)``; its ``RLHFDataset`` keeps the first N rows unless ``data.shuffle`` (true, verl's
default) and then draws ``numpy.random.default_rng(data.seed).choice(total, N, replace=False)``. Each cell's
config is composed as main_ppo composes it (sorl_trainer + task/search_qa + platform/cpu + the cell's
overrides, ``+demo=early_stop`` among them) for every algorithm and seed 1-3 of the two P5 regimes (cells
the grid does not list yet, so the test adds them to a copy of natural.yaml); the validation parquet is the
embedded QA default's (``generate_world`` at the build's seed: the 300 validation questions every natural
cell runs on, 100 per hop count, interleaved). The draw happens before verl's filter of overlong prompts,
which is turned off here (no tokenizer needed; the embedded tokenizer keeps all 100 at 256 tokens).
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import verl  # noqa: F401 - loads the sorl_verl plugin
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.utils import create_rl_dataset

from sorl_verl.embedded.qa_build import EmbeddedConfig
from sorl_verl.embedded.qa_world import generate_world, questions_to_parquet
from sorl_verl.study.grid import load_grid

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "recipe" / "sorl" / "study"
P5 = ("demo_const_lr1e-3_p5", "demo_p5")


def natural_with_p5_cells(tmp_path: Path):
    """natural.yaml with a cells block for the P5 regimes (grpo and grpo_guard, seeds 1-3), its relative
    paths made absolute so that the copy loads from ``tmp_path``."""
    text = (STUDY / "natural.yaml").read_text()
    pin = "../../../docs/results/study/"
    assert "\ninclude: presets.yaml\n" in text and f"warmstart_pin: {pin}" in text
    text = text.replace(
        "\ninclude: presets.yaml\n", f"\ninclude: {STUDY / 'presets.yaml'}\nconfig_dir: {REPO / 'recipe/sorl/config'}\n"
    )
    text = text.replace(f"warmstart_pin: {pin}", f"warmstart_pin: {REPO / 'docs/results/study'}/")
    text += f"  - {{regimes: [{', '.join(P5)}], algorithms: [grpo, grpo_guard], seeds: [1, 2, 3]}}\n"
    path = tmp_path / "natural.yaml"
    path.write_text(text)
    return load_grid(path)


@pytest.fixture(scope="module")
def val_parquet(tmp_path_factory) -> Path:
    cfg = EmbeddedConfig()
    world = generate_world(cfg.seed, cfg.num_entities, cfg.num_val_per_hop, cfg.num_test_per_hop)
    return questions_to_parquet(world.questions["val"], tmp_path_factory.mktemp("val") / "val.parquet", "val")


def drawn(grid, cell_overrides: list[str], val: Path) -> tuple[list[int], collections.Counter, object]:
    """The validation rows (their ``extra_info.index``) verl draws for a cell, their sources, the config."""
    overrides = [
        "+task=search_qa",
        "+platform=cpu",
        "data.train_files=/x/train.parquet",
        f"data.val_files={val}",
        "actor_rollout_ref.model.path=/x/model",
        "sorl.agent.retrieval_url=http://127.0.0.1:9/retrieve",
        *cell_overrides,
        "data.filter_overlong_prompts=false",
    ]
    with initialize_config_dir(config_dir=str(grid.config_dir), version_base=None):
        cfg = compose(config_name="sorl_trainer", overrides=overrides)
    ds = create_rl_dataset(cfg.data.val_files, cfg.data, None, None, is_train=False,
                           max_samples=cfg.data.get("val_max_samples", -1))  # fmt: skip
    rows = list(ds.dataframe)
    return [r["extra_info"]["index"] for r in rows], collections.Counter(r["data_source"] for r in rows), cfg


def test_every_p5_cell_validates_on_the_same_balanced_100_questions(tmp_path, val_parquet):
    grid = natural_with_p5_cells(tmp_path)
    cells = [c for c in grid.cells if c.regime in P5]
    assert len(cells) == 12 and {c.seed for c in cells} == {1, 2, 3}
    subsets = {}
    for cell in cells:
        rows, sources, cfg = drawn(grid, cell.hydra_args(), val_parquet)
        assert (cfg.trainer.test_freq, cfg.data.val_max_samples, cfg.data.val_batch_size) == (5, 100, 100), cell.key
        assert cfg.data.shuffle is True and cfg.data.seed == 42, cell.key  # the overlay's, not the cell's seed
        assert len(rows) == len(set(rows)) == 100, cell.key
        assert sources == {"synthetic_1hop": 35, "synthetic_2hop": 33, "synthetic_3hop": 32}, cell.key
        subsets[cell.key] = rows
    assert len({tuple(r) for r in subsets.values()}) == 1, "the subset differs between cells"
    first = sorted(next(iter(subsets.values())))
    assert first[:6] == [11, 15, 16, 17, 19, 20] and first[-3:] == [294, 297, 298]
    # the control: the draw follows data.seed, so a seed key on data.seed would give each seed its own subset
    other, _, _ = drawn(grid, [*cells[0].hydra_args(), "data.seed=43"], val_parquet)
    assert sorted(other) != first
    # and without the shuffle verl would take the first 100 rows: 37 / 30 / 33, the same in every cell too
    _, head, _ = drawn(grid, [*cells[0].hydra_args(), "data.shuffle=false"], val_parquet)
    assert head == {"synthetic_1hop": 37, "synthetic_2hop": 30, "synthetic_3hop": 33}
