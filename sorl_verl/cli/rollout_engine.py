"""Before ``main_ppo`` starts Ray: the rollout engine a hydra override names must be importable.

verl imports its vLLM rollout only inside the trainer, after Ray and the workers have started, and
without vLLM it dies there (``ValueError: vllm version None not supported and SGLang also not
Found``). ``scripts/demo.sh`` runs this on its hydra overrides first, so a missing engine stops the
demo in a second with the fix::

    python -m sorl_verl.cli.rollout_engine [hydra overrides...]   # exit 0, or 2 with the fix
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

ROLLOUT_NAME_KEY = "actor_rollout_ref.rollout.name"

#: rollout engine -> (module it needs, how to install it on CPU)
ENGINES: dict[str, tuple[str, str]] = {
    "vllm": (
        "vllm",
        "`bash scripts/setup_cpu_vllm.sh` (adds vLLM's CPU build to .venv; docs/cpu.md, "
        '"verl\'s vLLM rollout on CPU"), then run the demo again',
    ),
}


def requested_engine(overrides: Sequence[str]) -> str | None:
    """The value of the last ``actor_rollout_ref.rollout.name=`` override (``+``/``++`` forms too),
    as hydra applies the last one; None when no override names it."""
    engine = None
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        if sep and key == ROLLOUT_NAME_KEY:
            engine = value.strip().strip("'\"")
    return engine


def missing_engine(overrides: Sequence[str]) -> str | None:
    """The error for an engine the overrides name whose module this Python cannot import, else None."""
    engine = requested_engine(overrides)
    if engine not in ENGINES:
        return None
    module, fix = ENGINES[engine]
    if importlib.util.find_spec(module) is not None:
        return None
    return (
        f"{ROLLOUT_NAME_KEY}={engine} needs the Python package {module!r}, which {sys.prefix} does not have "
        f"(scripts/setup_env.sh, which the demo runs, does not install it): run {fix}"
    )


def main(argv: list[str] | None = None) -> int:
    error = missing_engine(sys.argv[1:] if argv is None else argv)
    if error is None:
        return 0
    print(f"[demo] error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
