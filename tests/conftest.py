"""Shared pytest set-up.

verl's wheel installs a top-level ``tests`` package; this suite runs in pytest's
``importlib`` import mode and never imports from ``tests.*`` so it cannot be shadowed.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("SORL_HOME", str(REPO_ROOT / ".sorl_cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray local-only (loopback) even in tests that start Ray before verl loads the plugin
# (sorl_verl/cpu/loopback.py sets the same for every process that loads it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
