#!/usr/bin/env python
"""Thin wrapper kept for old command lines: the tool is ``sorl-verl plot`` (sorl_verl/tools/plot.py)."""

import sys

from sorl_verl.tools.plot import main

if __name__ == "__main__":
    sys.exit(main())
