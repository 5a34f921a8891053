"""The recipe planner (``sorl_verl/cli/recipe_plan.py`` + ``recipe_settings.py``), in-process.

The golden file holds what the bash implementation of ``recipe/sorl/common.sh`` printed with
``DRY_RUN=1`` (command on stdout; GPU plan, run directory, exports and log file on stderr; exit
status) for 123 combinations of run script and variables, captured before the logic moved to
Python: every script's defaults and its ``separate_async`` variant, every ``ALGO`` on GPU, CPU and
Megatron, both async modes, engines, run naming, and every start-up failure. The planner must
reproduce each of them exactly with ``GUARD=0`` (the bash recipe had no collapse guard); the run
scripts' own defaults (``: "${NAME:=value}"``) are read from the scripts, as bash applies them.
``GUARD=1``, the default (again, since the natural-collapse study's verdict of 2026-11-29,
docs/results/natural_guard.md), is checked against that: the same command with the guard's
overrides at the end of the experiment's. The GPU split and plan are checked as properties."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_verl.cli.recipe_plan import build_launch, dry_run_text, identity_overrides, main, prepare_launch
from sorl_verl.cli.recipe_settings import VARIABLES, GpuPlan, RecipeError, default_gpu_split

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipe" / "sorl"
GOLDEN = json.loads(gzip.decompress((Path(__file__).parent / "data" / "recipe_plan_golden.json.gz").read_bytes()))
BASE_ENV = {"HOME": "/home/golden", "OUTPUT_DIR": "/runs", "SORL_LAUNCH_ID": "20250101-000000-1"}
#: where the bash version named a derived variable (GPUS_PER_NODE) or crashed ("x1: unbound
#: variable", exit 1); the planner names the variable the user set
IMPROVED = {
    "bad CLUSTER_GPUS_PER_NODE=0": "CLUSTER_GPUS_PER_NODE must be a positive integer, got '0'",
    "bad CLUSTER_GPUS_PER_NODE=x": "CLUSTER_GPUS_PER_NODE must be a positive integer, got 'x1'",
}


def script_defaults(script: str) -> dict[str, str]:
    """The ``: "${NAME:=value}"`` lines of a run script."""
    return dict(re.findall(r'^: "\$\{([A-Z_]+):=(.*)\}"$', (RECIPE / script).read_text(), flags=re.MULTILINE))


def planned(script: str, env: dict[str, str], extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """(stdout, stderr) of the dry run, as the script would run it (its env wins over its defaults)."""
    launch = build_launch({**BASE_ENV, **script_defaults(script), **env}, extra, "<repo>/recipe/sorl")
    return dry_run_text(launch)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_planner_reproduces_the_bash_recipe(case):
    assert "GUARD" not in case["env"]
    env = {"GUARD": "0", **case["env"]}  # the bash recipe had no guard
    if case["rc"] == 0:
        out, err = planned(case["script"], env, tuple(case["extra"]))
        assert out.splitlines() == case["stdout"]
        assert err.splitlines() == case["stderr"]
        return
    with pytest.raises(RecipeError) as exc:
        planned(case["script"], env, tuple(case["extra"]))
    expected = IMPROVED.get(case["name"]) or case["stderr"][-1].removeprefix("sorl recipe: ")
    assert case["rc"] == 2 or case["name"] in IMPROVED
    assert str(exc.value) == expected


def test_the_golden_cases_cover_every_script_algo_and_failure():
    cases = GOLDEN["cases"]
    assert {c["script"] for c in cases} == {p.name for p in RECIPE.glob("run_*.sh")}
    assert {c["env"].get("ALGO") for c in cases} >= {"so_grpo", "grpo", "gspo", "so_ppo", "ppo", "turn_ppo", "s_ppo"}
    assert {c["env"].get("TRAINER_MODE") for c in cases} >= {"colocate_async", "separate_async"}
    named = {line.split()[2] for c in cases if c["rc"] for line in c["stderr"][-1:] if "must be" in line}
    assert named >= {"PLATFORM", "TASK", "ALGO", "ROLLOUT_ENGINE", "STRATEGY", "STALENESS", "TRAINER_MODE", "NNODES"}


def test_every_golden_variable_is_one_the_planner_reads():
    read = set(VARIABLES) | {"HOME"}
    for case in GOLDEN["cases"]:
        assert set(case["env"]) <= read, case["name"]
    for script in RECIPE.glob("run_*.sh"):
        assert set(script_defaults(script.name)) <= read, script.name


def test_bad_integers_name_their_variable():
    for name in ("TRAIN_BATCH_SIZE", "NUM_MINI_BATCHES", "MAX_TURNS", "TEST_FREQ"):
        with pytest.raises(RecipeError, match=rf"^{name} must be"):
            planned("run_so_grpo_qwen2.5_3b_search.sh", {name: "many"})
    for name, value in (("GPUS_PER_NODE", "08"), ("STALENESS", "04"), ("TEST_FREQ", "-0x1")):  # as bash refused them
        with pytest.raises(RecipeError, match=rf"^{name} must be .*, got '{value}'"):
            planned("run_so_grpo_qwen2.5_3b_search.sh", {name: value})
    assert "trainer.test_freq=-1" in planned("run_so_grpo_qwen2.5_3b_search.sh", {"TEST_FREQ": "-1", "GUARD": "0"})[0]
    with pytest.raises(RecipeError, match="^NUM_MINI_BATCHES must be a positive integer, got '0'"):
        planned("run_so_grpo_qwen2.5_3b_search.sh", {"NUM_MINI_BATCHES": "0"})  # bash: division by 0
    with pytest.raises(RecipeError, match="^MICRO_BATCH_SIZE must be a positive integer"):
        planned("run_so_ppo_qwen2.5_7b_search.sh", {"STRATEGY": "megatron", "MICRO_BATCH_SIZE": "0", "GUARD": "0"})


def test_the_command_line_prints_the_dry_run_or_exits_2(monkeypatch, capsys, tmp_path):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**BASE_ENV, "ALGO": "grpo", "OUTPUT_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    assert main(["--recipe-dir", str(RECIPE), "--print", "--", "trainer.total_training_steps=7"]) == 0
    out, err = capsys.readouterr()
    assert out == planned("run_so_grpo_qwen2.5_3b_search.sh", {"OUTPUT_DIR": str(tmp_path)} | {"ALGO": "grpo"},
                          ("trainer.total_training_steps=7",))[0].replace("<repo>/recipe/sorl", str(RECIPE))  # fmt: skip
    assert out.splitlines()[-1] == "trainer.total_training_steps=7" and err.startswith("gpu plan: 1 x 8 GPUs")
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
    monkeypatch.setenv("ROLLOUT_TP", "3")
    assert main(["--recipe-dir", str(RECIPE), "--print"]) == 2
    assert capsys.readouterr().err.startswith("sorl recipe: ROLLOUT_TP=3 must divide the 8 rollout GPUs")
    with pytest.raises(SystemExit) as exc:
        main(["--recipe-dir", str(tmp_path), "--print"])
    assert exc.value.code == 2 and "no config/sorl_trainer.yaml" in capsys.readouterr().err


def test_prepared_launch_evaluates_in_bash_to_the_same_command_and_writes_its_files(tmp_path):
    env = {**BASE_ENV, "OUTPUT_DIR": str(tmp_path), "RUN_NAME": "it's a run", "PLATFORM": "cpu"}
    odd = "+trainer.note='two words' $HOME `x` \\n"
    first = build_launch(env, [odd], str(RECIPE))
    shell = prepare_launch(first)
    show = 'eval "$1"; printf "%s\\n" "${SORL_CMD[@]}"; echo "$SORL_LOG|$VERL_PLATFORM|${#SORL_AFTER[@]}"'
    proc = subprocess.run(["bash", "-c", show, "-", shell], capture_output=True, text=True, check=True)
    *argv, tail = proc.stdout.splitlines()
    assert argv == first.command and argv[-1] == odd
    assert tail == f"{first.work_dir}/train.20250101-000000-1.log|cpu|0"
    run_dir = Path(first.run.run_dir)
    assert run_dir.name.startswith("it's a run-so_grpo-search-qwen2.5-3b-sync-")
    assert (run_dir / "overrides.txt").read_text() == "\n".join(first.run.identity) + "\n"
    assert (run_dir / "command.20250101-000000-1.txt").read_text().splitlines() == first.command
    prepare_launch(build_launch({**env, "SORL_LAUNCH_ID": "2"}, [odd, "trainer.save_freq=9"], str(RECIPE)))
    assert (run_dir / "overrides.txt").read_text() == "\n".join(first.run.identity) + "\n"  # first launch's
    assert (run_dir / "train.log").read_text() == "=== launch 20250101-000000-1: new run\n=== launch 2: new run\n"


def test_identity_ignores_bookkeeping_keys_only():
    args = ["+task=search_qa", "trainer.total_training_steps=7", "+trainer.max_actor_ckpt_to_keep=2",
            "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.val_kwargs.n=3",
            "trainer.n_gpus_per_node=8", "~actor_rollout_ref.actor.optim.optimizer_impl"]  # fmt: skip
    assert identity_overrides(args) == [
        "+task=search_qa",
        "trainer.n_gpus_per_node=8",
        "~actor_rollout_ref.actor.optim.optimizer_impl",
    ]


# --- GUARD: the collapse guard -------------------------------------------------------------------

#: the learning study's guard settings (docs/notes/2026-11-27-guard-in-recipes.md), spelled out here
STUDY_GUARD = ["sorl.guard.enable=true", "sorl.guard.rule=drop", "sorl.guard.drop=0.3", "sorl.guard.patience=1",
               "sorl.guard.backoff=0.5", "sorl.guard.backoff_target=lr", "sorl.guard.max_restores=3"]  # fmt: skip
#: GUARD=1 bounds verl's checkpoint rotation (docs/guard.md, "What the guard adds": at most 4 checkpoints
#: on disk); the keys name no experiment, so they stay out of the run directory's hash
GUARD_ROTATION = ["trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=3"]
MAIN = "run_so_grpo_qwen2.5_3b_search.sh"


@pytest.mark.parametrize(
    ("script", "env"),
    [
        (MAIN, {}),
        ("run_so_ppo_qwen2.5_7b_medical.sh", {"ALGO": "ppo"}),
        ("run_so_grpo_qwen2.5_3b_search_async.sh", {}),
        (MAIN, {"TRAINER_MODE": "colocate_async"}),
        (MAIN, {"PLATFORM": "cpu", "ALGO": "s_ppo"}),
    ],
)
def test_guard_on_by_default_adds_the_study_settings_to_the_experiment(script, env):
    off = build_launch({**BASE_ENV, **script_defaults(script), **env, "GUARD": "0"}, ["x.y=1"], "<r>")
    on = build_launch({**BASE_ENV, **script_defaults(script), **env}, ["x.y=1"], "<r>")
    assert build_launch({**BASE_ENV, **script_defaults(script), **env, "GUARD": "1"}, ["x.y=1"], "<r>") == on
    books = off.command.index(next(a for a in off.command if a.startswith("trainer.logger=")))
    renamed = [a.replace(off.run.run_dir, on.run.run_dir).replace(off.run.experiment_name, on.run.experiment_name)
               for a in off.command[books:]]  # fmt: skip
    assert on.command == [*off.command[:books], *STUDY_GUARD, *GUARD_ROTATION, *renamed]
    assert on.run.identity == [*off.run.identity[:-1], *STUDY_GUARD, "x.y=1"]  # it changes what is trained
    assert on.run.run_dir != off.run.run_dir and on.run.run_dir[:-8] == off.run.run_dir[:-8]
    assert not any("sorl.guard" in a for a in off.command)


def test_trailing_hydra_arguments_still_win_over_the_guard_s_settings():
    out, _ = planned(MAIN, {"GUARD": "1"}, ("sorl.guard.patience=2",))
    argv = out.splitlines()
    assert argv[-1] == "sorl.guard.patience=2" and argv.index("sorl.guard.patience=1") < len(argv) - 1


@pytest.mark.parametrize("value", ["2", "yes", "true", "on", "01", " 1"])
def test_guard_takes_0_or_1_and_names_itself(value):
    with pytest.raises(RecipeError, match=rf"^GUARD must be 0 \(off\) or 1 .*, got '{re.escape(value)}'$"):
        planned(MAIN, {"GUARD": value})
    assert planned(MAIN, {"GUARD": ""}) == planned(MAIN, {})  # empty counts as unset, like every variable


@pytest.mark.parametrize("test_freq", ["0", "-1"])
def test_guard_without_validations_stops_before_anything_starts(test_freq):
    with pytest.raises(RecipeError) as exc:
        planned(MAIN, {"TEST_FREQ": test_freq, "GUARD": "1"})
    assert str(exc.value).startswith(f"GUARD=1 (the collapse guard) chooses its best checkpoint by validation, "
                                     f"but TEST_FREQ={test_freq} runs none during training")  # fmt: skip
    assert "set TEST_FREQ > 0" in str(exc.value) and "or GUARD=0" in str(exc.value)
    with pytest.raises(RecipeError, match="^GUARD=1 .*TEST_FREQ"):
        planned(MAIN, {"TEST_FREQ": test_freq})  # GUARD=1, the default
    assert f"trainer.test_freq={test_freq}" in planned(MAIN, {"TEST_FREQ": test_freq, "GUARD": "0"})[0]
    # validation only trains nothing: the guard is off there, whatever TEST_FREQ is
    val_only = {"TEST_FREQ": test_freq, "VAL_ONLY": "1", "EVAL_STEP": "base"}
    assert "sorl.guard.enable=false" in planned(MAIN, {**val_only, "GUARD": "1"})[0]


@pytest.mark.parametrize("algo", ["so_grpo", "so_ppo", "s_ppo"])
def test_guard_on_megatron_backs_off_clip_norm_tau(algo):
    """Megatron's scheduler is not torch's, so the guard cannot scale its learning rate: with a SORL
    normalizer the recipe's guard lowers clip_norm_tau instead; FSDP keeps the lr backoff."""
    env = {"STRATEGY": "megatron", "ALGO": algo, "GUARD": "1"}
    argv = planned("run_so_ppo_qwen2.5_7b_search.sh", env)[0].splitlines()
    assert "model_engine=megatron" in argv
    assert [a for a in argv if a.startswith("sorl.guard.")] == [
        a.replace("backoff_target=lr", "backoff_target=clip_norm_tau") for a in STUDY_GUARD
    ]
    fsdp = planned("run_so_ppo_qwen2.5_7b_search.sh", {**env, "STRATEGY": "fsdp"})[0].splitlines()
    assert [a for a in fsdp if a.startswith("sorl.guard.")] == STUDY_GUARD
    with pytest.raises(RecipeError, match=r"ALGO=.* \(CLIP_NORM_MODE=none\) has no normalizer"):
        planned("run_so_ppo_qwen2.5_7b_search.sh", {**env, "CLIP_NORM_MODE": "none"})


@pytest.mark.parametrize("algo", ["grpo", "gspo", "ppo", "turn_ppo"])
def test_guard_on_megatron_without_a_normalizer_is_refused_naming_the_fixes(algo):
    env = {"STRATEGY": "megatron", "ALGO": algo, "GUARD": "1"}
    with pytest.raises(RecipeError) as exc:
        planned("run_so_ppo_qwen2.5_7b_search.sh", env)
    message = str(exc.value)
    assert message.startswith("GUARD=1 (the collapse guard) with STRATEGY=megatron backs off")
    assert f"ALGO={algo} (CLIP_NORM_MODE=max) has no normalizer" in message
    assert message.endswith(
        "use ALGO so_grpo, so_ppo or s_ppo with CLIP_NORM_MODE max or add, STRATEGY=fsdp, or GUARD=0"
    )
    out, _ = planned("run_so_ppo_qwen2.5_7b_search.sh", {**env, "GUARD": "0"})
    assert "model_engine=megatron" in out and "sorl.guard" not in out
    assert "sorl.guard.enable=true" in planned("run_so_ppo_qwen2.5_7b_search.sh", {**env, "STRATEGY": "fsdp"})[0]


def test_validation_only_finds_the_training_run_and_runs_without_the_guard(tmp_path):
    env = {**BASE_ENV, "OUTPUT_DIR": str(tmp_path)}
    train = build_launch({**env, "GUARD": "1"}, ["sorl.guard.patience=2"], "<r>")
    val = build_launch({**env, "GUARD": "1", "VAL_ONLY": "1", "EVAL_STEP": "base"}, ["sorl.guard.patience=2"], "<r>")
    assert val.run == train.run and val.work_dir == f"{train.run.run_dir}/eval/step_base"
    assert val.command.index("sorl.guard.enable=false") > val.command.index("sorl.guard.enable=true")
    assert val.command[-1] == "sorl.guard.patience=2"
    assert "sorl.guard.enable=false" not in train.command
    unguarded = build_launch({**env, "VAL_ONLY": "1", "EVAL_STEP": "base", "GUARD": "0"}, [], "<r>")
    assert not any("sorl.guard" in a for a in unguarded.command)


# --- GPU plan: properties ------------------------------------------------------------------------


def _exactly_placeable(pools: list[int], nodes: list[int]) -> bool:
    """Brute force: can every pool go on one node without exceeding it?"""
    if not pools:
        return True
    size, rest = pools[0], pools[1:]
    for i, free in enumerate(nodes):
        if (
            free >= size
            and free not in nodes[:i]
            and _exactly_placeable(rest, [*nodes[:i], free - size, *nodes[i + 1 :]])
        ):
            return True
    return False


small = st.integers(1, 4)
per_node = st.integers(1, 9)


@settings(max_examples=300, deadline=None)
@given(nnodes=small, gpus=per_node, cnodes=small, cgpus=per_node, rnodes=small, rgpus=per_node,
       mode=st.sampled_from(["sync", "colocate_async", "separate_async"]))  # fmt: skip
def test_an_accepted_placement_exists_and_never_exceeds_the_cluster(nnodes, gpus, cnodes, cgpus, rnodes, rgpus, mode):
    plan = GpuPlan(nnodes, gpus, cnodes, cgpus, rnodes, rgpus, 1, 1, 1, 1, 1, 1, trainer_mode=mode)
    pools = [gpus] * nnodes + ([rgpus] * rnodes if mode == "separate_async" else [])
    if plan.fits():  # first fit, largest first: sound (it can miss rare tight packings, as before)
        assert _exactly_placeable(sorted(pools, reverse=True), [cgpus] * cnodes)
        assert plan.used_gpus == sum(pools) <= cnodes * cgpus
    if max(pools) > cgpus or sum(pools) > cnodes * cgpus:
        assert not plan.fits()
    assert plan.describe().endswith(f"= {sum(pools)} GPUs of {cnodes} x {cgpus}")


@settings(max_examples=200, deadline=None)
@given(cgpus=st.integers(1, 64), separate=st.booleans())
def test_default_split_fills_one_node(cgpus, separate):
    trainer, rollout = default_gpu_split(cgpus, separate)
    assert rollout == max(1, cgpus // 2)
    if separate and cgpus > 1:
        assert trainer + rollout == cgpus and trainer >= rollout >= 1
    else:
        assert trainer == cgpus
    mode = "separate_async" if separate else "sync"
    plan = GpuPlan(1, trainer, 1, cgpus, 1, rollout, 1, 1, 1, 1, 1, 1, trainer_mode=mode)
    assert plan.fits() is (not separate or cgpus > 1)


@settings(max_examples=300, deadline=None)
@given(gpus=st.integers(1, 8), nnodes=st.integers(1, 3), tp=st.integers(1, 8), ttp=st.integers(1, 4),
       tpp=st.integers(1, 2), batch=st.integers(1, 64), group=st.integers(1, 8), micro=st.integers(1, 8),
       strategy=st.sampled_from(["fsdp", "megatron"]), separate=st.booleans())  # fmt: skip
def test_check_accepts_exactly_what_verl_s_divisibility_rules_allow(
    gpus, nnodes, tp, ttp, tpp, batch, group, micro, strategy, separate
):
    mode = "separate_async" if separate else "sync"
    plan = GpuPlan(nnodes, gpus, nnodes + 1, 8, 1, 4, tp, ttp, tpp, batch, group, micro, mode, strategy)
    trainer = nnodes * gpus
    rollout, rollout_node = (4, 4) if separate else (trainer, gpus)
    if strategy == "megatron":
        unit = trainer // (ttp * tpp) * micro if trainer % (ttp * tpp) == 0 else None
    else:
        unit = trainer
    ok = rollout % tp == 0 and tp <= rollout_node and unit is not None and (batch * group) % unit == 0
    if ok:
        plan.check()
        return
    with pytest.raises(RecipeError) as exc:
        plan.check()
    message = str(exc.value)
    assert message.endswith(plan.describe())
    if rollout % tp or tp > rollout_node:
        assert message.startswith(f"ROLLOUT_TP={tp} must divide the {rollout} rollout GPUs")
    elif unit is None:
        assert message.startswith(f"TRAIN_TP x TRAIN_PP = {ttp * tpp} must divide the {trainer} trainer GPUs")
    else:
        assert message.startswith(f"TRAIN_BATCH_SIZE x GROUP_SIZE = {batch} x {group} = {batch * group} episodes")
