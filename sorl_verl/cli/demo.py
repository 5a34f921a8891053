"""``sorl-verl demo``: the CPU main job, which is ``scripts/demo.sh`` of a source checkout.

The demo script sets up the checkout's ``.venv``, builds the embedded default and drives verl's
``main_ppo`` with the recipe configs under ``recipe/sorl/config``; none of that ships in the
wheel. From a source checkout (an editable install) this runs the script with the given
arguments; from a plain ``pip install`` it says so and exits 2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sorl_verl


def demo_script() -> Path | None:
    """``scripts/demo.sh`` of the checkout this package was imported from, if there is one."""
    root = Path(sorl_verl.__file__).resolve().parents[1]
    script = root / "scripts" / "demo.sh"
    return script if script.is_file() and (root / "recipe" / "sorl" / "config").is_dir() else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script = demo_script()
    if script is None:
        print(
            "sorl-verl demo: error: the demo runs scripts/demo.sh of a source checkout (it builds the embedded "
            "default and uses recipe/sorl/config), and this sorl_verl is installed from a wheel at "
            f"{Path(sorl_verl.__file__).resolve().parent}. Clone the repository and run `bash scripts/demo.sh` "
            "(or `pip install -e .` there and `sorl-verl demo`).",
            file=sys.stderr,
        )
        return 2
    return subprocess.call(["bash", str(script), *argv])
