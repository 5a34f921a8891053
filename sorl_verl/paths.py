"""Where the project keeps generated artefacts: one cache for the demo, the tests, the study and
every ``sorl-verl`` command.

``data_home()`` is ``$SORL_HOME`` when set, else ``~/.cache/sorl_verl``. Under it: the embedded
defaults (``embedded``, ``embedded-<warm-start>``, ``embedded_medical``...), the demo's runs
(``runs/<algo>-<task>-<warm-start>-<YYYYmmdd-HHMMSS>/``) and the study's cells (``study/<grid>/``).
"""

from __future__ import annotations

import os
from pathlib import Path

#: the default root when ``$SORL_HOME`` is unset
DEFAULT_HOME = Path("~/.cache/sorl_verl")


def data_home() -> Path:
    """Root for generated data: ``$SORL_HOME`` or ``~/.cache/sorl_verl``; created on demand."""
    root = Path(os.environ.get("SORL_HOME") or DEFAULT_HOME).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root
