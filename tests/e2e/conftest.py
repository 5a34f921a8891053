"""Shared set-up of the end-to-end tests: the embedded default, a live retrieval server, and a
runner of verl's ``python -m verl.trainer.main_ppo`` on CPU that also records the addresses every
process of the run listens on."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "recipe" / "sorl" / "config"
RUN_TIMEOUT_S = 1200
#: addresses a loopback-only process may listen on (IPv4, IPv6, IPv4-mapped IPv6)
LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})

#: small sizes: 4 prompts x 2 samples, episodes of up to 3 model turns
SMALL = [
    "data.train_batch_size=4",
    "data.val_batch_size=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_epochs=1",  # one update per rollout: on-policy, ratios exactly 1
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "data.max_response_length=448",
    "sorl.agent.max_turns=3",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
]


#: positions of one SMALL row: the CPU overlay's max_prompt_length (256) + SMALL's max_response_length
SMALL_SEQ_LEN = 256 + 448


@dataclass(frozen=True)
class LogprobNoise:
    """Float32 noise of the embedded model's token log-probs, from its weights and Fp32Bounds.

    Two float32 evaluations of one token's log-prob (actor vs rollout engine, or the actor in two
    batch compositions) differ by at most ``Fp32Bounds.logprob(config, seq_len, L)`` with ``L`` a bound
    on |logit|: the final RMSNorm's output has L2 norm ``sqrt(hidden) * max|gamma|`` at most (the
    normalized vector has norm ``sqrt(hidden)``), so ``|logit_v| <= sqrt(hidden) max|gamma| ||E_v||``
    (the tied embedding row, or lm_head's). ``drift`` bounds how far every weight moved since (a
    number of Adam steps, :meth:`adam_step`): gamma by ``drift``, a row's norm by ``sqrt(hidden)
    drift``.
    """

    config: object
    fp32: type
    gamma: float
    row_norm: float

    @staticmethod
    def adam_step(lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> float:
        """The most one Adam(W) step moves a parameter (Kingma & Ba 2015, section 2.1): ``lr (1 - b1) /
        sqrt(1 - b2)`` when ``1 - b1 > sqrt(1 - b2)`` (verl's betas: 3.16 lr), else ``lr``; plus AdamW's
        decay ``lr * wd * |w|``, under ``lr`` for verl's wd 0.01 and weights below 100."""
        b1, b2 = betas
        return lr * max(1.0, (1 - b1) / math.sqrt(1 - b2)) + lr

    def logit_bound(self, drift: float = 0.0) -> float:
        root = math.sqrt(self.config.hidden_size)
        return root * (self.gamma + drift) * (self.row_norm + root * drift)

    def log_prob(self, drift: float = 0.0, seq_len: int = SMALL_SEQ_LEN) -> float:
        """Bound on |log p_a - log p_b| of one token between two float32 evaluations."""
        return self.fp32.logprob(self.config, seq_len, self.logit_bound(drift))

    def prob(self, drift: float = 0.0, seq_len: int = SMALL_SEQ_LEN) -> float:
        """Bound on |p_a - p_b| (``p <= 1``, ``|e^d - 1| <= e^|d| - 1``): verl's rollout_probs_diff_max."""
        return math.expm1(self.log_prob(drift, seq_len))


@pytest.fixture(scope="session")
def adam_step() -> Callable[[float], float]:
    """``adam_step(lr)``: the most one Adam(W) step at ``lr`` moves a parameter (:meth:`LogprobNoise.adam_step`)."""
    return LogprobNoise.adam_step


@pytest.fixture(scope="session")
def logprob_noise(embedded, fp32) -> LogprobNoise:
    """:class:`LogprobNoise` of the embedded QA default's warm-started model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model_dir = Path(embedded[0].model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    gamma = float(weights["model.norm.weight"].abs().max())
    return LogprobNoise(config, fp32, gamma, float(head.double().norm(dim=1).max()))


@dataclass
class MainPPORun:
    """A finished main_ppo run: verl's metric records, its log, and every (ip, port, process) it listened on."""

    records: list[dict]
    log: Path
    listening: set[tuple[str, int, str]] = field(default_factory=set)

    def train_steps(self) -> dict[int, dict]:
        return {r["step"]: r["data"] for r in self.records if "timing_s/step" in r["data"]}

    def exposed_listeners(self) -> list[tuple[str, int, str]]:
        """Listening sockets of the run bound beyond the loopback interface."""
        return sorted(s for s in self.listening if s[0] not in LOOPBACK_ADDRESSES)


@pytest.fixture(scope="session")
def small_overrides() -> list[str]:
    """The small sizes every e2e run starts from (a copy: tests may drop or add entries)."""
    return list(SMALL)


@pytest.fixture(scope="session")
def embedded():
    from sorl_verl.cpu.chatml_alias import chatml_alias
    from sorl_verl.embedded.qa_build import ensure_embedded_default

    paths = ensure_embedded_default(progress=False)
    return paths, chatml_alias(paths.model_dir)


@pytest.fixture(scope="session")
def retrieval(embedded):
    from sorl_verl.retrieval.server import serve_in_background

    server = serve_in_background(embedded[0].index_dir, subprocess_mode=True)
    yield server
    server.stop()


def listening_sockets(root: psutil.Process) -> set[tuple[str, int, str]]:
    """(ip, port, process name) of every listening TCP socket of ``root`` and its descendants."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for proc in procs:
        try:
            name = proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port, name))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class SocketWatcher(threading.Thread):
    """Polls the listening sockets of a process tree until stopped (Ray's processes come and go)."""

    def __init__(self, pid: int, interval_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.found: set[tuple[str, int, str]] = set()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.found |= listening_sockets(self.root)

    def stop(self) -> set[tuple[str, int, str]]:
        self._stop_event.set()
        self.join()
        return self.found


def read_records(metrics: Path) -> list[dict]:
    """verl's file-logger records so far (a last line still being written is left out)."""
    if not metrics.exists():
        return []
    records = []
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (Ray's GCS, raylet and workers), children first."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=30)


@pytest.fixture(scope="session")
def main_ppo(embedded, retrieval):
    """``main_ppo(run_dir, algo_args, extra) -> MainPPORun`` (asserting exit code 0).

    With ``kill_when`` (a predicate on the metric records so far, polled every second) the run's
    whole process tree is killed with SIGKILL as soon as it holds, and the exit code is not checked.
    """
    paths, model = embedded

    def run(
        run_dir: Path,
        algo_args: list[str],
        extra: list[str],
        small: list[str] = SMALL,
        kill_when: Callable[[list[dict]], bool] | None = None,
    ) -> MainPPORun:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / f"metrics-{len(list(run_dir.glob('metrics-*.jsonl')))}.jsonl"
        cmd = [
            sys.executable, "-m", "verl.trainer.main_ppo",
            "--config-path", str(CONFIG_DIR), "--config-name", "sorl_trainer", "+task=search_qa", "+platform=cpu",
            f"data.train_files={paths.parquet['train']}", f"data.val_files={paths.parquet['val']}",
            f"actor_rollout_ref.model.path={model}",
            f"sorl.agent.retrieval_url={retrieval.retrieve_url}",
            f"trainer.default_local_dir={run_dir / 'ckpt'}",
            "trainer.logger=[console,file]",
            *small, *algo_args, *extra,
        ]  # fmt: skip
        env = {**os.environ, "VERL_PLATFORM": "cpu", "VERL_FILE_LOGGER_PATH": str(metrics),
               "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        log = run_dir / f"{metrics.stem}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
            watcher = SocketWatcher(proc.pid)
            watcher.start()
            killed = False
            try:
                returncode = proc.wait(timeout=RUN_TIMEOUT_S) if kill_when is None else None
                deadline = time.monotonic() + RUN_TIMEOUT_S
                while returncode is None and not killed and time.monotonic() < deadline:
                    if kill_when(read_records(metrics)):
                        kill_tree(proc.pid)
                        killed = True
                    returncode = proc.poll()
                    time.sleep(1.0)
            finally:
                if proc.poll() is None:
                    proc.kill()
                listening = watcher.stop()
        if killed:
            return MainPPORun(records=read_records(metrics), log=log, listening=listening)
        tail = "\n".join(log.read_text().splitlines()[-40:])
        assert returncode == 0, f"main_ppo exited {returncode}; log {log}:\n{tail}"
        return MainPPORun(records=read_records(metrics), log=log, listening=listening)

    return run


#: SO-PPO with every model verl can place on the CPU worker: actor, critic and the KL loss's reference model
SO_PPO = [
    "algorithm.adv_estimator=so_ppo",
    "actor_rollout_ref.actor.policy_loss.loss_mode=so_ppo",
    "critic.enable=True",
    "actor_rollout_ref.actor.use_kl_loss=True",
]


@dataclass(frozen=True)
class GuardedRun:
    """The forced-collapse SO-PPO scenario (see :func:`guarded_so_ppo`), run once per session.

    ``first``: the run SIGKILLed after step 5, with ``first_prompts`` (step -> its sorted prompts) as
    it dumped them and ``first_ckpt``, a copy of its checkpoint folder as it left it; ``resumed``:
    verl's resume of it to step 6, which dumps over the same folder (``root/rollouts``, verl's
    ``trainer.rollout_data_dir``) and checkpoints into the same ``root/ckpt`` (its final step too).
    """

    root: Path
    first: MainPPORun
    first_prompts: dict[int, list[str]]
    first_ckpt: Path
    resumed: MainPPORun
    lr: float
    fault: float
    backoff: float

    @property
    def ckpt(self) -> Path:
        """The checkpoint folder after both launches."""
        return self.root / "ckpt"

    def prompts(self, step: int) -> list[str]:
        """The sorted prompts of ``step``'s rollout as dumped last (by the resumed run from step 5 on)."""
        return dumped_prompts(self.root / "rollouts", step)


def dumped_prompts(rollouts: Path, step: int) -> list[str]:
    lines = (rollouts / f"{step}.jsonl").read_text().splitlines()
    return sorted(json.loads(line)["input"] for line in lines)


@pytest.fixture(scope="session")
def guarded_so_ppo(tmp_path_factory, main_ppo) -> GuardedRun:
    """One SO-PPO run with a critic and the KL loss (sync trainer, small sizes, 24 greedy validation
    questions every 2 steps, verl's own checkpoint every 4 steps) at the CPU platform's lr 1e-4 with
    ``sorl.fault_injection`` raising the actor's learning rate 10^3-fold (to 0.1) on steps 3 and 4, the
    collapse guard on (rule drop 0.3, patience 1, backoff 0.5, one restore); SIGKILLed after step 5, then
    resumed by verl to step 6.

    Shared by three tests that read the same records, each of which launched main_ppo itself before:
    the guard test (restore of actor and critic, kill, resume), the step test (SORL metrics of the clean
    steps 1-2 and of the resumed steps, resume from the latest checkpoint) and the SO-PPO test (critic
    values reach the turn-level GAE, the reference model's KL loss), whose 2-step run at lr 1e-4 is this
    run's steps 1-2.
    """
    lr, fault, backoff = 1e-4, 1e3, 0.5
    guard = [
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "data.val_max_samples=24",
        "data.val_batch_size=24",
        "trainer.test_freq=2",
        "trainer.save_freq=4",
        "sorl.guard.enable=true",
        "sorl.guard.rule=drop",  # the rule the test was written for (the guard's default is stderr)
        "sorl.guard.drop=0.3",
        "sorl.guard.patience=1",
        f"sorl.guard.backoff={backoff}",
        "sorl.guard.max_restores=1",
        f"sorl.fault_injection.lr_factor={fault}",
        "sorl.fault_injection.from_step=3",
        "sorl.fault_injection.until_step=5",
    ]
    root = tmp_path_factory.mktemp("guarded_so_ppo")
    rollouts = root / "rollouts"

    def after_step_5(records: list[dict]) -> bool:
        done = any(r["step"] >= 5 and "timing_s/step" in r["data"] for r in records)
        return done and (rollouts / "5.jsonl").exists() and len(dumped_prompts(rollouts, 5)) == 8  # 4 prompts x 2

    dump = f"trainer.rollout_data_dir={rollouts}"
    first = main_ppo(root, SO_PPO, [*guard, dump, "trainer.total_training_steps=8", "trainer.resume_mode=disable"],
                     kill_when=after_step_5)  # fmt: skip
    first_prompts = {s: dumped_prompts(rollouts, s) for s in range(1, 6) if (rollouts / f"{s}.jsonl").exists()}
    first_ckpt = shutil.copytree(root / "ckpt", root / "ckpt_after_kill", symlinks=True)  # ~15 MB per step
    resumed = main_ppo(root, SO_PPO, [*guard, dump, "trainer.total_training_steps=6", "trainer.resume_mode=auto"])
    return GuardedRun(root, first, first_prompts, first_ckpt, resumed, lr=lr, fault=fault, backoff=backoff)
