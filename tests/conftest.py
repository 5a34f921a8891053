"""Shared pytest set-up.

verl's wheel installs a top-level ``tests`` package; this suite runs in pytest's
``importlib`` import mode and never imports from ``tests.*`` so it cannot be shadowed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# SORL_HOME: unset, the project's one cache (sorl_verl.paths.data_home, ~/.cache/sorl_verl), shared
# with scripts/demo.sh and every sorl-verl command
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray local-only (loopback) even in tests that start Ray before verl loads the plugin
# (sorl_verl/cpu/loopback.py sets the same for every process that loads it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# sorl_verl's CPU platform is chosen only when asked for (VERL_PLATFORM=cpu, as scripts/demo.sh and
# the e2e launches set it), never for a missing accelerator: the suite asks for it on a machine
# without one, so in-process verl code (replicas, engines, Ray) runs on it as in a CPU run
if not os.environ.get("VERL_PLATFORM"):
    import torch

    if not torch.cuda.is_available():
        os.environ["VERL_PLATFORM"] = "cpu"

# hypothesis' default 200 ms deadline per example is a wall-clock test: on a loaded 2-core CI
# machine a slow example fails with DeadlineExceeded although the property holds
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("sorl", deadline=None)
    _hypothesis_settings.load_profile("sorl")
except ImportError:  # hypothesis is a test extra
    pass


FP32_UNIT_ROUNDOFF = 2.0**-24


class Fp32Bounds:
    """Float32 rounding-error bounds, for test tolerances derived from the computation.

    A float32 result of ``n`` successive roundings (a length-``n`` reduction, a chain of ``n``
    operations) is within ``gamma_n ~= n * u`` (``u = 2^-24``) of the exact value, relative to
    the magnitude of the terms it combines (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., 3.1). Two evaluations whose reductions run in different orders (AVX2 vs
    AVX-512 kernels, batched vs alone, cached vs full) are within twice that of each other.
    """

    u = FP32_UNIT_ROUNDOFF

    @staticmethod
    def rounding(magnitude: float, ops: int) -> float:
        """``ops * u * magnitude``: one float32 evaluation against the exact value."""
        return ops * FP32_UNIT_ROUNDOFF * magnitude

    @classmethod
    def between(cls, magnitude: float, ops: int) -> float:
        """Two float32 evaluations (each ``ops`` roundings over ``magnitude``) against each other."""
        return 2 * cls.rounding(magnitude, ops)

    @staticmethod
    def transformer_chain(config, seq_len: int) -> int:
        """Roundings along the deepest path to one output of a transformer (Qwen2 or BERT config).

        Per layer: two norms, q/k/v, o_proj and the MLP's up projection (hidden each), its down
        projection (intermediate), attention scores (head_dim), softmax sum and weighted sum
        (seq_len each); then a final norm and the output projection (hidden each).
        """
        head_dim = config.hidden_size // config.num_attention_heads
        per_layer = 5 * config.hidden_size + config.intermediate_size + head_dim + 2 * seq_len
        return config.num_hidden_layers * per_layer + 2 * config.hidden_size

    @classmethod
    def logprob(cls, config, seq_len: int, logit_scale: float, temperature: float = 1.0) -> float:
        """Two float32 evaluations of the same token log-probs (``z_i/T - logsumexp(z/T)``).

        Each logit is within ``chain * u * scale`` of exact (``scale`` = largest |logit|, at
        least 1), two evaluations within twice that; a log-prob moves by at most twice the largest
        logit difference, over T; the log-softmax's own sum over the vocabulary adds ``vocab * u``
        per evaluation.
        """
        logit_error = cls.between(max(1.0, logit_scale), cls.transformer_chain(config, seq_len))
        return 2 * logit_error / temperature + cls.between(1.0, config.vocab_size)

    @classmethod
    def turn_gae(cls, rewards, values, mask, raw_adv, adv) -> tuple[float, float]:
        """Absolute float32 error bounds of turn-level GAE against a float64 reference: (advantages, returns).

        ``raw_adv`` / ``adv``: the reference's raw and whitened advantages (float64). Raw advantages and
        returns: per turn a reward sum over <= T tokens, delta (3 roundings), the K-term discounted sum
        with pow weights (K + 2) and + V: <= T + K + 6 roundings over terms of magnitude
        S = sum |r| + 2 sum |V at turn starts| of a row (gamma, lam <= 1): e_A = rounding(S, T + K + 6).
        Whitening over N tokens (first order, s = std of A, a = max |whitened A|): the centred values
        carry e_c = 2 e_A + (N + 2) u max|A|, the std a relative 2 a e_c / s + (N + 6) u a^2 + u, so
        |error| <= (e_c / s)(1 + 2 a^2) + (N + 6) u a^3 + 2 u a.
        """
        import torch

        m = mask.bool()
        starts = m & ~torch.nn.functional.pad(m[:, :-1], (1, 0))
        length, turns, tokens = mask.shape[1], int(starts.sum(-1).max()), int(m.sum())
        magnitude = (rewards.double().abs().sum(-1) + 2 * (values.double().abs() * starts).sum(-1)).max()
        e_raw = cls.rounding(float(magnitude), length + turns + 6)
        std, a = float(raw_adv[m].std()), float(adv[m].abs().max())
        e_c = 2 * e_raw + cls.rounding(float(raw_adv[m].abs().max()), tokens + 2)
        e_adv = e_c / std * (1 + 2 * a**2) + cls.rounding(a**3, tokens + 6) + cls.rounding(a, 2)
        return e_adv, e_raw


#: the order the suite runs its tiers in: fast to slow (ARCHITECTURE.md's unit -> integration -> e2e)
TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run unit, then integration, then e2e tests (pytest's own order is alphabetical: e2e first), each
    tier in its collected order but the tests of the medical default last: fast failures show first,
    and the background build of :func:`pytest_collection_finish` has the most tests to run beside
    before a test needs the build it waits for (the medical warm-start is the longest)."""

    def order(item: pytest.Item) -> tuple[int, bool]:
        parts = item.path.relative_to(REPO_ROOT / "tests").parts if item.path.is_relative_to(REPO_ROOT) else ()
        tier = TIERS.index(parts[0]) if parts and parts[0] in TIERS else len(TIERS)
        return tier, uses_medical_default(item)

    items.sort(key=order)  # stable: modules and their fixtures stay together


def uses_medical_default(item: pytest.Item) -> bool:
    """Whether ``item`` runs on the embedded medical default (the ``medical`` fixture of its e2e test)."""
    return "medical" in getattr(item, "fixturenames", ())


#: ``0`` turns the background build of :func:`pytest_collection_finish` off
PREBUILD_ENV = "SORL_TEST_PREBUILD"
#: what the background process runs: the builds the tests' fixtures call, in argument order
PREBUILD_CODE = """
import sys
from sorl_verl.embedded.medical_build import ensure_embedded_medical
from sorl_verl.embedded.qa_build import ensure_embedded_default
for task in sys.argv[1:]:
    (ensure_embedded_default if task == "qa" else ensure_embedded_medical)(progress=False)
"""


_PREBUILD = pytest.StashKey[tuple[subprocess.Popen, str]]()


def prebuild_tasks(items: list[pytest.Item]) -> list[str]:
    """The embedded defaults the selected tests need: ``medical`` for a test using the ``medical``
    fixture (tests/e2e/test_e2e_cpu_medical.py), ``qa`` for every other ``e2e``-marked test (they run
    ``main_ppo`` on the QA default); ``qa`` first, as the suite's order needs them."""
    medical = [item for item in items if uses_medical_default(item)]
    qa = [item for item in items if item.get_closest_marker("e2e") and item not in medical]
    return [task for task, users in (("qa", qa), ("medical", medical)) if users]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the embedded defaults the selected tests need in a background process (``nice 10``).

    The warm-start SFT of each default (minutes, one torch thread, deterministic) then runs on a core
    the unit and integration tests leave idle instead of inside the first test that needs it. Both
    builds hold their root's build lock, so a test that arrives first waits for the build and reuses
    it; an already built default is only checked. The process's output goes to a log file named on
    the terminal; a failed build fails again, with its error, in the test that needs it.
    """
    tasks = prebuild_tasks(session.items)
    if not tasks or session.config.option.collectonly or os.environ.get(PREBUILD_ENV, "1") == "0":
        return
    log = tempfile.NamedTemporaryFile("w", prefix="sorl-prebuild-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", PREBUILD_CODE, *tasks],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.nice(10),
    )
    log.close()  # the child holds its own descriptor
    session.config.stash[_PREBUILD] = (proc, log.name)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"building embedded defaults {tasks} in the background (pid {proc.pid}, log {log.name})")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run on a skip outside :data:`ALLOWED_SKIPS`; stop a background build no test waited for
    (a build step only lands when complete); the log of one that succeeded is removed."""
    if UNEXPECTED_SKIPS and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    proc, log = session.config.stash.get(_PREBUILD, (None, None))
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)
    elif proc.returncode == 0:
        os.unlink(log)


class AllowedSkip(NamedTuple):
    """A skip the suite accepts: in test file ``path`` (from the repository root), with ``reason`` in its
    skip message, because ``why``."""

    path: str
    reason: str
    why: str


#: the only skips a run may report; any other skip, at collection or in a test, fails the run
#: (:func:`pytest_sessionfinish`): a declared dependency that fails to import must not read as green
ALLOWED_SKIPS: tuple[AllowedSkip, ...] = (
    AllowedSkip("tests/e2e/test_e2e_cpu_vllm.py", "vLLM's CPU build", "vLLM is deliberately absent from .venv; "
                "scripts/test.sh runs this file in .venv-vllm with SORL_REQUIRE_VLLM=1, where its absence fails"),
    AllowedSkip("tests/integration/test_demo_rollout_engine.py", "vLLM is installed here",
                "checks the demo's stop in a venv without vLLM (.venv); in .venv-vllm the demo would train"),
    AllowedSkip("tests/unit/test_hf_device.py", "without CUDA",
                "checks the error of a machine without CUDA; a GPU machine has CUDA"),
    *(
        AllowedSkip(path, "tomllib", "Python 3.10 (requires-python >= 3.10) has no tomllib")
        for path in ("tests/integration/test_docs_install_extras.py", "tests/integration/test_registration_paths.py")
        if sys.version_info < (3, 11)
    ),
)  # fmt: skip
#: ``nodeid: reason`` of every skip outside :data:`ALLOWED_SKIPS` in this session
UNEXPECTED_SKIPS: list[str] = []


def _check_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):  # an xfail is reported as skipped too
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    path = report.nodeid.split("::", 1)[0]
    if not any(path == allowed.path and allowed.reason in reason for allowed in ALLOWED_SKIPS):
        UNEXPECTED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped at collection (``pytest.importorskip`` at its top) is checked against the allow-list."""
    _check_skip(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A skipped test (``skipif``, ``pytest.skip``, ``importorskip`` in a fixture) is checked against the allow-list."""
    _check_skip(report)


def pytest_terminal_summary(terminalreporter) -> None:
    """Name each skip that fails the run, and where the allow-list is."""
    if UNEXPECTED_SKIPS:
        terminalreporter.section("skips outside the allow-list (tests/conftest.py ALLOWED_SKIPS): the run fails")
        for line in UNEXPECTED_SKIPS:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _no_stale_normalizer_records():
    """Each test starts with an empty SORL step ledger: the update-scaled optimizer
    (sorl_verl.algorithms.optim) scales its next step by what a SORL loss published in the process,
    so a loss computed in one test must not shrink a step that another test's optimizer takes."""

    def clear() -> None:
        ledger = getattr(sys.modules.get("sorl_verl.algorithms.optim"), "LEDGER", None)
        if ledger is not None:
            ledger.clear()

    clear()
    yield
    clear()  # also after it: a session fixture of the next test may step an optimizer before this runs


@pytest.fixture(scope="session")
def fp32() -> type[Fp32Bounds]:
    """Float32 rounding-error bounds (:class:`Fp32Bounds`) for derived tolerances."""
    return Fp32Bounds


@pytest.fixture(scope="session")
def bench_script() -> Callable[[str], ModuleType]:
    """Loads ``scripts/bench/<name>.py`` as a module (the folder is no package), once per session."""
    loaded: dict[str, ModuleType] = {}

    def load(name: str) -> ModuleType:
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(
                f"sorl_bench_{name}", REPO_ROOT / "scripts" / "bench" / f"{name}.py"
            )
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return load


def _write_grid(folder: Path, text: str, name: str = "g.yaml") -> Path:
    path = folder / "study" / name
    (folder / "config").mkdir(exist_ok=True)
    (folder / "config" / "sorl_trainer.yaml").write_text("{}\n")
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="session")
def write_grid() -> Callable[..., Path]:
    """``write_grid(folder, text, name="g.yaml")``: writes a study grid, ``text`` dedented, to
    ``folder/study/<name>`` next to an empty trainer config (``folder/config/sorl_trainer.yaml``, ``{}``),
    where the grid's default ``config_dir`` (``../config``) finds it; returns the grid's path."""
    return _write_grid


@pytest.fixture
def cell_wall_limits(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The wall limit (``timeout_s``) that ``sorl_verl.study.runner.run_grid`` gives each cell it runs, by cell key:
    ``runner.run_cell`` is replaced for the test by a stand-in that records it and writes a done record."""
    from sorl_verl.study import runner

    limits: dict[str, float] = {}

    def fake_run_cell(grid, cell, directory, inputs, *, tag, timeout_s, out, pass_fds):
        limits[cell.key] = timeout_s
        record = {"status": "done", "wall_s": 1.0, "exit_code": 0, "overrides": dict(cell.overrides)}
        runner.write_record(directory, record)
        return record

    monkeypatch.setattr(runner, "run_cell", fake_run_cell)
    return limits


@pytest.fixture
def sorl_optimizer():
    """An update-scaled optimizer in this process, as verl's actor worker builds it
    (``optimizer_impl=sorl_verl.algorithms.optim``); the ledger it reads from starts and ends each test
    empty. Modules that need it for every test: ``pytestmark = pytest.mark.usefixtures("sorl_optimizer")``."""
    import torch

    from sorl_verl.algorithms import optim

    opt = optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    optim.LEDGER.clear()
    yield opt
    optim.LEDGER.clear()
