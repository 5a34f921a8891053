"""A regime's ``protocol_of`` (sorl_verl/study/grid.py): a protocol twin, its base regime's training under
another validation protocol. The tables that read it: tests/unit/test_study_guard_table.py (a twin is no
admission candidate) and tests/unit/test_study_rule_replay.py (a twin takes its base's role)."""

from __future__ import annotations

import textwrap

import pytest

from sorl_verl.study.grid import STEPS_KEY, TEST_FREQ_KEY, VAL_BATCH_KEY, VAL_SIZE_KEY, GridError, load_grid

PROTOCOL_KEYS = (STEPS_KEY, TEST_FREQ_KEY, VAL_SIZE_KEY, VAL_BATCH_KEY)

# line numbers (after dedent) are the ones the error cases below name
TWIN_GRID = """\
    name: t
    steps: 10
    test_freq: 10
    val_max_samples: 300
    seed_keys: [data.seed]
    guard_controls: [demo]
    regimes:
      demo: {overrides: {x.y: 1}}
      hot: {overrides: {x.y: 2, x.w: 0.5}}
      hot_p5:
        protocol_of: hot
        test_freq: 5
        val_max_samples: 100
        overrides: {x.w: 0.5, x.y: 2}
    algorithms:
      a: {overrides: {x.z: 1}, per_regime: {hot: {x.v: 3}, hot_p5: {x.v: 3}}}
    cells:
      - {regimes: [demo, hot, hot_p5], algorithms: [a], seeds: [1, 2]}
"""


def test_a_protocol_twin_names_its_base_and_changes_no_cell(tmp_path, write_grid):
    grid = load_grid(write_grid(tmp_path, TWIN_GRID))
    assert grid.regimes["hot_p5"].protocol_of == "hot"
    assert (grid.regimes["demo"].protocol_of, grid.regimes["hot"].protocol_of) == (None, None)
    assert grid.algorithms["a"].protocol_of is None
    assert {r: grid.base_regime(r) for r in grid.regimes} == {"demo": "demo", "hot": "hot", "hot_p5": "hot"}
    assert grid.base_regime("not_in_the_grid") == "not_in_the_grid"
    assert grid.protocol_twins == frozenset({"hot_p5"})
    # the key changes no cell: the same grid without it has the same cells, overrides and their order included
    plain = load_grid(write_grid(tmp_path, textwrap.dedent(TWIN_GRID).replace("    protocol_of: hot\n", ""), "p.yaml"))
    assert plain.protocol_twins == frozenset() and plain.base_regime("hot_p5") == "hot_p5"
    assert [(c.key, list(c.overrides.items())) for c in grid.cells] == [
        (c.key, list(c.overrides.items())) for c in plain.cells
    ]
    # the twin's cells train as the base's: the same overrides but the validation protocol
    by_key = {c.key: c for c in grid.cells}
    for s in (1, 2):
        twin, base = by_key[f"hot_p5/a/seed{s}"].overrides, by_key[f"hot/a/seed{s}"].overrides
        assert {k: v for k, v in twin.items() if k not in PROTOCOL_KEYS} == {
            k: v for k, v in base.items() if k not in PROTOCOL_KEYS
        }
        assert [twin[k] for k in PROTOCOL_KEYS] == ["10", "5", "100", "100"]
        assert [base[k] for k in PROTOCOL_KEYS] == ["10", "10", "300", "300"]


def test_a_protocol_twin_runs_its_base_s_steps(tmp_path, write_grid):
    """The lr schedule (warm-up, cosine decay) spans the run's steps: a twin of other length trains otherwise."""
    text = textwrap.dedent(TWIN_GRID).replace("    test_freq: 5\n", "    test_freq: 5\n    steps: 20\n", 1)
    with pytest.raises(GridError, match=r"hot_p5.protocol_of: a protocol twin trains as its base: steps 20 here but "
                       r"the grid default in 'hot' \(the lr schedule spans the run's steps\)"):  # fmt: skip
        load_grid(write_grid(tmp_path, text))
    base = "hot: {overrides: {x.y: 2, x.w: 0.5}}"
    assert base in text
    same = text.replace(base, "hot: {steps: 20, overrides: {x.y: 2, x.w: 0.5}}")  # the base at 20 steps too: allowed
    grid = load_grid(write_grid(tmp_path, same))
    assert {c.steps for c in grid.cells if c.regime in ("hot", "hot_p5")} == {20}


def test_a_protocol_twin_merges_over_the_included_library(tmp_path, write_grid):
    write_grid(
        tmp_path,
        """\
        seed_keys: [data.seed]
        regimes:
          base: {overrides: {x.y: 1}}
          lib_twin: {protocol_of: base, test_freq: 5, overrides: {x.y: 1}}
          lib_plain: {overrides: {x.y: 1}}
        """,
        name="lib.yaml",
    )
    grid = load_grid(
        write_grid(
            tmp_path,
            """\
            include: lib.yaml
            steps: 10
            regimes:
              lib_twin: {description: kept}
              lib_plain: {protocol_of: base, val_max_samples: 50}
            algorithms: {a: {}}
            cells: [{regimes: [base, lib_twin, lib_plain], algorithms: [a], seeds: [1]}]
            """,
        )
    )
    assert grid.regimes["lib_twin"].description == "kept"
    assert {r: grid.base_regime(r) for r in grid.regimes} == {"base": "base", "lib_twin": "base", "lib_plain": "base"}
    # an error in the library's own protocol_of names the library file and its line
    lib = tmp_path / "study" / "lib.yaml"
    lib.write_text(lib.read_text().replace("protocol_of: base", "protocol_of: nowhere"))
    with pytest.raises(GridError) as err:
        load_grid(tmp_path / "study" / "g.yaml")
    assert str(err.value).startswith(f"{lib}:4: regimes.lib_twin.protocol_of: unknown regime 'nowhere'"), str(err.value)


@pytest.mark.parametrize(
    ("edit", "line", "words"),
    [
        (("protocol_of: hot", "protocol_of: cold"), 11, "regimes.hot_p5.protocol_of: unknown regime 'cold' (known: "),
        (
            ("protocol_of: hot", "protocol_of: hot_p5"),
            11,
            "regimes.hot_p5.protocol_of: a regime cannot be its own protocol twin",
        ),
        (
            ("\nalgorithms:", "\n  hot_p10: {protocol_of: hot_p5, overrides: {x.y: 2, x.w: 0.5}}\nalgorithms:"),
            15,
            "regimes.hot_p10.protocol_of: 'hot_p5' is itself a protocol twin (protocol_of: hot); name the regime",
        ),
        (("protocol_of: hot", "protocol_of: [hot]"), 11, "regimes.hot_p5.protocol_of: ['hot'] is not a valid name"),
        (("protocol_of: hot", "protocol_of:"), 11, "regimes.hot_p5.protocol_of: None is not a valid name"),
        # the twin trains as its base: the same overrides (as the cells write them), the same per_regime
        (
            ("overrides: {x.w: 0.5, x.y: 2}", "overrides: {x.w: 0.5, x.y: 3}"),
            11,
            "regimes.hot_p5.protocol_of: a protocol twin trains as its base: its overrides must equal 'hot''s, "
            "which differ in x.y (3 here, 2 in hot) (a twin may differ only in test_freq and val_max_samples)",
        ),
        (("overrides: {x.w: 0.5, x.y: 2}", "overrides: {x.y: 2}"), 11, "differ in x.w (unset here, 0.5 in hot)"),
        (
            ("overrides: {x.w: 0.5, x.y: 2}", "overrides: {x.w: 0.5, x.y: 2, x.u: 1}"),
            11,
            "differ in x.u (1 here, unset in hot)",
        ),
        (("overrides: {x.w: 0.5, x.y: 2}", "overrides: {x.w: 0.5, x.y: 2.0}"), 11, "x.y (2.0 here, 2 in hot)"),
        (
            ("hot_p5: {x.v: 3}", "hot_p5: {x.v: 4}"),
            11,
            "regimes.hot_p5.protocol_of: a protocol twin trains as its base: algorithm 'a' has per_regime "
            "{'x.v': '4'} for 'hot_p5' but {'x.v': '3'} for 'hot'",
        ),
        (
            ("per_regime: {hot: {x.v: 3}, hot_p5: {x.v: 3}}", "per_regime: {hot: {x.v: 3}}"),
            11,
            "algorithm 'a' has per_regime none for 'hot_p5' but {'x.v': '3'} for 'hot'",
        ),
        # a twin is no control of the guard comparison (its base is)
        (
            ("guard_controls: [demo]", "guard_controls: [demo, hot_p5]"),
            6,
            "guard_controls.1: 'hot_p5' is a protocol twin (protocol_of: hot), not a control of its own",
        ),
        # a regime's key, not an algorithm's
        (("a: {overrides:", "a: {protocol_of: hot, overrides:"), 16, "algorithms.a.protocol_of: unknown key"),
    ],
)
def test_a_bad_protocol_of_fails_at_load_naming_the_file_line_regime_and_key(tmp_path, write_grid, edit, line, words):
    text = textwrap.dedent(TWIN_GRID).replace(*edit, 1)
    assert text != textwrap.dedent(TWIN_GRID)
    path = write_grid(tmp_path, text)
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}:{line}: ") and words in str(err.value), str(err.value)
