#!/usr/bin/env python
"""Thin wrapper kept for old command lines: the tool is ``sorl-verl eval`` (sorl_verl/tools/eval.py)."""

import sys

from sorl_verl.tools.eval import main

if __name__ == "__main__":
    sys.exit(main())
